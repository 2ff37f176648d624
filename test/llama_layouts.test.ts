// The Llama (grouped-query attention: 4 query heads, 2 key/value heads; 4 layers) under every
// layout against one process (test/fixtures/llama_layouts_rank.ts, the model from the registry as
// the trainer gets it): 3 AdamW steps with clipping, 2 micro-batches per step, in float64. Every
// rank's losses and gradient norms (before clipping) and every whole parameter equal the one-process
// run's: data parallel, ZeRO-1/2/3, HSDP, each pipeline schedule (GPipe, 1F1B, interleaved, zero
// bubble; tied head across stages), tensor parallelism with sequence and loss parallelism, their
// combinations on 4 ranks, full and selective activation checkpointing; and bf16-mixed (float32
// masters) against one process in bf16-mixed; the fused kernels under tp + sp and ZeRO-3 against the
// eager one process. A tensor-parallel plan that leaves the key/value
// heads whole fails the same comparison.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite, type Tolerance } from './helpers/equivalence.js';
import type { Out, Run } from './fixtures/llama_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('llama', 'test/fixtures/llama_layouts_rank.ts');
/** float64: a different summation order only. */
const F64: Tolerance = { loss: 1e-12, norm: 1e-12, param: 1e-10 };
/**
 * bf16-mixed data parallel against one process in bf16-mixed with micro-batches of the same shape
 * (so every bfloat16 GEMM sees the same rows): float32 reduction order only, measured 0 on losses,
 * 5e-10 on norms, 2e-7 on parameters (the largest difference over a tensor's largest element).
 */
const BF16_DP: Tolerance = { loss: 1e-6, norm: 1e-6, param: 1e-6, scaled: true };
/**
 * bf16-mixed ZeRO-3 reads RMSNorm and embedding weights from their bfloat16 gathered copy (a norm
 * weight of 1.003 reads as 1: [Note: bf16 gathers]) and tp sums bfloat16 partial products, where one
 * process does neither; AdamW's first steps, which move a weight by about lr whatever its gradient,
 * turn those roundings into parameter differences: measured 1.3e-4 on losses, 4e-3 on norms and
 * 0.12-0.15 on parameters (scaled as above), where float64 against bf16-mixed differs by 2.0.
 */
const BF16_ROUNDED: Tolerance = { loss: 1e-3, norm: 1e-2, param: 0.3, scaled: true };

const { launch } = suite;

const base = { micro: 2, steps: 3 };
const run = (name: string, layout: Run['layout'], extra: Partial<Run> = {}): Run => ({ name, layout, ...base, ...extra });
const sp = { sequenceParallel: true }, lp = { lossParallel: true };
const bf16 = { precision: 'bf16-mixed' } as const;

const reference = launch(1, [
  { name: 'ref', ...base }, { name: 'ref_tied', ...base, tie: true },
  // Micro-batches of 2 rows, as each of 2 data-parallel ranks runs them.
  { name: 'ref_bf16', ...base, micro: 4, ...bf16 },
]);
const world2 = launch(2, [
  run('dp2', { dp: 2 }),
  run('z1', { zero: 1 }),
  run('z2', { zero: 2 }),
  run('z3', { zero: 3 }),
  run('z3_tied', { zero: 3 }, { tie: true }),
  run('pp2_gpipe', { pp: 2, ppSchedule: 'gpipe' }),
  run('pp2_1f1b', { pp: 2, ppSchedule: '1f1b' }),
  run('pp2_interleaved', { pp: 2, ppSchedule: 'interleaved', ppVirtualStages: 2 }),
  run('pp2_zb', { pp: 2, ppSchedule: 'zb' }),
  run('pp2_1f1b_tied', { pp: 2, ppSchedule: '1f1b' }, { tie: true }),
  run('tp2', { tp: 2 }),
  run('tp2_sp', { tp: 2, ...sp }),
  run('tp2_sp_lp', { tp: 2, ...sp, ...lp }),
  run('tp2_sp_lp_tied', { tp: 2, ...sp, ...lp }, { tie: true }),
  run('dp2_ac_full', { dp: 2 }, { ac: 'full' }),
  run('z3_ac_selective', { zero: 3 }, { ac: 'selective' }),
  run('tp2_sp_ac_selective', { tp: 2, ...sp }, { ac: 'selective' }),
  run('pp2_ac_full', { pp: 2, ppSchedule: '1f1b' }, { ac: 'full' }),
  run('dp2_bf16', { dp: 2 }, bf16),
  run('z3_bf16', { zero: 3 }, bf16),
  run('tp2_sp_bf16', { tp: 2, ...sp }, bf16),
  run('tp2_kv_whole', { tp: 2 }, { mutate: 'kvWhole' }),
  run('tp2_sp_ac_full_fused', { tp: 2, ...sp }, { ac: 'full', kernels: 'fused' }),
  run('z3_fused', { zero: 3 }, { kernels: 'fused' }),
]);
const world4 = launch(4, [
  run('hsdp_2x2_z3', { zero: 3, dpShard: 2, dpReplicate: 2 }),
  run('tp2_dp2_z3_sp_lp', { tp: 2, zero: 3, ...sp, ...lp }),
  run('tp2_pp2_sp_lp_tied', { tp: 2, pp: 2, ppSchedule: '1f1b', ...sp, ...lp }, { tie: true }),
  run('pp2_dp2_z2_zb', { pp: 2, zero: 2, ppSchedule: 'zb' }),
  // Zero bubble splits the weight gradients of the prepared (plain) q, k, v, gate and up under tp.
  run('tp2_pp2_zb_sp', { tp: 2, pp: 2, ppSchedule: 'zb', ...sp }),
]);

