// Data parallel equivalence and behaviour on real ranks over loopback. Every world is queued when
// the file loads, two at a time (test/helpers/pool.ts); each test awaits the ones it compares.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { assertClose } from './helpers/close.js';
import { runWorld } from './helpers/world.js';
import { pool, started } from './helpers/pool.js';

const script = join(import.meta.dirname, 'fixtures', 'ddp_train.ts');
const dir = mkdtempSync(join(tmpdir(), 'flotilla-ddp-'));

interface Result { rank: number; losses: number[]; norms: number[]; launchedInBackward: boolean[]; collectivesPerMicro: number[]; buckets: number }

function results(outputs: string[]): Result[] {
  return outputs.map((out, r) => {
    const line = out.split('\n').find((l) => l.includes('RESULT '));
    assert.ok(line, `rank ${r} printed no result:\n${out}`);
    return JSON.parse(line.slice(line.indexOf('RESULT ') + 7)) as Result;
  });
}

const queue = pool();
type Run = { res: Result[]; params: Float64Array };
/** A world of ddp_train.ts, queued. */
function train(nproc: number, opts: Record<string, unknown>, tag: string, backend: 'gloo' | 'mpi' = 'gloo'): Promise<Run> {
  return started(queue(() => trainNow(nproc, opts, tag, backend)));
}
async function trainNow(nproc: number, opts: Record<string, unknown>, tag: string, backend: 'gloo' | 'mpi'): Promise<Run> {
  const out = join(dir, `${tag}.bin`);
  const { codes, outputs } = await runWorld({ nproc, script, args: [JSON.stringify({ ...opts, out })], timeoutMs: 240_000, backend });
  assert.deepEqual(codes, new Array(nproc).fill(0), outputs.join('\n'));
  const each = Array.from({ length: nproc }, (_, r) => new Float64Array(new Uint8Array(readFileSync(`${out}.rank${r}`)).buffer));
  // params: every rank's final parameters must be equal (a drifting replica fails here), then
  // rank 0's stand for the run.
  each.forEach((p, r) => assertClose(p, each[0]!, 0, `rank ${r}'s final parameters vs rank 0's`));
  return { res: results(outputs), params: each[0]! };
}

const reference = train(1, { steps: 20, globalBatch: 8, accum: 1 }, 'ref');
const CASES = [[2, true, 1], [2, false, 1], [2, true, 2], [2, false, 2], [4, true, 1], [4, true, 2], [4, false, 2]] as const;
const caseRuns = CASES.map(([nproc, overlap, accum]) => train(nproc, { steps: 20, globalBatch: 8, accum, overlap }, `w${nproc}-o${overlap}-a${accum}`));
const backendOpts = { steps: 10, globalBatch: 8, accum: 1 };
const backendRuns = [train(1, backendOpts, 'backends-ref'), train(2, backendOpts, 'backends-gloo', 'gloo'), train(2, backendOpts, 'backends-mpi', 'mpi')] as const;
const tieRuns = [train(1, { steps: 10, globalBatch: 8, tie: true }, 'tie-ref'), train(2, { steps: 10, globalBatch: 8, tie: true }, 'tie-w2')] as const;
const clipRuns = [train(1, { steps: 8, globalBatch: 8, clip: 0.5 }, 'clip-ref'), train(2, { steps: 8, globalBatch: 8, clip: 0.5 }, 'clip-w2')] as const;

for (const [i, [nproc, overlap, accum]] of CASES.entries()) {
  test(`DDP ${nproc} ranks, overlap ${overlap}, accumulation ${accum}: 20 steps equal single-process training`, async () => {
    const base = await reference;
    const run = await caseRuns[i]!;
    for (const r of run.res) assertClose(r.losses, base.res[0]!.losses, 1e-5, `losses on rank ${r.rank}`);
    assertClose(run.params, base.params, 1e-5, 'final parameters');
    assert.ok(run.res[0]!.buckets > 1, 'the test model must span several buckets');
    if (overlap) {
      // From the second step on, the first bucket's all-reduce starts inside backward.
      for (const r of run.res) assert.ok(r.launchedInBackward.slice(1).every(Boolean), `rank ${r.rank}: ${r.launchedInBackward}`);
    } else {
      for (const r of run.res) assert.ok(r.launchedInBackward.every((x) => !x));
    }
    if (accum > 1) {
      // Non-final micro-batches issue no collective at all.
      for (const r of run.res) {
        assert.equal(r.collectivesPerMicro.length, 20 * (accum - 1));
        assert.ok(r.collectivesPerMicro.every((c) => c === 0), `rank ${r.rank}: ${r.collectivesPerMicro}`);
      }
    }
  });
}

test('a GPT trained 10 steps on 2 ranks under MPI equals Gloo and one process', async () => {
  const [one, gloo, mpi] = [await backendRuns[0], await backendRuns[1], await backendRuns[2]];
  for (const r of mpi.res) {
    assertClose(r.losses, one.res[0]!.losses, 1e-5, `MPI losses on rank ${r.rank} vs one process`);
    assertClose(r.losses, gloo.res[r.rank]!.losses, 1e-5, `MPI losses on rank ${r.rank} vs Gloo`);
  }
  assertClose(mpi.params, one.params, 1e-5, 'MPI final parameters vs one process');
  assertClose(mpi.params, gloo.params, 1e-5, 'MPI final parameters vs Gloo');
  assert.ok(mpi.res[0]!.buckets > 1 && mpi.res[0]!.launchedInBackward.slice(1).every(Boolean), 'MPI buckets overlap with backward too');
});

