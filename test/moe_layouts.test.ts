// MoE models under expert parallelism against one process (test/fixtures/moe_layouts_rank.ts):
// 3 AdamW steps with clipping and accumulation, in float64. Every rank's losses, gradient norms
// (before clipping) and every whole parameter (experts gathered over ep) equal the one-process
// run's: plain data parallel with experts, ep = 2 on 2 ranks (every expert on one rank) and on 4
// (experts also reduced over the ranks holding the same ones), with ZeRO-1, ZeRO-2 and ZeRO-3, under HSDP, with tensor parallelism tp = 2 and with pipeline parallelism pp = 2;
// MoE blocks under context parallelism cp = 2 (alone, with ep = 2 and 4 over dpShard x cp, ZeRO-3, pp = 2, tp = 2); top-1 and
// top-2, softmax and sigmoid routers, the auxiliary loss and the expert bias, a capacity that drops
// tokens, shared experts, the GPT and the Llama; ep = 2 with [train] kernels = "fused" (the experts'
// GELU and SwiGLU through the one-pass kernels). A wrong expert-gradient scale fails the comparison.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite } from './helpers/equivalence.js';
import { pool } from './helpers/pool.js';
import type { Out, Run } from './fixtures/moe_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('moe', 'test/fixtures/moe_layouts_rank.ts', { queue: pool(1) });
/** float64: a different summation order only. */
const TOL = { loss: 1e-12, norm: 1e-11, param: 1e-10 };

const { launch } = suite;

/** Two models: top-2 softmax router with the auxiliary loss and a shared expert; top-1 sigmoid with the expert bias and a capacity that drops tokens, every second block. */
const A = { topK: 2, router: 'softmax', balance: 'aux', sharedExperts: 1 } as const;
const B = { topK: 1, router: 'sigmoid', balance: 'bias', capacityFactor: 1, every: 2 } as const;
const L = { topK: 2, router: 'sigmoid', balance: 'aux', capacityFactor: 1.25 } as const;
const steps = 3;

// Frozen before parallelize (requiresGrad = false): the embeddings, block 0's attention and block 1's experts.
const FROZEN = ['^wte\\.', '^wpe\\.', '^layers\\.0\\.attn\\.', '^layers\\.1\\.mlp\\.experts\\.'];
// Every expert frozen: the experts' data-parallel wrapper has nothing to reduce.
const EXPERTS_FROZEN = ['^layers\\.\\d+\\.mlp\\.experts\\.'];

