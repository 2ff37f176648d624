// Test-side runs of `flotilla train` for the checkpoint tests: a tiny GPT whose shapes do not divide
// by the world (vocabulary 259, width 30), each run in its own directory, read back as per-step
// losses and every parameter (merged over the ranks' records).
import { existsSync, mkdtempSync, readFileSync, readdirSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { loadSafetensors } from '../../src/checkpoint/safetensors.js';
import assert from 'node:assert/strict';
import { readMetrics, type StepMetrics } from '../../src/train/metrics.js';
import { assertClose } from './close.js';

import { flotilla, flotillaSeries } from './cli.js';
import { started } from './pool.js';

export { flotilla, ROOT, BIN, type Flotilla } from './cli.js';

export const work = mkdtempSync(join(tmpdir(), 'flotilla-ckpt-'));
export const CONFIG = join(work, 'tiny.toml');
writeFileSync(CONFIG, `# checkpoint tests: shapes that split unevenly over 2, 3 and 4 ranks
[model]
vocabSize = 259
nLayer = 2
nHead = 2
nEmbd = 30
blockSize = 16
[data]
seqLen = 16
globalBatch = 12
[optim]
lr = 3e-3
minLr = 3e-4
warmupSteps = 2
[train]
steps = 6
evalEvery = 0
evalBatches = 1
[parallel]
bucketSizeMb = 0.01
backend = "gloo"   # what these tests check does not depend on the backend; mpirun costs each launch more
[checkpoint]
every = 3
[log]
progress = "plain"
every = 1
`);

export interface RunResult {
  dir: string;
  metrics: StepMetrics[];
  /** Every parameter by name, as numbers (the ranks' records merged). */
  params: Map<string, number[]>;
  out: string;
}

/** Trains the test config with the given extra arguments into work/<name>; fails on a non-zero exit. */
export async function train(name: string, extra: string[] = []): Promise<RunResult> {
  const dir = join(work, name);
  const record = join(dir, 'record');
  const r = await flotilla(['train', CONFIG, `--train.runDir=${dir}`, '--record', record, ...extra]);
  if (r.code !== 0) throw new Error(`flotilla train ${extra.join(' ')} exited ${r.code}\n${r.out}\n${r.err}`);
  return { dir, metrics: readMetrics(join(dir, 'metrics.jsonl')), params: readRecord(record), out: r.out };
}

/**
 * Several runs of the test config in one world, one after another (`flotilla train-series`: a
 * world's process starts and rendezvous paid once), each into work/<name> as `train` would; resolves
 * each run's result with its own part of the output (the ranks' lines from its `[series] run i/n`
 * line to the next). Fails naming the series' exit status and output when any run fails.
 */
export async function trainSeries(nproc: number, runs: { name: string; extra: string[] }[]): Promise<RunResult[]> {
  const file = join(work, `series-${runs.map((r) => r.name).join('+').slice(0, 120)}.json`);
  const r = await flotillaSeries(nproc, runs.map(({ name, extra }) => [CONFIG, `--train.runDir=${join(work, name)}`, '--record', join(work, name, 'record'), ...extra]), { file });
  if (r.code !== 0) throw new Error(`flotilla train-series (${nproc} rank(s): ${runs.map((x) => x.name).join(', ')}) exited ${r.code}\n${r.out}\n${r.err}`);
  const parts = r.out.split(/^(?=(?:\[rank \d+\] )?\[series\] run \d+\/\d+)/m).filter((p) => /^(?:\[rank \d+\] )?\[series\] run/.test(p));
  assert.equal(parts.length, runs.length, `one [series] line per run:\n${r.out}`);
  return runs.map(({ name }, i) => {
    const dir = join(work, name);
    return { dir, metrics: readMetrics(join(dir, 'metrics.jsonl')), params: readRecord(join(dir, 'record')), out: parts[i]! };
  });
}

/** Run i of a series, as a promise of its own (its failure is the awaiting test's, not the file's). */
export function runOf(series: Promise<RunResult[]>, i: number): Promise<RunResult> {
  return started(series.then((r) => r[i]!));
}

/** A layout's `flotilla train` arguments without its --nproc N (a series runs in a world already started). */
export function withoutNproc(args: string[]): string[] {
  return args.filter((a, i) => a !== '--nproc' && args[i - 1] !== '--nproc');
}

/** The process ids of a run's ranks (RANK in their environment), found by a marker in their command line. */
export function rankPids(marker: string): Map<number, number> {
  const out = new Map<number, number>();
  for (const pid of readdirSync('/proc').filter((n) => /^\d+$/.test(n))) {
    try {
      if (!readFileSync(`/proc/${pid}/cmdline`, 'utf8').includes(marker)) continue;
      const env = readFileSync(`/proc/${pid}/environ`, 'utf8').split('\0');
      const rank = env.find((e) => e.startsWith('RANK=')) ?? env.find((e) => e.startsWith('OMPI_COMM_WORLD_RANK='));
      if (rank) out.set(Number(rank.split('=')[1]), Number(pid));
    } catch {
      // the process ended meanwhile
    }
  }
  return out;
}

export function readRecord(record: string): Map<string, number[]> {
  const params = new Map<string, number[]>();
  for (const f of readdirSync(record).filter((n) => n.endsWith('.safetensors')).sort()) {
    for (const [n, t] of Object.entries(loadSafetensors(join(record, f)))) {
      if (!params.has(n)) params.set(n, t.toNumbers());
      t.dispose();
    }
  }
  return params;
}

export function checkpointOf(run: { dir: string }, step: number): string {
  const p = join(run.dir, 'checkpoints', `step-${String(step).padStart(6, '0')}`);
  if (!existsSync(join(p, 'meta.json'))) throw new Error(`no checkpoint ${p}`);
  return p;
}

export function latestOf(run: { dir: string }): string {
  return readFileSync(join(run.dir, 'checkpoints', 'latest'), 'utf8').trim();
}

/**
 * Losses of steps from..6 and every parameter of `got` equal `want`'s: exactly (rel 0), or within rel
 * for losses and norms, and ||Δθ|| / ||θ|| <= 1e-4 per parameter (as `flotilla verify`: elements whose
 * gradient is zero in exact arithmetic, such as the key bias, move by float32 noise that AdamW's
 * normalised update scales up).
 */
export function same(got: RunResult, want: RunResult, from: number, rel: number, what: string): void {
  const g = got.metrics.filter((m) => m.step >= from);
  const w = want.metrics.filter((m) => m.step >= from);
  assert.deepEqual(g.map((m) => m.step), w.map((m) => m.step), `${what}: steps`);
  if (rel === 0) {
    assert.deepEqual(g.map((m) => m.loss), w.map((m) => m.loss), `${what}: losses`);
    assert.deepEqual(g.map((m) => m.gradNorm), w.map((m) => m.gradNorm), `${what}: gradient norms`);
  } else {
    assertClose(g.map((m) => m.loss), w.map((m) => m.loss), rel, `${what}: losses`);
    assertClose(g.map((m) => m.gradNorm!), w.map((m) => m.gradNorm!), rel, `${what}: gradient norms`);
  }
  assert.deepEqual([...got.params.keys()].sort(), [...want.params.keys()].sort(), `${what}: parameter names`);
  for (const [n, v] of want.params) {
    if (rel === 0) assert.deepEqual(got.params.get(n), v, `${what}: parameter ${n}`);
    else {
      const g = got.params.get(n)!;
      let d = 0, t = 0;
      for (let i = 0; i < v.length; i++) [d, t] = [d + (g[i]! - v[i]!) ** 2, t + v[i]! ** 2];
      assert.ok(Math.sqrt(d / t) <= 1e-4, `${what}: parameter ${n}: ||Δ|| / ||θ|| = ${Math.sqrt(d / t)} > 1e-4`);
    }
  }
}
