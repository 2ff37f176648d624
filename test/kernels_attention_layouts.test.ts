// The fused attention kernel under the parallel layouts ([Note: kernel choice], [Note: ring kernel]):
// the GPT and the Llama (grouped-query heads, tied embeddings) trained with kernels = "fused" under
// ZeRO-3 (dp 4), tp 2 x pp 2 with sequence parallelism, and cp 2 x ZeRO-3 over dp 2 (the ring's
// blocks through the kernel), all in one world of 4 ranks (test/fixtures/cp_layouts_rank.ts), equal
// one process trained with the eager attention in float64: every rank's losses, gradient norms and
// whole parameters. Every rank ran the kernel.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite } from './helpers/equivalence.js';
import { pool } from './helpers/pool.js';
import type { Out, Run } from './fixtures/cp_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('kernels', 'test/fixtures/cp_layouts_rank.ts', { queue: pool(1) });
/** float64: another summation order (the kernel's blocks, the layout's reductions) only. */
const TOL = { loss: 1e-12, norm: 1e-11, param: 1e-10 };
const steps = 2;

const reference = suite.launch(1, [{ name: 'refG', micro: 1, steps }, { name: 'refL', micro: 1, steps, arch: 'llama' }]);
const layouts: [string, Run['layout'], number][] = [
  ['z3', { zero: 3 }, 1],
  ['tp2_pp2_sp', { tp: 2, pp: 2, sequenceParallel: true }, 2],
  ['cp2_z3', { cp: 2, zero: 3 }, 1],
];
const world4 = suite.launch(4, layouts.flatMap(([name, layout, micro]) => [
  { name: `${name}_G`, layout, micro, steps, kernels: 'fused' as const },
  { name: `${name}_L`, layout, micro, steps, kernels: 'fused' as const, arch: 'llama' as const },
]));

test('kernels = "fused" under ZeRO-3, tp + sp x pp and cp x ZeRO-3 (4 ranks) equals one eager process (GPT, Llama; float64, every rank)', async () => {
  await Promise.all([reference, world4]);
  for (const [name] of layouts) {
    for (const [m, ref] of [['G', 'refG'], ['L', 'refL']] as const) {
      const { outs } = suite.compare(`${name}_${m}`, 4, ref, TOL);
      for (const o of outs) assert.ok((o.fusedCalls ?? 0) > 0, `${name}_${m}: rank ${o.rank} never ran the fused kernel`);
    }
  }
});
