// Data-parallel benchmark: flotilla DataParallel on Open MPI and on Gloo vs PyTorch
// DistributedDataParallel over Gloo, 2 ranks, same GPT, same batch, same bucket size, measured in the
// same run (trials alternate MPI, Gloo, PyTorch). Reports the median synced step, the median
// compute-only step (no gradient sync), and the communication left exposed after backward
// (synced - compute-only). Writes its section of docs/BENCHMARKS.md.
//   node --import tsx bench/ddp.ts [--steps 10] [--bucket-mb 2]
import { join } from 'node:path';
import { runWorld } from '../test/helpers/world.js';
import { median, writeSection, runTorchPeers, parseBench } from './report.js';

const argv = process.argv.slice(2);
const arg = (name: string, dflt: number) => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const opts = { steps: arg('--steps', 10), warmup: 2, bucketMb: arg('--bucket-mb', 2) };
const trials = arg('--trials', 3);
const root = join(import.meta.dirname, '..');

interface RankBench { rank: number; synced: number[]; local: number[]; exposed?: number[]; cpu: { main: number; other: number }; params: number }
const parse = (out: string): RankBench => parseBench<RankBench>(out);

async function flotilla(backend: 'mpi' | 'gloo'): Promise<RankBench[]> {
  const r = await runWorld({ nproc: 2, script: join(root, 'bench', 'ddp_rank.ts'), args: [JSON.stringify(opts)], timeoutMs: 600_000, backend });
  if (r.codes.some((c) => c !== 0)) throw new Error(`flotilla ranks failed:\n${r.outputs.join('\n')}`);
  return r.outputs.map(parse);
}

async function pytorch(): Promise<RankBench[]> {
  return (await runTorchPeers(join(root, 'bench', 'ddp_peer.py'), [JSON.stringify(opts)])).map(parse);
}

// Alternate the two sides: this machine's load drifts, and PyTorch's exposed communication in
// particular swings between runs, so one trial each is not a comparison.
const mps: RankBench[][] = [], fls: RankBench[][] = [], pts: RankBench[][] = [];
for (let t = 0; t < trials; t++) {
  process.stderr.write(`trial ${t + 1}/${trials}\n`);
  mps.push(await flotilla('mpi'));
  fls.push(await flotilla('gloo'));
  pts.push(await pytorch());
}
const stat = (rs: RankBench[], k: 'synced' | 'local') => median(rs.flatMap((r) => r[k]));
const row = (name: string, rs: RankBench[]) => {
  const s = stat(rs, 'synced'), l = stat(rs, 'local');
  return { name, synced: s, local: l, exposed: Math.max(0, s - l) };
};
const mp = mps.flat(), fl = fls.flat(), pt = pts.flat();
const m = row('flotilla DataParallel (MPI)', mp), a = row('flotilla DataParallel (Gloo)', fl), b = row('PyTorch DDP (Gloo)', pt);
const ratio = m.synced / b.synced;
const perTrial = (xs: RankBench[][]) => xs.map((f, t) => (stat(f, 'synced') / stat(pts[t]!, 'synced')).toFixed(3)).join(', ');
const table = [
  '| implementation | synced step (ms) | compute-only step (ms) | exposed communication (ms) | synced / PyTorch |',
  '|---|---:|---:|---:|---:|',
  ...[m, a, b].map((r) => `| ${r.name} | ${r.synced.toFixed(1)} | ${r.local.toFixed(1)} | ${r.exposed.toFixed(1)} | ${(r.synced / b.synced).toFixed(3)} |`),
  '',
  `**flotilla (MPI) / PyTorch DDP (Gloo), synced step: ${ratio.toFixed(3)}** (target <= 0.90: ${ratio <= 0.9 ? 'met' : '**missed**'} in this run; per trial: ${perTrial(mps)}). ` +
    `flotilla (Gloo) / PyTorch: ${(a.synced / b.synced).toFixed(3)} (per trial: ${perTrial(fls)}). ` +
    `Compute-only steps, flotilla / PyTorch: ${(m.local / b.local).toFixed(3)} (MPI run), ${(a.local / b.local).toFixed(3)} (Gloo run). ` +
    `flotilla's own time waiting in finishGradSync (median): ${median(mp.flatMap((r) => r.exposed ?? [])).toFixed(1)} ms on MPI, ${median(fl.flatMap((r) => r.exposed ?? [])).toFixed(1)} ms on Gloo.`,
].join('\n');
// CPU time per compute-only step, by thread (means over ranks and trials): where a compute-only
// step's time goes besides the kernels on the main thread.
const cpuRow = (name: string, rs: RankBench[]) => {
  const mainMs = rs.reduce((acc, r) => acc + r.cpu.main, 0) / rs.length, otherMs = rs.reduce((acc, r) => acc + r.cpu.other, 0) / rs.length;
  return { name, mainMs, otherMs, total: mainMs + otherMs };
};
const cpuRows = [cpuRow('flotilla (MPI run)', mp), cpuRow('flotilla (Gloo run)', fl), cpuRow('PyTorch', pt)];
const cpuTable = [
  '| compute-only step, CPU per rank | main thread (ms) | all other threads (ms) | total (ms) | total / PyTorch |',
  '|---|---:|---:|---:|---:|',
  ...cpuRows.map((r) => `| ${r.name} | ${r.mainMs.toFixed(1)} | ${r.otherMs.toFixed(1)} | ${r.total.toFixed(1)} | ${(r.total / cpuRows[2]!.total).toFixed(3)} |`),
].join('\n');
console.log(table);
console.log(cpuTable);
writeSection('ddp', [
  '## Data parallel: GPT training step on 2 ranks',
  '',
  `GPT with ${fl[0]!.params.toLocaleString('en-US')} parameters (4 layers, width 256, 8 heads, context 128, vocab 256), 8 x 128 tokens per rank, ` +
    `AdamW, one intra-op thread per rank, bucket size ${opts.bucketMb} MiB for all three; flotilla on Open MPI (shared memory, ranks under mpirun) and on Gloo over loopback, PyTorch DDP on Gloo over loopback; ` +
    `${trials} alternating trials of ${opts.steps} measured steps per rank after ${opts.warmup} warm-up (medians over all of them). ` +
    'Exposed communication = synced step - compute-only step (no_sync / noSync).',
  '',
  table,
  '',
  'CPU time per compute-only step and rank, by thread (schedstat of every thread over the noSync steps; main = the thread running the kernels):',
  '',
  cpuTable,
  '',
  `Reproduce: \`node --import tsx bench/ddp.ts --steps ${opts.steps} --bucket-mb ${opts.bucketMb} --trials ${trials}\``,
].join('\n'));