const compare = (name: string, nproc: number, refName = 'ref', tol = F64): void => void suite.compare(name, nproc, refName, tol);

test('Llama: data parallel and ZeRO-1/2/3 on 2 ranks equal one process (float64; ZeRO-3 also tied)', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['dp2', 'z1', 'z2', 'z3']) compare(name, 2);
  compare('z3_tied', 2, 'ref_tied');
});

test('Llama: every pipeline schedule on 2 stages equals one process (GPipe, 1F1B, interleaved, zero bubble; a tied head across stages)', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['pp2_gpipe', 'pp2_1f1b', 'pp2_interleaved', 'pp2_zb']) compare(name, 2);
  compare('pp2_1f1b_tied', 2, 'ref_tied');
});

test('Llama: tensor parallel on 2 ranks (key/value heads split), with sequence and loss parallelism, tied, equals one process', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['tp2', 'tp2_sp', 'tp2_sp_lp']) compare(name, 2);
  compare('tp2_sp_lp_tied', 2, 'ref_tied');
});

test('Llama: a tp plan that leaves k and v whole (query heads meet the wrong key/value heads) fails the comparison', async () => {
  await Promise.all([reference, world2]);
  assert.throws(() => compare('tp2_kv_whole', 2), /rank 0: gradient norm at step 0/);
});

test('Llama: full and selective activation checkpointing under data parallel, ZeRO-3, tp + sp and a pipeline equal one process without', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['dp2_ac_full', 'z3_ac_selective', 'tp2_sp_ac_selective', 'pp2_ac_full']) compare(name, 2);
});

test('Llama: kernels = "fused" (attention, RMSNorm, SwiGLU, rotary) under tp + sp with full checkpointing and under ZeRO-3 equals one eager process', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['tp2_sp_ac_full_fused', 'z3_fused']) compare(name, 2);
});

test('Llama: bf16-mixed under data parallel, ZeRO-3 and tp + sp equals one process in bf16-mixed', async () => {
  await Promise.all([reference, world2]);
  compare('dp2_bf16', 2, 'ref_bf16', BF16_DP);
  for (const name of ['z3_bf16', 'tp2_sp_bf16']) compare(name, 2, 'ref_bf16', BF16_ROUNDED);
  // And the bf16 tolerance tells precisions apart: the float64 run is far outside it.
  assert.throws(() => compare('ref', 1, 'ref_bf16', BF16_ROUNDED), /vs one process|differs from one process/);
});

test('Llama on 4 ranks: HSDP 2 x 2 (ZeRO-3), tp 2 x ZeRO-3 over dp 2 (sp, lp), tp 2 x pp 2 (sp, lp, tied; sp under zero bubble), pp 2 x ZeRO-2 over dp 2 (zero bubble)', async () => {
  await Promise.all([reference, world4]);
  compare('hsdp_2x2_z3', 4);
  compare('tp2_dp2_z3_sp_lp', 4);
  compare('tp2_pp2_sp_lp_tied', 4, 'ref_tied');
  compare('pp2_dp2_z2_zb', 4);
  compare('tp2_pp2_zb_sp', 4);
});
