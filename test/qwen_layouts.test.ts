// Qwen3's options of the Llama (per-head q/k RMSNorms before rotary, biases on q, k, v and o, a head
// width that is not nEmbd / nHead) and Qwen2's (q, k, v biases) under every layout against one
// process, with the Llama layout fixture (test/fixtures/llama_layouts_rank.ts): 3 AdamW steps with
// clipping, float64. Every rank's losses, gradient norms and whole parameters equal the one-process
// run's under data parallel, ZeRO-3, a pipeline (1F1B), tp with sequence parallelism (biases split
// with their heads, the q/k norms whole with their gradients summed over tp) and context
// parallelism; a Qwen2 with a sliding window from block 1 on under cp and pp; a tp plan that leaves the q/k norms' gradients per rank fails the comparison.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite, type Tolerance } from './helpers/equivalence.js';
import type { Out, Run } from './fixtures/llama_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('qwen', 'test/fixtures/llama_layouts_rank.ts');
/** float64: a different summation order only. */
const F64: Tolerance = { loss: 1e-12, norm: 1e-12, param: 1e-10 };

const QWEN3 = { family: 'qwen3', attnBias: 'all', qkNorm: true, headDim: 6 };
const QWEN2 = { family: 'qwen2', attnBias: 'qkv' };
// Qwen2 with a sliding window of 3 (of 8 tokens) from block 1 on (max_window_layers = 1): block 0 full.
const QWEN2_WINDOWED = { ...QWEN2, slidingWindow: 3, windowFrom: 1 };
const base = { micro: 2, steps: 3 };
const q3 = (name: string, layout?: Run['layout'], extra: Partial<Run> = {}): Run => ({ name, ...(layout ? { layout } : {}), ...base, model: QWEN3, ...extra });

const { launch } = suite;
const reference = launch(1, [q3('ref_q3'), q3('ref_q2', undefined, { model: QWEN2 }), q3('ref_q2w', undefined, { model: QWEN2_WINDOWED })]);
const world2 = launch(2, [
  q3('q3_dp2', { dp: 2 }),
  q3('q3_z3', { zero: 3 }),
  q3('q3_pp2', { pp: 2, ppSchedule: '1f1b' }),
  q3('q3_tp2_sp', { tp: 2, sequenceParallel: true }),
  q3('q3_cp2', { cp: 2 }),
  q3('q2_tp2', { tp: 2 }, { model: QWEN2 }),
  q3('q3_tp2_qknorm_local', { tp: 2 }, { mutate: 'qkNormLocal' }),
  // Each block its own window: the ring (with full recompute) and pipeline stages by the global block index.
  q3('q2w_cp2_ac', { cp: 2 }, { model: QWEN2_WINDOWED, ac: 'full' }),
  q3('q2w_pp2', { pp: 2, ppSchedule: '1f1b' }, { model: QWEN2_WINDOWED }),
]);

const compare = (name: string, refName = 'ref_q3'): void => void suite.compare(name, 2, refName, F64);

test('Qwen3 (q/k norms, biases on q, k, v, o) under dp, ZeRO-3, pp, tp + sp and cp equals one process; Qwen2 (q, k, v biases) under tp', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['q3_dp2', 'q3_z3', 'q3_pp2', 'q3_tp2_sp', 'q3_cp2']) compare(name);
  compare('q2_tp2', 'ref_q2');
  // The runs differ from each other: the options change the model.
  assert.notDeepEqual(suite.read('ref_q2', 1)[0]!.losses, suite.read('ref_q3', 1)[0]!.losses);
});

test('Qwen2 with a sliding window from block 1 (model.windowFrom): cp (full recompute) and pp (stages of different windows) equal one process', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['q2w_cp2_ac', 'q2w_pp2']) compare(name, 'ref_q2w');
  // The window is in effect: without it the run differs.
  assert.notDeepEqual(suite.read('ref_q2w', 1)[0]!.losses, suite.read('ref_q2', 1)[0]!.losses);
});

test('Qwen3: a tp plan that leaves the q/k norms\' gradients per rank fails the comparison', async () => {
  await Promise.all([reference, world2]);
  assert.throws(() => compare('q3_tp2_qknorm_local'), /rank \d: (gradient norm|parameter layers\.\d\.attn\.[qk]Norm\.weight)/);
});
