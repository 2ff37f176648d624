// The fused optimizer update ([Note: fused optimizer] in native/optim.cc) over ZeRO-1, ZeRO-2 and
// ZeRO-3 shards and a 2-stage pipeline on 2 ranks (test/fixtures/optim_fused_rank.ts): 3 AdamW steps
// (SGD with momentum under ZeRO-2 and the pipeline) clipped in float64, every rank's losses, norms
// and whole parameters with kernels = "fused" (clipping's factor folded into the update, [Note:
// folded clip]) equal the op-by-op update's after clipping in place, and the fused runs stepped
// through the kernel.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite } from './helpers/equivalence.js';
import { maxRelDiff } from './helpers/close.js';
import type { Out, Run } from './fixtures/optim_fused_rank.js';
import type { LayoutRequest } from '../src/parallel/layout.js';

const MAX_NORM = 0.05; // the fixture's clip
const layouts: [string, LayoutRequest, boolean][] = [
  ['z1', { zero: 1 }, false], ['z2', { zero: 2 }, false], ['z3', { zero: 3 }, false], ['pp2', { pp: 2 }, false],
  ['z2-sgd', { zero: 2 }, true], ['pp2-sgd', { pp: 2 }, true],
];
const suite = equivalenceSuite<Run, Out>('optim-fused', 'test/fixtures/optim_fused_rank.ts');
const world2 = suite.launch(2, ['eager', 'fused'].flatMap((kernels) => layouts.map(([name, layout, sgd]) => ({ name: `${name}-${kernels}`, layout, kernels, sgd } as Run))));

test('fused AdamW and SGD with clipping folded in, over ZeRO-1/2/3 shards and a pipeline, equal clip-then-step op by op on every rank (float64)', async () => {
  await world2;
  for (const [name] of layouts) {
    const eager = suite.read(`${name}-eager`, 2), fused = suite.read(`${name}-fused`, 2);
    assert.equal(fused.length, 2, `${name}: both ranks wrote results`);
    for (const [i, f] of fused.entries()) {
      const e = eager[i]!, who = `${name} rank ${f.rank}`;
      assert.equal(e.calls, 0, `${who}: the eager run called the fused kernel`);
      assert.ok(f.calls > 0, `${who}: the fused run never called the fused kernel`);
      // Clipping acted: the steps that trained (the fixture's second global batch trains nothing) had norms above the clip.
      assert.ok(e.norms.filter((n) => n > MAX_NORM).length === 2, `${who}: the norms ${e.norms} do not exceed the clip ${MAX_NORM} twice`);
      f.norms.forEach((v, s) => assert.ok(Math.abs(v - e.norms[s]!) <= 1e-10 * e.norms[s]!, `${who}: norm at step ${s} ${v} vs ${e.norms[s]}`));
      f.losses.forEach((v, s) => assert.ok(Math.abs(v - e.losses[s]!) <= 1e-12 * Math.abs(e.losses[s]!), `${who}: loss at step ${s} ${v} vs ${e.losses[s]}`));
      for (const [k, v] of Object.entries(f.params)) {
        const d = maxRelDiff(v, e.params[k]!);
        assert.ok(d <= 1e-12, `${who}: parameter ${k} differs from the op-by-op update's by ${d}`);
      }
      assert.deepEqual(Object.keys(f.params).sort(), Object.keys(e.params).sort(), `${who}: the same parameters`);
    }
  }
});