// The reference reads micro-batches of 2 rows: what each rank of dp 2 x micro 2 and of dp 4 x micro 1 reads.
const reference = launch(1, [
  { name: 'refA', micro: 4, steps, moe: A }, { name: 'refB', micro: 4, steps, moe: B },
  { name: 'refL', micro: 4, steps, moe: L, arch: 'llama' },
  { name: 'refA_frozen', micro: 4, steps, moe: A, frozen: FROZEN },
  { name: 'refA_experts_frozen', micro: 4, steps, moe: A, frozen: EXPERTS_FROZEN },
]);
const world2 = launch(2, [
  { name: 'dp2_A', layout: { dp: 2 }, micro: 2, steps, moe: A },
  { name: 'ep2_A', layout: { ep: 2 }, micro: 2, steps, moe: A },
  { name: 'ep2_B', layout: { ep: 2 }, micro: 2, steps, moe: B },
  { name: 'ep2_L', layout: { ep: 2 }, micro: 2, steps, moe: L, arch: 'llama' },
  { name: 'ep2_z2_B', layout: { ep: 2, zero: 2 }, micro: 2, steps, moe: B },
  { name: 'ep2_z3_L', layout: { ep: 2, zero: 3 }, micro: 2, steps, moe: L, arch: 'llama' },
  // Tensor parallelism with MoE blocks (experts whole on both tp ranks): every block MoE, and every second one.
  { name: 'tp2_A', layout: { tp: 2 }, micro: 4, steps, moe: A },
  { name: 'tp2_B', layout: { tp: 2 }, micro: 4, steps, moe: B },
  // MoE blocks in a pipeline (the second stage only, for B).
  { name: 'pp2_A', layout: { pp: 2 }, micro: 4, steps, moe: A },
  { name: 'pp2_zb_B', layout: { pp: 2, ppSchedule: 'zb' }, micro: 4, steps, moe: B },
  // Context parallelism: each rank holds half of every sequence, the routing is the whole sequences'.
  { name: 'cp2_A', layout: { cp: 2 }, micro: 4, steps, moe: A },
  { name: 'cp2_B', layout: { cp: 2 }, micro: 4, steps, moe: B },
  { name: 'cp2_L', layout: { cp: 2 }, micro: 4, steps, moe: L, arch: 'llama' },
  // Frozen parameters, dense and experts.
  { name: 'ep2_frozen_A', layout: { ep: 2 }, micro: 2, steps, moe: A, frozen: FROZEN },
  { name: 'ep2_z3_frozen_A', layout: { ep: 2, zero: 3 }, micro: 2, steps, moe: A, frozen: FROZEN },
  { name: 'cp2_frozen_A', layout: { cp: 2 }, micro: 4, steps, moe: A, frozen: FROZEN },
  { name: 'ep2_experts_frozen_A', layout: { ep: 2 }, micro: 2, steps, moe: A, frozen: EXPERTS_FROZEN },
  { name: 'ep2_z3_experts_frozen_A', layout: { ep: 2, zero: 3 }, micro: 2, steps, moe: A, frozen: EXPERTS_FROZEN },
  // [train] kernels = "fused": the experts' exact GELU (GPT) and SwiGLU (Llama) through the one-pass kernels.
  { name: 'ep2_fused_A', layout: { ep: 2 }, micro: 2, steps, moe: A, kernels: 'fused' },
  { name: 'ep2_fused_L', layout: { ep: 2 }, micro: 2, steps, moe: L, arch: 'llama', kernels: 'fused' },
]);
const world4 = launch(4, [
  { name: 'ep2_dp4_A', layout: { ep: 2 }, micro: 1, steps, moe: A },
  { name: 'ep4_B', layout: { ep: 4 }, micro: 1, steps, moe: B },
  { name: 'ep2_dp4_z1_B', layout: { ep: 2, zero: 1 }, micro: 1, steps, moe: B },
  { name: 'ep2_dp4_z2_L', layout: { ep: 2, zero: 2 }, micro: 1, steps, moe: L, arch: 'llama' },
  { name: 'ep2_dp4_z3_A', layout: { ep: 2, zero: 3 }, micro: 1, steps, moe: A },
  { name: 'ep2_dp4_z3_B', layout: { ep: 2, zero: 3 }, micro: 1, steps, moe: B },
  { name: 'ep2_tp2_A', layout: { ep: 2, tp: 2 }, micro: 2, steps, moe: A },
  { name: 'ep2_tp2_L', layout: { ep: 2, tp: 2 }, micro: 2, steps, moe: L, arch: 'llama' },
  { name: 'ep2_pp2_A', layout: { ep: 2, pp: 2 }, micro: 2, steps, moe: A },
  { name: 'ep2_pp2_zb_B', layout: { ep: 2, pp: 2, ppSchedule: 'zb' }, micro: 2, steps, moe: B },
  { name: 'ep2_pp2_z2_B', layout: { ep: 2, pp: 2, zero: 2 }, micro: 2, steps, moe: B },
  { name: 'ep2_pp2_L', layout: { ep: 2, pp: 2 }, micro: 2, steps, moe: L, arch: 'llama' },
  { name: 'ep2_hsdp_z3_A', layout: { ep: 2, zero: 3, dpShard: 2, dpReplicate: 2 }, micro: 1, steps, moe: A },
  { name: 'ep2_hsdp_z2_B', layout: { ep: 2, zero: 2, dpShard: 2, dpReplicate: 2 }, micro: 1, steps, moe: B },
  { name: 'ep2_dp4_averaged', layout: { ep: 2 }, micro: 1, steps, moe: A, mutate: 'averageExperts' },
  // Experts split over ranks of dpShard x cp: ep = 2 within each cp ring, and across the cp rings' ranks.
  { name: 'cp2_ep2_B', layout: { cp: 2, ep: 2 }, micro: 2, steps, moe: B },
  { name: 'cp2_ep4_L', layout: { cp: 2, ep: 4 }, micro: 2, steps, moe: L, arch: 'llama' },
  { name: 'cp2_z3_A', layout: { cp: 2, zero: 3 }, micro: 2, steps, moe: A },
  { name: 'cp2_pp2_B', layout: { cp: 2, pp: 2 }, micro: 4, steps, moe: B },
  { name: 'cp2_tp2_A', layout: { cp: 2, tp: 2 }, micro: 4, steps, moe: A },
]);

