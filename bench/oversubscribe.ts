// Oversubscribed MPI ranks must not spin: 4 ranks on this machine's cores, rank 0 computes while
// ranks 1..3 wait for it in an all-reduce. Compares the waiters' CPU use and rank 0's compute time
// with Open MPI's default progress (busy polling) and with mpi_yield_when_idle=1, which
// `flotilla run --backend mpi` sets (src/launch/mpirun.ts). Writes its section of
// docs/BENCHMARKS.md.
//   node --import tsx bench/oversubscribe.ts [--nproc 4] [--trials 3]
import { availableParallelism } from 'node:os';
import { join } from 'node:path';
import { runWorld } from '../test/helpers/world.js';
import { median, writeSection } from './report.js';

const argv = process.argv.slice(2);
const arg = (name: string, dflt: number) => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const nproc = arg('--nproc', 4);
const trials = arg('--trials', 3);
const script = join(import.meta.dirname, 'oversubscribe_rank.ts');

interface R { rank: number; computeMs: number; wallMs: number; cpuMs: number }

async function run(yieldWhenIdle: boolean): Promise<R[]> {
  // mpi_yield_when_idle is what the launcher sets; OMPI_MCA_ in the environment overrides it.
  const w = await runWorld({ nproc, script, backend: 'mpi', timeoutMs: 300_000, env: { OMPI_MCA_mpi_yield_when_idle: yieldWhenIdle ? '1' : '0' } });
  if (w.codes.some((c) => c !== 0)) throw new Error(w.outputs.join('\n'));
  return w.outputs.map((o) => JSON.parse(o.split('\n').find((l) => l.startsWith('BENCH '))!.slice(6)) as R);
}

const res: Record<'spin' | 'yield', R[][]> = { spin: [], yield: [] };
for (let t = 0; t < trials; t++) {
  res.spin.push(await run(false));
  res.yield.push(await run(true));
}
const row = (name: string, rs: R[][]) => {
  const compute = median(rs.map((r) => r[0]!.computeMs));
  const waitCpu = median(rs.flatMap((r) => r.slice(1).map((x) => x.cpuMs / x.wallMs)));
  return `| ${name} | ${compute.toFixed(0)} | ${(100 * waitCpu).toFixed(0)}% |`;
};
const table = [
  `| ${nproc} MPI ranks on ${availableParallelism()} cores | rank 0 compute (ms, median) | CPU use of a waiting rank (median, % of one core) |`,
  '|---|---:|---:|',
  row('mpi_yield_when_idle=0 (busy polling)', res.spin),
  row('mpi_yield_when_idle=1 (what flotilla run sets)', res.yield),
].join('\n');
console.log(table);
writeSection('oversubscribe', [
  `## Oversubscribed MPI ranks (${nproc} ranks, ${availableParallelism()} cores)`,
  '',
  'Rank 0 runs 80 float32 512x512 matmuls while the other ranks wait for it in an all-reduce (Open MPI, ranks under mpirun). ' +
    `${trials} alternating trials per setting. A waiting rank's CPU use counts every thread of its process over the wait.`,
  '',
  table,
  '',
  `Reproduce: \`node --import tsx bench/oversubscribe.ts --nproc ${nproc} --trials ${trials}\``,
].join('\n'));
