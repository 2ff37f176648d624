// Data parallel on 2 ranks with bf16-mixed: flotilla DataParallel (Gloo and Open MPI) vs PyTorch
// DDP over Gloo with torch.autocast('cpu', bfloat16), and both in float32, in the same run (trials
// alternate). GPT 4 layers, width 256 (bench/ddp_rank.ts and bench/ddp_peer.py with a precision
// option), 8 x 128 tokens per rank, 25 MiB buckets. Reports median synced steps and the ratios.
//   node --import tsx bench/precision_ddp.ts [--steps 6] [--trials 2] [--no-write]
import { join } from 'node:path';
import os from 'node:os';
import { runWorld } from '../test/helpers/world.js';
import { median, writeSection, runTorchPeers, parseBench } from './report.js';

const argv = process.argv.slice(2);
const arg = (name: string, dflt: string) => {
  const i = argv.indexOf(name);
  return i >= 0 ? argv[i + 1]! : dflt;
};
const steps = Number(arg('--steps', '6'));
const trials = Number(arg('--trials', '2'));
const root = join(import.meta.dirname, '..');
type Side = 'flotilla-gloo' | 'flotilla-mpi' | 'pytorch';
type Precision = 'fp32' | 'bf16-mixed';

/** Median synced step (wall, ms) and median main-thread CPU of a compute-only pass (ms) over both ranks. */
async function run(side: Side, precision: Precision): Promise<[number, number]> {
  const opts = JSON.stringify({ steps, warmup: 2, bucketMb: 25, precision });
  let outs: string[];
  if (side === 'pytorch') outs = await runTorchPeers(join(root, 'bench', 'ddp_peer.py'), [opts]);
  else {
    const r = await runWorld({ nproc: 2, script: join(root, 'bench', 'ddp_rank.ts'), args: [opts], timeoutMs: 600_000, backend: side === 'flotilla-mpi' ? 'mpi' : 'gloo' });
    if (r.codes.some((c) => c !== 0)) throw new Error(`flotilla ranks failed:\n${r.outputs.join('\n')}`);
    outs = r.outputs;
  }
  const b = outs.map((o) => parseBench<{ synced: number[]; cpu: { main: number } }>(o));
  return [median(b.flatMap((x) => x.synced)), median(b.map((x) => x.cpu.main))];
}

const runs = new Map<string, number[]>();
const cpus = new Map<string, number[]>();
const load0 = os.loadavg()[0]!;
const sides: Side[] = ['flotilla-gloo', 'flotilla-mpi', 'pytorch'];
for (let t = 0; t < trials; t++) {
  for (const precision of ['fp32', 'bf16-mixed'] as const) {
    for (const side of t % 2 ? [...sides].reverse() : sides) {
      process.stderr.write(`trial ${t + 1}/${trials}, ${side}, ${precision}\n`);
      const key = `${side}/${precision}`;
      try {
        const [wall, cpu] = await run(side, precision);
        runs.set(key, [...(runs.get(key) ?? []), wall]);
        cpus.set(key, [...(cpus.get(key) ?? []), cpu]);
      } catch (e) {
        if (side !== 'flotilla-mpi') throw e;
        process.stderr.write(`  (Open MPI run failed, left out: ${(e as Error).message.split('\n')[0]})\n`);
      }
    }
  }
}
const med = (k: string) => (runs.has(k) ? median(runs.get(k)!) : NaN);
const cmed = (k: string) => (cpus.has(k) ? median(cpus.get(k)!) : NaN);
const ac = med('pytorch/bf16-mixed'), pf = med('pytorch/fp32'), cac = cmed('pytorch/bf16-mixed');
const rows = [...runs.keys()].map((k) => `| ${k} | ${med(k).toFixed(1)} ms | ${(med(k) / ac).toFixed(3)} | ${(med(k) / pf).toFixed(3)} | ${cmed(k).toFixed(1)} ms | ${(cmed(k) / cac).toFixed(3)} |`);
const table = [
  '| side / precision | synced step (median) | / PyTorch autocast bf16 | / PyTorch fp32 | compute-only pass, main-thread CPU | CPU / PyTorch autocast bf16 |',
  '|---|---:|---:|---:|---:|---:|',
  ...rows,
].join('\n');
console.log(table);
if (!argv.includes('--no-write')) {
  writeSection('precision-ddp', [
    '## bf16-mixed on 2 data-parallel ranks vs PyTorch DDP + autocast',
    '',
    'GPT 4 layers, width 256, 8 x 128 tokens per rank, AdamW, 25 MiB buckets, one intra-op thread per rank; PyTorch DDP over ' +
      'Gloo, its forward under `torch.autocast(\'cpu\', dtype=torch.bfloat16)` for bf16; flotilla DataParallel with `autocast(\'bf16-mixed\')` ' +
      `(float32 gradient buckets, float32 all-reduce). ${trials} trials of ${steps} synced steps per side after 2 warmup steps, alternating; ` +
      'medians over both ranks.',
    '',
    'The CPU column is the main thread\'s CPU time (schedstat) in one forward and backward without sync, where the kernels run: ' +
      'it depends far less on other load than wall time does.',
    `Load average of the machine (1 min) at the start and the end of this run: ${load0.toFixed(1)} and ${os.loadavg()[0]!.toFixed(1)} on ${os.cpus().length} cores.`,
    '',
    `Reproduce: \`node --import tsx bench/precision_ddp.ts --steps ${steps} --trials ${trials}\`.`,
    '',
    table,
  ].join('\n'));
}
