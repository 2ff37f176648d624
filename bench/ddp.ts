// Data-parallel benchmark: flotilla DataParallel on Open MPI and on Gloo vs PyTorch
// DistributedDataParallel over Gloo, 2 ranks, same GPT, same batch, same bucket size, measured in the
// same run (trials alternate MPI, Gloo, PyTorch). Reports the median synced step, the median
// compute-only step (no gradient sync), and the communication left exposed after backward
// (synced - compute-only). Writes its section of docs/BENCHMARKS.md.
//   node --import tsx bench/ddp.ts [--steps 10] [--bucket-mb 2,25] [--trials 3] [--no-write]
import { join } from 'node:path';
import { runWorld } from '../test/helpers/world.js';
import { median, writeSection, runTorchPeers, parseBench } from './report.js';

const argv = process.argv.slice(2);
const arg = (name: string, dflt: string) => {
  const i = argv.indexOf(name);
  return i >= 0 ? argv[i + 1]! : dflt;
};
const steps = Number(arg('--steps', '10'));
const trials = Number(arg('--trials', '3'));
// 25 MiB is both frameworks' default bucket size; 2 MiB gives both many buckets to overlap.
const bucketSizes = arg('--bucket-mb', '2,25').split(',').map(Number);
const root = join(import.meta.dirname, '..');

interface RankBench { rank: number; synced: number[]; local: number[]; exposed?: number[]; opt: number[]; cpu: { main: number; other: number }; params: number }
const parse = (out: string): RankBench => parseBench<RankBench>(out);
type Side = 'mpi' | 'gloo' | 'pytorch';

async function runSide(side: Side, bucketMb: number): Promise<RankBench[]> {
  const opts = JSON.stringify({ steps, warmup: 2, bucketMb });
  if (side === 'pytorch') return (await runTorchPeers(join(root, 'bench', 'ddp_peer.py'), [opts])).map(parse);
  const r = await runWorld({ nproc: 2, script: join(root, 'bench', 'ddp_rank.ts'), args: [opts], timeoutMs: 600_000, backend: side });
  if (r.codes.some((c) => c !== 0)) throw new Error(`flotilla ranks failed:\n${r.outputs.join('\n')}`);
  return r.outputs.map(parse);
}

// Alternate the sides: this machine's load drifts, and PyTorch's exposed communication in
// particular swings between runs, so one trial each is not a comparison.
const sides: Side[] = ['mpi', 'gloo', 'pytorch'];
const runs = new Map<string, RankBench[][]>(); // `${side}@${mb}` -> per trial, every rank's result
for (let t = 0; t < trials; t++) {
  for (const mb of bucketSizes) {
    for (const side of sides) {
      process.stderr.write(`trial ${t + 1}/${trials}, ${mb} MiB buckets, ${side}\n`);
      const key = `${side}@${mb}`;
      runs.set(key, [...(runs.get(key) ?? []), await runSide(side, mb)]);
    }
  }
}

