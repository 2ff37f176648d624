// Data parallel equivalence and behaviour on real ranks over loopback. Runs of the same world size
// and backend share one world (test/fixtures/ddp_train.ts trains them one after another, each from
// a fresh model on the same seeds): the one-process references in a world of one, every 2-rank Gloo
// run in one world, the 4-rank runs in another, the MPI run in its own; the nine edge-case
// scenarios run in one 2-rank world, each in a process group of its own. The worlds are queued when
// the file loads, two at a time (test/helpers/pool.ts); each test awaits the runs it compares and
// names them in its assertions.
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

interface Result { tag: string; rank: number; losses: number[]; norms: number[]; launchedInBackward: boolean[]; collectivesPerMicro: number[]; buckets: number }

/** Each rank's result line ("RESULT {json}") whose `key` field is `name`; fails naming a rank that printed none. */
function resultsOf(outputs: string[], key: string, name: string): Record<string, unknown>[] {
  return outputs.map((out, r) => {
    const found = out.split('\n').filter((l) => l.includes('RESULT '))
      .map((l) => JSON.parse(l.slice(l.indexOf('RESULT ') + 7)) as Record<string, unknown>)
      .find((x) => x[key] === name);
    assert.ok(found, `${name}: rank ${r} printed no result:\n${out}`);
    return found;
  });
}

const queue = pool();
type Run = { res: Result[]; params: Float64Array };
type RunOpts = Record<string, unknown>;
/**
 * One world of ddp_train.ts training `runs` (tag, options) one after another, queued now; each run's
 * promise resolves to its results and parameters, or rejects naming the run.
 */
function trainWorld(nproc: number, runs: [string, RunOpts][], backend: 'gloo' | 'mpi' = 'gloo'): [string, Promise<Run>][] {
  const world = started(queue(async () => {
    const { codes, outputs } = await runWorld({
      nproc, script, backend, timeoutMs: 240_000,
      args: [JSON.stringify(runs.map(([tag, opts]) => ({ ...opts, tag, out: join(dir, `${tag}.bin`) })))],
    });
    assert.deepEqual(codes, new Array(nproc).fill(0), `world of ${nproc} (${runs.map(([t]) => t).join(', ')}):\n${outputs.join('\n')}`);
    return outputs;
  }));
  return runs.map(([tag]) => [tag, started(world.then((outputs) => runOf(outputs, nproc, tag)))]);
}
function runOf(outputs: string[], nproc: number, tag: string): Run {
  const out = join(dir, `${tag}.bin`);
  const each = Array.from({ length: nproc }, (_, r) => new Float64Array(new Uint8Array(readFileSync(`${out}.rank${r}`)).buffer));
  // params: every rank's final parameters must be equal (a drifting replica fails here), then
  // rank 0's stand for the run.
  each.forEach((p, r) => assertClose(p, each[0]!, 0, `${tag}: rank ${r}'s final parameters vs rank 0's`));
  return { res: resultsOf(outputs, 'tag', tag) as unknown as Result[], params: each[0]! };
}

const CASES = [[2, true, 1], [2, false, 1], [2, true, 2], [2, false, 2], [4, true, 1], [4, true, 2], [4, false, 2]] as const;
type Case = (typeof CASES)[number];
const STEPS = 8;
const caseRun = ([nproc, overlap, accum]: Case): [string, RunOpts] => [`w${nproc}-o${overlap}-a${accum}`, { steps: STEPS, globalBatch: 8, accum, overlap }];
const backendOpts = { steps: 5, globalBatch: 8, accum: 1 };
const tieOpts = { steps: 5, globalBatch: 8, tie: true };
const clipOpts = { steps: 8, globalBatch: 8, clip: 0.5 };
const runs = new Map([
  ...trainWorld(1, [['ref', { steps: STEPS, globalBatch: 8, accum: 1 }], ['backends-ref', backendOpts], ['tie-ref', tieOpts], ['clip-ref', clipOpts]]),
  ...trainWorld(2, [...CASES.filter(([n]) => n === 2).map(caseRun), ['backends-gloo', backendOpts], ['tie-w2', tieOpts], ['clip-w2', clipOpts]]),
  ...trainWorld(4, CASES.filter(([n]) => n === 4).map(caseRun)),
  ...trainWorld(2, [['backends-mpi', backendOpts]], 'mpi'),
]);
const run = (tag: string): Promise<Run> => runs.get(tag)!;
const reference = run('ref');
const caseRuns = CASES.map((c) => run(caseRun(c)[0]));
const backendRuns = [run('backends-ref'), run('backends-gloo'), run('backends-mpi')] as const;
const tieRuns = [run('tie-ref'), run('tie-w2')] as const;
const clipRuns = [run('clip-ref'), run('clip-w2')] as const;

for (const [i, [nproc, overlap, accum]] of CASES.entries()) {
  test(`DDP ${nproc} ranks, overlap ${overlap}, accumulation ${accum}: ${STEPS} steps equal single-process training`, async () => {
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
        assert.equal(r.collectivesPerMicro.length, STEPS * (accum - 1));
        assert.ok(r.collectivesPerMicro.every((c) => c === 0), `rank ${r.rank}: ${r.collectivesPerMicro}`);
      }
    }
  });
}

test('a GPT trained 5 steps on 2 ranks under MPI equals Gloo and one process', async () => {
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

const SCENARIOS = ['unused-error', 'unused-ok', 'late-grad', 'nonfinite-skip', 'nonfinite-raise', 'unused-changing', 'recover', 'layout-mismatch', 'frozen-broadcast', 'pipeline-unused'];
/** One 2-rank world of ddp_cases.ts running every scenario (each in a group of its own), queued when the file loads. */
const scenarioWorld = started(queue(async () => {
  const { codes, outputs } = await runWorld({ nproc: 2, script: join(import.meta.dirname, 'fixtures', 'ddp_cases.ts'), args: [SCENARIOS.join(',')], timeoutMs: 120_000 });
  assert.deepEqual(codes, [0, 0], outputs.join('\n'));
  return outputs;
}));
const scenario = async (name: string): Promise<Record<string, unknown>[]> => resultsOf(await scenarioWorld, 'scenario', name);

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

test('parallelize passes findUnusedParameters to a pipeline\'s data-parallel wrapper: an unused stage parameter trains with zero gradients', async () => {
  const [a, b] = await scenario('pipeline-unused');
  assert.equal(a!.error, undefined, String(a!.error));
  assert.equal(b!.error, undefined, String(b!.error));
  assert.equal(a!.spareGradZero, true);
  assert.deepEqual(a!.losses, b!.losses);
  assert.deepEqual(a!.usedGrad, b!.usedGrad);
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
