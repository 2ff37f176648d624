// Context parallelism against one process (test/fixtures/cp_layouts_rank.ts): 3 AdamW steps with
// clipping and accumulation, in float64, for the GPT (learned positions) and the Llama (rotary
// positions, grouped-query heads, tied embeddings). Every rank's losses, gradient norms (before
// clipping) and every whole parameter equal the one-process run's: cp = 2 (with ZeRO-2 over the cp
// ranks, with full and selective activation checkpointing), cp = 4, cp = 2 x ZeRO-3 over dp = 2, HSDP,
// cp = 2 x tp = 2 (GPT with sequence and loss parallelism) and cp = 2 x pp = 2 (1F1B; zero bubble;
// ZeRO-2). The MLP-Mixer, which has no per-token targets, and a model without attention through the
// sequence shard are refused with the reason.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite } from './helpers/equivalence.js';
import { pool } from './helpers/pool.js';
import type { Out, Run } from './fixtures/cp_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('cp', 'test/fixtures/cp_layouts_rank.ts', { queue: pool(1) });
/** float64: a different summation order only. */
const TOL = { loss: 1e-12, norm: 1e-11, param: 1e-10 };
const steps = 3;

const { launch } = suite;

const reference = launch(1, [{ name: 'refG', micro: 1, steps }, { name: 'refL', micro: 1, steps, arch: 'llama' }]);
const world2 = launch(2, [
  { name: 'cp2_G', layout: { cp: 2 }, micro: 2, steps },
  { name: 'cp2_L', layout: { cp: 2 }, micro: 2, steps, arch: 'llama' },
  { name: 'cp2_z2_G', layout: { cp: 2, zero: 2 }, micro: 2, steps },
  { name: 'cp2_full_G', layout: { cp: 2 }, micro: 1, steps, activationCheckpoint: 'full' },
  { name: 'cp2_selective_L', layout: { cp: 2 }, micro: 1, steps, arch: 'llama', activationCheckpoint: 'selective' },
  { name: 'cp2_mixer', layout: { cp: 2 }, micro: 1, steps, refused: 'mixer' },
  { name: 'cp2_noAttention', layout: { cp: 2 }, micro: 1, steps, refused: 'noAttention' },
]);
const world4 = launch(4, [
  { name: 'cp4_G', layout: { cp: 4 }, micro: 1, steps },
  { name: 'cp4_L', layout: { cp: 4 }, micro: 2, steps, arch: 'llama' },
  { name: 'cp2_z3_G', layout: { cp: 2, zero: 3 }, micro: 1, steps },
  { name: 'cp2_z3_L', layout: { cp: 2, zero: 3 }, micro: 1, steps, arch: 'llama' },
  { name: 'cp2_hsdp_z2_G', layout: { cp: 2, zero: 2, dpReplicate: 2, dpShard: 1 }, micro: 1, steps },
  { name: 'cp2_tp2_sp_G', layout: { cp: 2, tp: 2, sequenceParallel: true, lossParallel: true }, micro: 1, steps },
  { name: 'cp2_tp2_L', layout: { cp: 2, tp: 2 }, micro: 1, steps, arch: 'llama' },
  { name: 'cp2_pp2_G', layout: { cp: 2, pp: 2 }, micro: 2, steps },
  { name: 'cp2_pp2_zb_L', layout: { cp: 2, pp: 2, ppSchedule: 'zb' }, micro: 2, steps, arch: 'llama' },
  { name: 'cp2_pp2_z2_G', layout: { cp: 2, pp: 2, zero: 2 }, micro: 2, steps },
]);

const compare = (name: string, nproc: number, refName: string): void => void suite.compare(name, nproc, refName, TOL);

test('cp = 2 on 2 ranks equals one process (GPT, Llama; ZeRO-2 over the cp ranks, reducing each of 2 micro-batches)', async () => {
  await Promise.all([reference, world2]);
  compare('cp2_G', 2, 'refG');
  compare('cp2_L', 2, 'refL');
  compare('cp2_z2_G', 2, 'refG');
});

test('cp = 2 with full and selective activation checkpointing equals one process', async () => {
  await Promise.all([reference, world2]);
  compare('cp2_full_G', 2, 'refG');
  compare('cp2_selective_L', 2, 'refL');
});

test('cp = 4 equals one process (GPT, Llama)', async () => {
  await Promise.all([reference, world4]);
  compare('cp4_G', 4, 'refG');
  compare('cp4_L', 4, 'refL');
});

test('cp = 2 x ZeRO-3 over dp = 2 equals one process (GPT, Llama), and HSDP (ZeRO-2 sharded over the cp ranks, 2 replicas)', async () => {
  await Promise.all([reference, world4]);
  compare('cp2_z3_G', 4, 'refG');
  compare('cp2_z3_L', 4, 'refL');
  compare('cp2_hsdp_z2_G', 4, 'refG');
});

test('cp = 2 x tp = 2 equals one process (GPT with sequence and loss parallelism, Llama)', async () => {
  await Promise.all([reference, world4]);
  compare('cp2_tp2_sp_G', 4, 'refG');
  compare('cp2_tp2_L', 4, 'refL');
});

test('cp = 2 x pp = 2 equals one process (GPT 1F1B, Llama zero bubble; ZeRO-2 sharded over the cp ranks of a stage)', async () => {
  await Promise.all([reference, world4]);
  compare('cp2_pp2_G', 4, 'refG');
  compare('cp2_pp2_zb_L', 4, 'refL');
  compare('cp2_pp2_z2_G', 4, 'refG');
});

test('the MLP-Mixer (tokens mixed by a Linear over the whole sequence, one label per sequence) is refused under cp, naming why', async () => {
  await world2;
  for (const o of suite.read('cp2_mixer', 2)) {
    assert.match(o.error ?? '', /context parallelism cuts every micro-batch tensor along dim 1, the sequence, and a tensor of shape \[2\] has none: it applies to models whose inputs and targets are per token/);
  }
});

test('a model whose attention does not go through the sequence shard is refused after its first step, naming the fix', async () => {
  await world2;
  for (const o of suite.read('cp2_noAttention', 2)) {
    assert.match(o.error ?? '', /parallel\.cp = 2: the model ran no attention through the sequence shard.*Set parallel\.cp = 1/);
  }
});
