// Data-parallel benchmark: flotilla DataParallel vs PyTorch DistributedDataParallel over Gloo, 2
// ranks, same GPT, same batch, same bucket size, measured in the same run. Reports the median
// synced step, the median compute-only step (no gradient sync), and the communication left exposed
// after backward (synced - compute-only). Writes its section of docs/BENCHMARKS.md.
//   node --import tsx bench/ddp.ts [--steps 10] [--bucket-mb 2]
import { spawn } from 'node:child_process';
import { join } from 'node:path';
import { runWorld, freePort } from '../test/helpers/world.js';
import { median, writeSection } from './report.js';

const argv = process.argv.slice(2);
const arg = (name: string, dflt: number) => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const opts = { steps: arg('--steps', 10), warmup: 2, bucketMb: arg('--bucket-mb', 2) };
const trials = arg('--trials', 3);
const root = join(import.meta.dirname, '..');

interface RankBench { rank: number; synced: number[]; local: number[]; exposed?: number[]; params: number }
const parse = (out: string): RankBench => {
  const line = out.split('\n').find((l) => l.includes('BENCH '));
  if (!line) throw new Error(`a benchmark rank printed no result:\n${out}`);
  return JSON.parse(line.slice(line.indexOf('BENCH ') + 6)) as RankBench;
};

async function flotilla(): Promise<RankBench[]> {
  const r = await runWorld({ nproc: 2, script: join(root, 'bench', 'ddp_rank.ts'), args: [JSON.stringify(opts)], timeoutMs: 600_000 });
  if (r.codes.some((c) => c !== 0)) throw new Error(`flotilla ranks failed:\n${r.outputs.join('\n')}`);
  return r.outputs.map(parse);
}

async function pytorch(): Promise<RankBench[]> {
  const port = await freePort();
  const runs = [0, 1].map((rank) => new Promise<string>((res, rej) => {
    const child = spawn('/usr/bin/python3', [join(root, 'bench', 'ddp_peer.py'), JSON.stringify(opts)], {
      env: { ...process.env, RANK: String(rank), WORLD_SIZE: '2', LOCAL_RANK: String(rank), MASTER_ADDR: '127.0.0.1', MASTER_PORT: String(port), OMP_NUM_THREADS: '1' },
    });
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (out += d));
    child.on('exit', (code) => (code === 0 ? res(out) : rej(new Error(`PyTorch rank ${rank} exited ${code}:\n${out}`))));
  }));
  return (await Promise.all(runs)).map(parse);
}

// Alternate the two sides: this machine's load drifts, and PyTorch's exposed communication in
// particular swings between runs, so one trial each is not a comparison.
const fls: RankBench[][] = [], pts: RankBench[][] = [];
for (let t = 0; t < trials; t++) {
  fls.push(await flotilla());
  pts.push(await pytorch());
}
const stat = (rs: RankBench[], k: 'synced' | 'local') => median(rs.flatMap((r) => r[k]));
const row = (name: string, rs: RankBench[]) => {
  const s = stat(rs, 'synced'), l = stat(rs, 'local');
  return { name, synced: s, local: l, exposed: Math.max(0, s - l) };
};
const fl = fls.flat(), pt = pts.flat();
const a = row('flotilla DataParallel', fl), b = row('PyTorch DDP (Gloo)', pt);
const ratio = a.synced / b.synced;
const perTrial = fls.map((f, t) => (stat(f, 'synced') / stat(pts[t]!, 'synced')).toFixed(3));
const table = [
  '| implementation | synced step (ms) | compute-only step (ms) | exposed communication (ms) |',
  '|---|---:|---:|---:|',
  ...[a, b].map((r) => `| ${r.name} | ${r.synced.toFixed(1)} | ${r.local.toFixed(1)} | ${r.exposed.toFixed(1)} |`),
  '',
  `**flotilla / PyTorch (synced step): ${ratio.toFixed(3)}** (target <= 0.90; per trial: ${perTrial.join(', ')}); compute-only steps: ${(a.local / b.local).toFixed(3)}. ` +
    `flotilla's own time waiting in finishGradSync: ${median(fl.flatMap((r) => r.exposed ?? [])).toFixed(1)} ms (median).`,
].join('\n');
console.log(table);
writeSection('ddp', [
  '## Data parallel: GPT training step on 2 ranks',
  '',
  `GPT with ${fl[0]!.params.toLocaleString('en-US')} parameters (4 layers, width 256, 8 heads, context 128, vocab 256), 8 x 128 tokens per rank, ` +
    `AdamW, one intra-op thread per rank, Gloo over loopback, bucket size ${opts.bucketMb} MiB for both, ${trials} alternating trials of ${opts.steps} measured steps per rank after ${opts.warmup} warm-up (medians over all of them). ` +
    'Exposed communication = synced step - compute-only step (no_sync / noSync).',
  '',
  table,
  '',
  `Reproduce: \`node --import tsx bench/ddp.ts --steps ${opts.steps} --bucket-mb ${opts.bucketMb} --trials ${trials}\``,
].join('\n'));