test('DDP with tied input/output embedding (one parameter used twice) equals single-process training', async () => {
  const [base, run] = [await tieRuns[0], await tieRuns[1]];
  assertClose(run.res[0]!.losses, base.res[0]!.losses, 1e-5, 'losses');
  assertClose(run.params, base.params, 1e-5, 'final parameters');
  assert.ok(run.res[0]!.launchedInBackward.slice(1).every(Boolean));
});

test('DDP gradient-norm clipping matches single-process clipping', async () => {
  const [base, run] = [await clipRuns[0], await clipRuns[1]];
  assertClose(run.res[0]!.norms, base.res[0]!.norms, 1e-5, 'gradient norms');
  assert.deepEqual(run.res[0]!.norms, run.res[1]!.norms, 'every rank sees the same norm');
  assertClose(run.params, base.params, 1e-5, 'final parameters');
});

/** A world of ddp_cases.ts running one scenario, queued (all of them when the file loads). */
function queueScenario(name: string, nproc = 2): Promise<Record<string, unknown>[]> {
  return started(queue(async () => {
    const { codes, outputs } = await runWorld({ nproc, script: join(import.meta.dirname, 'fixtures', 'ddp_cases.ts'), args: [name], timeoutMs: 120_000 });
    assert.deepEqual(codes, new Array(nproc).fill(0), outputs.join('\n'));
    return results(outputs) as unknown as Record<string, unknown>[];
  }));
}
const SCENARIOS = ['unused-error', 'unused-ok', 'late-grad', 'nonfinite-skip', 'nonfinite-raise', 'unused-changing', 'recover', 'layout-mismatch', 'frozen-broadcast'];
const scenarioRuns = new Map(SCENARIOS.map((n) => [n, queueScenario(n)]));
const scenario = (name: string): Promise<Record<string, unknown>[]> => scenarioRuns.get(name)!;

test('an unused parameter without findUnusedParameters is an error naming it, on every rank', async () => {
  for (const r of await scenario('unused-error')) {
    assert.match(String(r.error), /received no gradient.*spare\.weight.*spare\.bias|received no gradient.*spare\.bias.*spare\.weight/);
    assert.match(String(r.error), /findUnusedParameters/);
  }
});

test('findUnusedParameters reduces zero gradients for unused parameters and keeps replicas equal', async () => {
  const [a, b] = await scenario('unused-ok');
  assert.equal(a!.error, undefined);
  assert.equal(a!.spareGradZero, true);
  assert.deepEqual(a!.usedGrad, b!.usedGrad);
  assert.deepEqual(a!.weights, b!.weights);
});

test('a gradient arriving for a bucket already in flight raises an error naming the parameter', async () => {
  for (const r of await scenario('late-grad')) {
    assert.match(String(r.error), /gradient for parameter '(used|spare)\.(weight|bias)' arrived after its bucket/);
  }
});

test('non-finite gradients on one rank: every rank skips the same step', async () => {
  for (const r of await scenario('nonfinite-skip')) assert.deepEqual(r.ok, [true, false, true]);
});

test('non-finite gradients on one rank: every rank raises, naming the rank', async () => {
  for (const r of await scenario('nonfinite-raise')) assert.match(String(r.error), /non-finite gradients.*rank\(s\) 1/);
});

test('findUnusedParameters: the unused set may change between steps inside one bucket', async () => {
  const [a, b] = await scenario('unused-changing');
  assert.equal(a!.error, undefined, String(a!.error));
  assert.equal(b!.error, undefined, String(b!.error));
  const grads = a!.spareGrads as number[][];
  assert.deepEqual(grads, b!.spareGrads, 'replicas reduce the same gradients');
  assert.ok(grads[0]!.every((g) => g === 0) && grads[2]!.every((g) => g === 0), 'unused steps reduce zeros');
  assert.ok(grads[1]!.some((g) => g !== 0) && grads[3]!.some((g) => g !== 0), 'used steps reduce real gradients');
});

test('after a failed step (late gradient, non-finite gradients) the next step works on every rank', async () => {
  for (const r of await scenario('recover')) {
    assert.deepEqual(r.ok, [true, false, false, true], String(r.errors));
    const errors = r.errors as string[];
    assert.ok(errors.some((e) => /arrived after its bucket/.test(e)));
    assert.ok(errors.some((e) => /non-finite gradients.*rank\(s\) 1/.test(e)));
  }
});

test('ranks with different models are stopped at wrap time, naming the rank', async () => {
  for (const r of await scenario('layout-mismatch')) assert.match(String(r.error), /rank\(s\) 1 hold different parameters or buckets than rank 0/);
});

test('frozen parameters are broadcast from rank 0 at wrap time too', async () => {
  const [a, b] = await scenario('frozen-broadcast');
  assert.equal(a!.error, undefined, String(a!.error));
  assert.deepEqual(a!.frozen, b!.frozen);
});