const compare = (name: string, nproc: number, refName: string): void => void suite.compare(name, nproc, refName, TOL);

test('MoE GPT under plain data parallelism (every rank holds every expert) equals one process', async () => {
  await Promise.all([reference, world2]);
  compare('dp2_A', 2, 'refA');
});

test('expert parallelism ep = 2 on 2 ranks equals one process: GPT top-2 with aux loss and a shared expert, top-1 sigmoid with expert bias and dropped tokens, Llama', async () => {
  await Promise.all([reference, world2]);
  compare('ep2_A', 2, 'refA');
  compare('ep2_B', 2, 'refB');
  compare('ep2_L', 2, 'refL');
});

test('kernels = "fused" with ep = 2: the experts\' GELU (GPT) and SwiGLU (Llama) run through the one-pass kernels on every rank and train as the eager one-process run', async () => {
  await Promise.all([reference, world2]);
  compare('ep2_fused_A', 2, 'refA');
  compare('ep2_fused_L', 2, 'refL');
  for (const name of ['ep2_fused_A', 'ep2_fused_L']) {
    for (const o of suite.read(name, 2)) assert.ok(o.activationCalls > 0, `${name}: rank ${o.rank}'s experts never ran the fused kernels`);
  }
  for (const o of suite.read('ep2_A', 2)) assert.equal(o.activationCalls, 0, 'the eager run called the fused kernels');
});

test('expert parallelism with ZeRO-2 and ZeRO-3 on 2 ranks equals one process', async () => {
  await Promise.all([reference, world2]);
  compare('ep2_z2_B', 2, 'refB');
  compare('ep2_z3_L', 2, 'refL');
});

test('expert parallelism ep = 2 with ZeRO-3 over 4 data-parallel ranks equals one process', async () => {
  await Promise.all([reference, world4]);
  compare('ep2_dp4_z3_A', 4, 'refA');
  compare('ep2_dp4_z3_B', 4, 'refB');
});

test('expert parallelism on 4 ranks (ep = 2 x 2 holding the same experts; ep = 4; ZeRO-1 and ZeRO-2) equals one process', async () => {
  await Promise.all([reference, world4]);
  compare('ep2_dp4_A', 4, 'refA');
  compare('ep4_B', 4, 'refB');
  compare('ep2_dp4_z1_B', 4, 'refB');
  compare('ep2_dp4_z2_L', 4, 'refL');
});

test('MoE blocks under tensor parallelism (experts whole on every tp rank) equal one process', async () => {
  await Promise.all([reference, world2]);
  compare('tp2_A', 2, 'refA');
  compare('tp2_B', 2, 'refB');
});

test('expert parallelism ep = 2 x tensor parallelism tp = 2 on 4 ranks equals one process (GPT and Llama)', async () => {
  await Promise.all([reference, world4]);
  compare('ep2_tp2_A', 4, 'refA');
  compare('ep2_tp2_L', 4, 'refL');
});

