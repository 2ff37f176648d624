// All-reduce bus bandwidth, flotilla on Open MPI and on Gloo vs. PyTorch's c10d Gloo, measured in
// the same run.
//
//   node --import tsx bench/allreduce.ts [--nproc 2] [--trials 4]
//
// Every side starts through `flotilla run` (runLauncher; `--backend mpi` for flotilla on MPI, which
// starts the ranks through mpirun) with one intra-op thread per rank, all-reduces (sum) a float32
// tensor of 256 KB..64 MB, and reports the best per-op time of several timed rounds (the machine is
// shared, so the best round is the least disturbed one). The sides alternate (MPI, Gloo, torch,
// MPI, ...) and each keeps its best trial.
// Bus bandwidth = 2 (n-1)/n × bytes / time, the bytes each rank's link carries in a ring all-reduce.
// Writes its section of docs/BENCHMARKS.md (between the allreduce markers) and prints the table.
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { cpus } from 'node:os';
import { dirname, join } from 'node:path';
import { runLauncher } from '../src/cli/run.js';

const ROOT = join(import.meta.dirname, '..');
const DOC = join(ROOT, 'docs', 'BENCHMARKS.md');
const BEGIN = '<!-- allreduce:begin -->';
const END = '<!-- allreduce:end -->';
const PYTHON = process.env.FLOTILLA_PYTHON ?? '/usr/bin/python3';

function flag(name: string, fallback: number): number {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? Number(process.argv[i + 1]) : fallback;
}
const nproc = flag('nproc', 2);
const trials = flag('trials', 4);

const KB = 1024, MB = 1024 * KB;
const sizes = [256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB];
// About 64 MB of all-reduce per round: 256 iterations at 256 KB down to 5 at 16 MB and 64 MB.
const iters = sizes.map((b) => Math.max(5, Math.min(400, Math.round((64 * MB) / b))));
const plan = { sizes, iters, rounds: 3, warmup: 2 };

interface Report { impl: string; worldSize: number; seconds: number[]; threads?: number; torch: string }

type Impl = 'mpi' | 'gloo' | 'torch';
const IMPLS: readonly Impl[] = ['mpi', 'gloo', 'torch'];

async function side(impl: Impl): Promise<Report> {
  const script = impl !== 'torch'
    ? ['--backend', impl, join(ROOT, 'bench', 'allreduce_rank.ts')]
    : [PYTHON, join(ROOT, 'bench', 'allreduce_peer.py')];
  let out = '', err = '';
  const code = await runLauncher(['--nproc', String(nproc), ...script, JSON.stringify(plan)], {
    stdout: { write: (s: string) => (out += s) },
    stderr: { write: (s: string) => (err += s) },
  });
  const line = out.split('\n').find((l) => l.startsWith('[rank 0] BENCH '));
  if (code !== 0 || !line) throw new Error(`${impl} ranks failed (exit ${code}):\n${out}\n${err}`);
  return JSON.parse(line.slice('[rank 0] BENCH '.length)) as Report;
}

function busBw(bytes: number, seconds: number): number {
  return ((2 * (nproc - 1)) / nproc) * bytes / seconds / 1e9;
}

function fmtSize(b: number): string {
  return b >= MB ? `${b / MB} MB` : `${b / KB} KB`;
}

const best: Record<Impl, number[]> = { mpi: sizes.map(() => Infinity), gloo: sizes.map(() => Infinity), torch: sizes.map(() => Infinity) };
const reports: Partial<Record<Impl, Report>> = {};
for (let t = 0; t < trials; t++) {
  for (const impl of IMPLS) {
    process.stderr.write(`trial ${t + 1}/${trials}: ${impl === 'torch' ? 'PyTorch (Gloo)' : `flotilla (${impl})`}...\n`);
    const r = await side(impl);
    reports[impl] = r;
    r.seconds.forEach((s, k) => (best[impl][k] = Math.min(best[impl][k]!, s)));
  }
}
const flotillaReport = reports.gloo, torchReport = reports.torch;

const rows = sizes.map((b, k) => {
  const m = best.mpi[k]!, g = best.gloo[k]!, p = best.torch[k]!;
  const mb = busBw(b, m), gb = busBw(b, g), pb = busBw(b, p);
  return `| ${fmtSize(b)} | ${(m * 1e3).toFixed(3)} | ${mb.toFixed(2)} | ${(g * 1e3).toFixed(3)} | ${gb.toFixed(2)} | ${(p * 1e3).toFixed(3)} | ${pb.toFixed(2)} | ${(mb / pb).toFixed(2)} | ${(gb / pb).toFixed(2)} |`;
});
const ratios = sizes.map((b, k) => busBw(b, best.gloo[k]!) / busBw(b, best.torch[k]!));
const below = sizes.filter((_, k) => ratios[k]! < 0.95).map(fmtSize);
const mpiX = sizes.map((b, k) => busBw(b, best.mpi[k]!) / busBw(b, best.torch[k]!));
const table = [
  '| size | MPI ms/op | MPI bus GB/s | Gloo ms/op | Gloo bus GB/s | PyTorch (Gloo) ms/op | PyTorch bus GB/s | MPI / PyTorch | Gloo / PyTorch |',
  '|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
  ...rows,
  '',
  `flotilla on Open MPI moves ${Math.min(...mpiX).toFixed(1)}-${Math.max(...mpiX).toFixed(1)}x PyTorch's Gloo bus bandwidth across these sizes.`,
  below.length === 0
    ? 'Target for flotilla on Gloo (>= 0.95 x raw Gloo at every size): met.'
    : `Target for flotilla on Gloo (>= 0.95 x raw Gloo at every size): **missed at ${below.join(', ')}** in this run. On this 2-core machine ` +
      'the ratios swing widely from run to run, most at 256 KB; compare several runs before reading a trend.',
].join('\n');

const cpu = cpus()[0]?.model.trim() ?? 'unknown CPU';
const section = `${BEGIN}
## All-reduce bus bandwidth (${nproc} ranks, loopback)

\`node --import tsx bench/allreduce.ts\` — all-reduce (sum) of a float32 tensor through flotilla's
\`ProcessGroup.allReduce\` on Open MPI (shared memory, ranks started by \`flotilla run --backend mpi\`) and on
Gloo, next to PyTorch ${torchReport?.torch ?? '?'} \`torch.distributed.all_reduce\` on c10d Gloo
(bench/allreduce_peer.py), all started by \`flotilla run\` in the same run, one intra-op thread per rank.
Best per-op time of ${plan.rounds} timed rounds × ${trials} alternating trials per side; bus bandwidth =
2(n-1)/n × bytes / time. Machine: ${cpus().length} × ${cpu}, Node ${process.version}, libtorch ${flotillaReport?.torch ?? '?'}.
Measured ${new Date().toISOString().slice(0, 10)} on a machine shared with other work: compare the ratio, not the absolute numbers.

${table}
${END}`;

mkdirSync(dirname(DOC), { recursive: true });
const current = existsSync(DOC) ? readFileSync(DOC, 'utf8') : '# Benchmarks\n\nEach section is written by the benchmark named in it; rerun the benchmark to refresh it.\n';
const b = current.indexOf(BEGIN), e = current.indexOf(END);
const next = b >= 0 && e > b ? current.slice(0, b) + section + current.slice(e + END.length) : `${current.trimEnd()}\n\n${section}\n`;
writeFileSync(DOC, next);
console.log(table);
console.log(`\nwrote ${DOC}`);
