// DPO under data parallelism, ZeRO-3, a pipeline, tensor parallelism (sequence- and loss-parallel)
// and context parallelism on 2 ranks against one process (test/fixtures/dpo_layouts_rank.ts): a
// float64 GPT, 3 AdamW steps with clipping, the reference a frozen copy placed by the layout or the
// policy with its LoRA adapters off; ZeRO-3, cp and tp on packed rows (a pair's responses two
// documents of one row) against one process on a sequence a row. Losses, gradient norms, the
// rewards, margin and accuracy, the pair count and every whole parameter equal one process's; the
// first step's loss is ln 2 exactly.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { pool } from './helpers/pool.js';
import { equivalenceSuite } from './helpers/equivalence.js';
import { relDiff } from './helpers/close.js';
import type { Out, Run } from './fixtures/dpo_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('dpo', 'test/fixtures/dpo_layouts_rank.ts', { timeoutMs: 240_000, queue: pool() });
const TOL = 1e-11, TOL_PARAM = 1e-9;
const steps = 3;
const copy = { steps, reference: 'copy' as const }, adapters = { steps, reference: 'adapters' as const };
const reference = suite.launch(1, [{ name: 'ref_copy', layout: {}, micro: 2, ...copy }, { name: 'ref_adapters', layout: {}, micro: 2, ...adapters }]);
const RUNS: [Run, string][] = [
  [{ name: 'dp2', layout: {}, micro: 1, ...copy }, 'ref_copy'],
  [{ name: 'z3', layout: { zero: 3 }, micro: 2, packed: true, ...copy }, 'ref_copy'],
  [{ name: 'cp2', layout: { cp: 2 }, micro: 2, packed: true, ...copy }, 'ref_copy'],
  [{ name: 'pp2', layout: { pp: 2 }, micro: 2, ...adapters }, 'ref_adapters'],
  [{ name: 'tp2', layout: { tp: 2, sequenceParallel: true, lossParallel: true }, micro: 2, packed: true, ...adapters }, 'ref_adapters'],
];
const world2 = suite.launch(2, RUNS.map(([r]) => r));

test('DPO under dp, ZeRO-3, cp, pp and tp (+sp, lossParallel) on 2 ranks, packed or not, equals one process; the first step loses ln 2', async () => {
  await Promise.all([reference, world2]);
  for (const refName of ['ref_copy', 'ref_adapters']) {
    const ref = suite.read(refName, 1)[0]!;
    assert.equal(ref.losses[0], Math.LN2, `${refName}: the first step's loss`);
    assert.deepEqual(ref.counts, [4, 4, 4], `${refName}: every step counts the global batch's pairs`);
    assert.ok(ref.losses[steps - 1]! < Math.LN2, `${refName}: DPO lowers the loss (${ref.losses.join(', ')})`);
    assert.ok(ref.metrics[steps - 1]!.rewardsMargin! > 0, `${refName}: the margin grows`);
  }
  for (const [r, refName] of RUNS) {
    const { ref, outs } = suite.compare(r.name, 2, refName, { loss: TOL, norm: TOL, param: TOL_PARAM });
    for (const o of outs) {
      const who = `${r.name}: rank ${o.rank}`;
      assert.equal(o.losses[0], Math.LN2, `${who}: the first step's loss`);
      assert.deepEqual(o.counts, ref.counts, `${who}: pair counts`);
      o.metrics.forEach((m, s) => {
        assert.deepEqual(Object.keys(m).sort(), Object.keys(ref.metrics[s]!).sort(), `${who}: metric names at step ${s}`);
        for (const [k, v] of Object.entries(m)) assert.ok(relDiff(v, ref.metrics[s]![k]!) <= TOL || Math.abs(v - ref.metrics[s]![k]!) <= 1e-14, `${who}: ${k} at step ${s}: ${v} vs one process ${ref.metrics[s]![k]}`);
      });
    }
  }
});
