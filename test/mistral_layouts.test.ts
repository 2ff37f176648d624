// The Llama with a sliding window (Mistral: model.slidingWindow = 3 over sequences of 8) under the
// layouts against one process (test/fixtures/llama_layouts_rank.ts, the model from the registry as
// the trainer gets it): 3 AdamW steps with clipping, 2 micro-batches per step, float64. Every rank's
// losses, gradient norms and whole parameters equal the one-process run's under data parallel,
// ZeRO-3, a 1F1B pipeline, tensor parallelism with sequence parallelism, context parallelism (the
// ring masks the window), full and selective activation checkpointing, and bf16-mixed data parallel
// against one process in bf16-mixed. The same runs are not those of the model without a window.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite, type Tolerance } from './helpers/equivalence.js';
import type { Out, Run } from './fixtures/llama_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('mistral', 'test/fixtures/llama_layouts_rank.ts');
const F64: Tolerance = { loss: 1e-12, norm: 1e-12, param: 1e-10 };
/** bf16-mixed data parallel against one process in bf16-mixed (as test/llama_layouts.test.ts): reduction order only. */
const BF16_DP: Tolerance = { loss: 1e-6, norm: 1e-6, param: 1e-6, scaled: true };

const window = { model: { slidingWindow: 3, family: 'mistral' } };
const base = { micro: 2, steps: 3, ...window };
const run = (name: string, layout: Run['layout'], extra: Partial<Run> = {}): Run => ({ name, layout, ...base, ...extra });
const bf16 = { precision: 'bf16-mixed' } as const;

const reference = suite.launch(1, [
  { name: 'ref', ...base },
  { name: 'ref_full', micro: 2, steps: 3 },
  { name: 'ref_bf16', ...base, micro: 4, ...bf16 },
]);
const world2 = suite.launch(2, [
  run('dp2', { dp: 2 }),
  run('z3', { zero: 3 }),
  run('pp2_1f1b', { pp: 2, ppSchedule: '1f1b' }),
  run('tp2_sp', { tp: 2, sequenceParallel: true }),
  run('cp2', { cp: 2 }),
  run('dp2_ac_full', { dp: 2 }, { ac: 'full' }),
  run('z3_ac_selective', { zero: 3 }, { ac: 'selective' }),
  run('dp2_bf16', { dp: 2 }, bf16),
]);

test('Mistral (sliding window 3 of 8): dp, ZeRO-3, pp, tp + sp, cp, activation checkpointing and bf16-mixed on 2 ranks equal one process', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['dp2', 'z3', 'pp2_1f1b', 'tp2_sp', 'cp2', 'dp2_ac_full', 'z3_ac_selective']) suite.compare(name, 2, 'ref', F64);
  suite.compare('dp2_bf16', 2, 'ref_bf16', BF16_DP);
  // The window is in effect: the same training without it is another run.
  assert.throws(() => suite.compare('cp2', 2, 'ref_full', F64), /differs|vs one process|at step/);
});