test('MoE blocks in a pipeline (1F1B; zero bubble with experts on the second stage only) equal one process', async () => {
  await Promise.all([reference, world2]);
  compare('pp2_A', 2, 'refA');
  compare('pp2_zb_B', 2, 'refB');
});

test('expert parallelism ep = 2 x pipeline pp = 2 on 4 ranks equals one process (1F1B, zero bubble, ZeRO-2 with a stage without experts, Llama)', async () => {
  await Promise.all([reference, world4]);
  compare('ep2_pp2_A', 4, 'refA');
  compare('ep2_pp2_zb_B', 4, 'refB');
  compare('ep2_pp2_z2_B', 4, 'refB');
  compare('ep2_pp2_L', 4, 'refL');
});

test('expert parallelism under HSDP (2 shard x 2 replicas, ZeRO-3 and ZeRO-2) equals one process', async () => {
  await Promise.all([reference, world4]);
  compare('ep2_hsdp_z3_A', 4, 'refA');
  compare('ep2_hsdp_z2_B', 4, 'refB');
});

test('MoE blocks under context parallelism cp = 2 equal one process: routing, capacity, balance loss and expert bias over the whole sequences (GPT top-2 and top-1 with dropped tokens, Llama)', async () => {
  await Promise.all([reference, world2]);
  compare('cp2_A', 2, 'refA');
  compare('cp2_B', 2, 'refB');
  compare('cp2_L', 2, 'refL');
});

test('cp = 2 with expert parallelism (ep = 2, ep = 4 over dpShard x cp), with ZeRO-3, with a pipeline pp = 2 and with tp = 2 on 4 ranks equals one process', async () => {
  await Promise.all([reference, world4]);
  compare('cp2_ep2_B', 4, 'refB');
  compare('cp2_ep4_L', 4, 'refL');
  compare('cp2_z3_A', 4, 'refA');
  compare('cp2_pp2_B', 4, 'refB');
  compare('cp2_tp2_A', 4, 'refA');
});

test('frozen parameters (embeddings, a block\'s attention, a block\'s experts; or every expert) under ep = 2, ep = 2 with ZeRO-3 and cp = 2 equal one process training the same frozen model; frozen values never move and frozen experts live with their expert-parallel rank', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['ep2_frozen_A', 'ep2_z3_frozen_A', 'cp2_frozen_A']) {
    compare(name, 2, 'refA_frozen');
    for (const o of suite.read(name, 2)) {
      assert.deepEqual(o.frozenMoved, [], `${name}: rank ${o.rank} moved frozen parameters`);
      // Under ep = 2 a rank holds (and places) half of the frozen experts, like the trainable ones.
      if (name.startsWith('ep2')) assert.equal(o.frozenHeld!['layers.1.mlp.experts.fc'], 2 * 16 * 64, `${name}: rank ${o.rank} holds another part of the frozen experts`);
    }
  }
  // Every expert frozen (the experts' wrapper reduces nothing, and under ZeRO-3 its units are gathered and freed all the same).
  for (const name of ['ep2_experts_frozen_A', 'ep2_z3_experts_frozen_A']) {
    compare(name, 2, 'refA_experts_frozen');
    for (const o of suite.read(name, 2)) assert.deepEqual(o.frozenMoved, [], `${name}: rank ${o.rank} moved frozen experts`);
  }
  const ref = suite.read('refA_frozen', 1)[0]!;
  assert.equal(ref.frozenMoved!.length, 0);
  assert.notDeepEqual(ref.params['layers.1.attn.qkv.weight'], suite.read('refA', 1)[0]!.params['layers.1.attn.qkv.weight'], 'freezing changed nothing');
});

test('expert gradients averaged like dense ones (not scaled by 1 / every data-parallel rank) fail the comparison', async () => {
  await Promise.all([reference, world4]);
  assert.throws(() => compare('ep2_dp4_averaged', 4, 'refA'), /rank 0: gradient norm at step 0/);
});
