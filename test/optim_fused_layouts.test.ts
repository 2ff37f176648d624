// The fused optimizer update ([Note: fused optimizer] in native/optim.cc) over ZeRO-1 and ZeRO-2
// shards on 2 ranks (test/fixtures/optim_fused_rank.ts): 3 AdamW steps with clipping in float64,
// every rank's losses, norms and whole parameters with kernels = "fused" equal the op-by-op
// update's, and the fused runs stepped through the kernel.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite } from './helpers/equivalence.js';
import { maxRelDiff } from './helpers/close.js';
import type { Out, Run } from './fixtures/optim_fused_rank.js';

const suite = equivalenceSuite<Run, Out>('optim-fused', 'test/fixtures/optim_fused_rank.ts');
const world2 = suite.launch(2, ['eager', 'fused'].flatMap((kernels) => [1, 2].map((zero) => ({ name: `z${zero}-${kernels}`, layout: { zero }, kernels } as Run))));

test('fused AdamW over ZeRO-1 and ZeRO-2 shards equals the op-by-op update on every rank (float64)', async () => {
  await world2;
  for (const zero of [1, 2]) {
    const eager = suite.read(`z${zero}-eager`, 2), fused = suite.read(`z${zero}-fused`, 2);
    for (const [i, f] of fused.entries()) {
      const e = eager[i]!, who = `ZeRO-${zero} rank ${f.rank}`;
      assert.equal(e.calls, 0, `${who}: the eager run called the fused kernel`);
      assert.ok(f.calls > 0, `${who}: the fused run never called the fused kernel`);
      f.losses.forEach((v, s) => assert.ok(Math.abs(v - e.losses[s]!) <= 1e-12 * Math.abs(e.losses[s]!), `${who}: loss at step ${s} ${v} vs ${e.losses[s]}`));
      for (const [k, v] of Object.entries(f.params)) {
        const d = maxRelDiff(v, e.params[k]!);
        assert.ok(d <= 1e-12, `${who}: parameter ${k} differs from the op-by-op update's by ${d}`);
      }
      assert.deepEqual(Object.keys(f.params).sort(), Object.keys(e.params).sort(), `${who}: the same parameters`);
    }
  }
});
