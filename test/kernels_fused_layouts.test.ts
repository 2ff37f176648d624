// `[train] kernels = "fused"` (cross-entropy from the hidden state, [Note: deferred head] in
// src/nn/kernels/lm_head.ts) trains a GPT as the eager loss does, in float64 on masked global
// batches (test/fixtures/masked_layouts_rank.ts: ignored targets, a step that trains nothing): one
// process, data parallel, ZeRO-3 with a tied head (the head's unit gathered for the loss and again
// for its backward), a 1F1B pipeline, and tensor parallelism with sequence and loss parallelism (the
// vocabulary-sharded chunked loss) give every rank the eager one-process run's losses, gradient norms
// and parameters.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite } from './helpers/equivalence.js';
import { pool } from './helpers/pool.js';
import type { Out, Run } from './fixtures/masked_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('fusedce', 'test/fixtures/masked_layouts_rank.ts', { queue: pool(1) });
/** float64: a different summation order only. */
const TOL = { loss: 1e-12, norm: 1e-11, param: 1e-10 };
const steps = 3;
const fused = 'fused' as const;

const reference = suite.launch(1, [
  { name: 'ref', micro: 2, steps }, { name: 'refTied', micro: 2, steps, tied: true },
  { name: 'fused1', micro: 2, steps, kernels: fused },
]);
const world2 = suite.launch(2, [
  { name: 'dp2', layout: { dp: 2 }, micro: 2, steps, kernels: fused },
  { name: 'z3_tied', layout: { zero: 3 }, micro: 2, steps, kernels: fused, tied: true },
  { name: 'pp2_1f1b', layout: { pp: 2 }, micro: 4, steps, kernels: fused },
  { name: 'tp2_sp_lp', layout: { tp: 2, sequenceParallel: true, lossParallel: true }, micro: 2, steps, kernels: fused },
]);

test('fused cross-entropy from the hidden state on one process equals the eager loss', async () => {
  await reference;
  suite.compare('fused1', 1, 'ref', TOL);
  assert.equal(suite.read('ref', 1)[0]!.fusedCalls, 0, 'the eager run took the fused path');
  assert.ok(suite.read('fused1', 1)[0]!.fusedCalls! > 0, 'the fused run never took the fused path');
});

/** Every rank that holds the head computed its loss fused (a pipeline's first stage holds none). */
function tookFused(name: string, ranks: number[]): void {
  const outs = suite.read(name, 2);
  for (const r of ranks) assert.ok(outs.find((o) => o.rank === r)!.fusedCalls! > 0, `${name}: rank ${r} never took the fused path`);
}

test('fused cross-entropy under data parallel, ZeRO-3 (tied head), a pipeline and tp with sequence and loss parallelism equals the eager one-process run', async () => {
  await Promise.all([reference, world2]);
  suite.compare('dp2', 2, 'ref', TOL);
  suite.compare('z3_tied', 2, 'refTied', TOL);
  suite.compare('pp2_1f1b', 2, 'ref', TOL);
  suite.compare('tp2_sp_lp', 2, 'ref', TOL);
  for (const n of ['dp2', 'z3_tied', 'tp2_sp_lp']) tookFused(n, [0, 1]);
  tookFused('pp2_1f1b', [1]);
});