const all = (side: Side, mb: number) => runs.get(`${side}@${mb}`)!.flat();
const stat = (rs: RankBench[], k: 'synced' | 'local' | 'opt') => median(rs.flatMap((r) => r[k]));
const names: Record<Side, string> = { mpi: 'flotilla DataParallel (MPI)', gloo: 'flotilla DataParallel (Gloo)', pytorch: 'PyTorch DDP (Gloo)' };
const ratios: string[] = [];
const sections: string[] = [];
for (const mb of bucketSizes) {
  const pt = all('pytorch', mb);
  const base = stat(pt, 'synced');
  const perTrial = (side: Side) => runs.get(`${side}@${mb}`)!.map((f, t) => (stat(f, 'synced') / stat(runs.get(`pytorch@${mb}`)![t]!, 'synced')).toFixed(3)).join(', ');
  const rows = sides.map((side) => {
    const rs = all(side, mb);
    const s = stat(rs, 'synced'), l = stat(rs, 'local');
    return `| ${names[side]} | ${s.toFixed(1)} | ${l.toFixed(1)} | ${Math.max(0, s - l).toFixed(1)} | ${stat(rs, 'opt').toFixed(1)} | ${(s / base).toFixed(3)} |`;
  });
  const m = stat(all('mpi', mb), 'synced') / base, g = stat(all('gloo', mb), 'synced') / base;
  ratios.push(`${mb} MiB: ${m.toFixed(3)}`);
  sections.push([
    `### ${mb} MiB buckets${mb === 25 ? ' (both frameworks\' default)' : ''}`,
    '',
    '| implementation | synced step (ms) | compute-only step (ms) | exposed communication (ms) | optimizer step (ms) | synced / PyTorch |',
    '|---|---:|---:|---:|---:|---:|',
    ...rows,
    '',
    `**flotilla (MPI) / PyTorch DDP (Gloo), synced step: ${m.toFixed(3)}** (target <= 0.90: ${m <= 0.9 ? 'met' : '**missed**'} in this run; per trial: ${perTrial('mpi')}). ` +
      `flotilla (Gloo) / PyTorch: ${g.toFixed(3)} (per trial: ${perTrial('gloo')}). ` +
      `Compute-only steps, flotilla / PyTorch: ${(stat(all('mpi', mb), 'local') / stat(pt, 'local')).toFixed(3)} (MPI run), ${(stat(all('gloo', mb), 'local') / stat(pt, 'local')).toFixed(3)} (Gloo run). ` +
      `flotilla's own time waiting in finishGradSync (median): ${median(all('mpi', mb).flatMap((r) => r.exposed ?? [])).toFixed(1)} ms on MPI, ${median(all('gloo', mb).flatMap((r) => r.exposed ?? [])).toFixed(1)} ms on Gloo.`,
  ].join('\n'));
}

// CPU time per compute-only pass, by thread (means over ranks, trials and bucket sizes): where the
// time goes besides the kernels on the main thread.
const cpuRow = (side: Side) => {
  const rs = bucketSizes.flatMap((mb) => all(side, mb));
  const mainMs = rs.reduce((acc, r) => acc + r.cpu.main, 0) / rs.length, otherMs = rs.reduce((acc, r) => acc + r.cpu.other, 0) / rs.length;
  return { name: side === 'pytorch' ? 'PyTorch' : `flotilla (${side === 'mpi' ? 'MPI' : 'Gloo'} run)`, mainMs, otherMs, total: mainMs + otherMs };
};
const cpuRows = sides.map(cpuRow);
const cpuTable = [
  '| forward + backward without sync, CPU per rank | main thread (ms) | all other threads (ms) | total (ms) | total / PyTorch |',
  '|---|---:|---:|---:|---:|',
  ...cpuRows.map((r) => `| ${r.name} | ${r.mainMs.toFixed(1)} | ${r.otherMs.toFixed(1)} | ${r.total.toFixed(1)} | ${(r.total / cpuRows[2]!.total).toFixed(3)} |`),
].join('\n');
console.log(sections.join('\n\n'));
console.log(cpuTable);
const params = all('mpi', bucketSizes[0]!)[0]!.params;
if (!argv.includes('--no-write')) writeSection('ddp', [
  '## Data parallel: GPT training step on 2 ranks',
  '',
  `GPT with ${params.toLocaleString('en-US')} parameters (4 layers, width 256, 8 heads, context 128, vocab 256), 8 x 128 tokens per rank, ` +
    'AdamW, one intra-op thread per rank, the same bucket size for all three; flotilla as its trainer runs it (flat gradient buckets, AdamW over them) on Open MPI ' +
    '(shared memory, ranks under mpirun) and on Gloo over loopback, PyTorch DDP on Gloo over loopback; ' +
    `${trials} alternating trials of ${steps} measured steps per rank after 2 warm-up (medians over all of them). ` +
    'A compute-only step is forward and backward with gradient sync off (no_sync / noSync) plus the median optimizer step of the synced steps (the same update; ' +
    'flotilla\'s optimizer reads gradients only after a sync), timed the same way on both sides. Exposed communication = synced step - compute-only step.',
  '',
  sections.join('\n\n'),
  '',
  'CPU time of a forward + backward pass without sync, per rank, by thread (schedstat of every thread; main = the thread running the kernels):',
  '',
  cpuTable,
  '',
  `Reproduce: \`node --import tsx bench/ddp.ts --steps ${steps} --bucket-mb ${bucketSizes.join(',')} --trials ${trials}\``,
].join('\n'));
console.log(`flotilla (MPI) / PyTorch DDP, synced step: ${ratios.join('; ')}`);
