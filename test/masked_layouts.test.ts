// The loss over a masked global batch (trained spans that differ row by row, a row and a step that
// train nothing) under every layout against one process (test/fixtures/masked_layouts_rank.ts):
// 4 AdamW steps with clipping in float64, the second of which trains nothing and is skipped on every
// rank. Every rank's losses, gradient norms (before clipping) and every whole parameter equal the
// one-process run's, where the loss is the sum over the global batch's trained targets over their
// count ([Note: global loss reduction]): data parallel, ZeRO-1/2/3 and HSDP; pipelines (1F1B,
// interleaved, zero bubble); tensor parallel with sequence and loss parallelism; context parallel
// (chunks holding no trained target); expert parallel. And forwardOnly (the reference log-probabilities'
// path) under dp, pipelines (the last stage's values broadcast to every stage) and loss parallelism
// equals the whole model called on the same rows. Packed rows (several documents per row, each
// attending within itself) give the same under every layout, which scopes each micro-batch's
// documents around its forward and backward (activation checkpoints recompute inside them).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite } from './helpers/equivalence.js';
import { pool } from './helpers/pool.js';
import type { Out, Run } from './fixtures/masked_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('masked', 'test/fixtures/masked_layouts_rank.ts', { queue: pool(1) });
/** float64: a different summation order only. */
const TOL = { loss: 1e-12, norm: 1e-11, param: 1e-10 };
const steps = 4;

const reference = suite.launch(1, [
  { name: 'ref', micro: 2, steps }, { name: 'refMoE', micro: 2, steps, moe: true }, { name: 'refRead', micro: 2, steps: 0, read: true },
  { name: 'refPacked', micro: 2, steps, packed: true },
]);
const world2 = suite.launch(2, [
  { name: 'dp2', layout: { dp: 2 }, micro: 2, steps },
  { name: 'z1', layout: { zero: 1 }, micro: 2, steps },
  { name: 'z2', layout: { zero: 2 }, micro: 1, steps },
  { name: 'z3', layout: { zero: 3 }, micro: 2, steps },
  { name: 'pp2_1f1b', layout: { pp: 2 }, micro: 4, steps },
  { name: 'pp2_interleaved', layout: { pp: 2, ppSchedule: 'interleaved', ppVirtualStages: 2 }, micro: 4, steps },
  { name: 'pp2_zb', layout: { pp: 2, ppSchedule: 'zb' }, micro: 4, steps },
  { name: 'tp2_sp_lp', layout: { tp: 2, sequenceParallel: true, lossParallel: true }, micro: 2, steps },
  { name: 'cp2', layout: { cp: 2 }, micro: 2, steps },
  { name: 'read_dp2', layout: { dp: 2 }, micro: 2, steps: 0, read: true },
  { name: 'read_pp2', layout: { pp: 2 }, micro: 4, steps: 0, read: true },
  { name: 'read_pp2_interleaved', layout: { pp: 2, ppSchedule: 'interleaved', ppVirtualStages: 2 }, micro: 2, steps: 0, read: true },
  { name: 'read_tp2_lp', layout: { tp: 2, lossParallel: true }, micro: 2, steps: 0, read: true },
  { name: 'packed_z3_full', layout: { zero: 3 }, micro: 2, steps, packed: true, activationCheckpoint: 'full' },
  { name: 'packed_pp2_1f1b_full', layout: { pp: 2 }, micro: 4, steps, packed: true, activationCheckpoint: 'full' },
  { name: 'packed_pp2_zb_selective', layout: { pp: 2, ppSchedule: 'zb' }, micro: 4, steps, packed: true, activationCheckpoint: 'selective' },
  { name: 'packed_pp2_interleaved', layout: { pp: 2, ppSchedule: 'interleaved', ppVirtualStages: 2 }, micro: 4, steps, packed: true },
  { name: 'packed_tp2_sp_lp', layout: { tp: 2, sequenceParallel: true, lossParallel: true }, micro: 2, steps, packed: true },
  { name: 'packed_cp2_full', layout: { cp: 2 }, micro: 2, steps, packed: true, activationCheckpoint: 'full' },
]);
const world4 = suite.launch(4, [
  { name: 'hsdp', layout: { zero: 2, dpReplicate: 2, dpShard: 2 }, micro: 1, steps },
  { name: 'cp2_pp2', layout: { cp: 2, pp: 2 }, micro: 2, steps },
  { name: 'pp2_dp2_z1', layout: { pp: 2, zero: 1 }, micro: 2, steps },
  { name: 'ep2', layout: { ep: 2 }, micro: 1, steps, moe: true },
  { name: 'packed_cp2_pp2', layout: { cp: 2, pp: 2 }, micro: 2, steps, packed: true },
  { name: 'packed_cp4', layout: { cp: 4 }, micro: 1, steps, packed: true },
]);

const compare = (name: string, nproc: number, refName = 'ref'): void => void suite.compare(name, nproc, refName, TOL);

test('masked loss: data parallel, ZeRO-1/2/3 on 2 ranks and HSDP on 4 equal one process', async () => {
  await Promise.all([reference, world2, world4]);
  for (const n of ['dp2', 'z1', 'z2', 'z3']) compare(n, 2);
  compare('hsdp', 4);
});

test('masked loss: pipelines (1F1B, interleaved, zero bubble; with ZeRO-1 over dp = 2) equal one process', async () => {
  await Promise.all([reference, world2, world4]);
  for (const n of ['pp2_1f1b', 'pp2_interleaved', 'pp2_zb']) compare(n, 2);
  compare('pp2_dp2_z1', 4);
});

test('masked loss: tensor parallel with sequence and loss parallelism, context parallel (alone and in a pipeline) and expert parallel equal one process', async () => {
  await Promise.all([reference, world2, world4]);
  compare('tp2_sp_lp', 2);
  compare('cp2', 2);
  compare('cp2_pp2', 4);
  compare('ep2', 4, 'refMoE');
});

test('forwardOnly under dp, pipelines (1F1B, interleaved) and tensor parallel with loss parallelism reads what the whole model gives, on every rank', async () => {
  await Promise.all([reference, world2]);
  const want = suite.read('refRead', 1)[0]!.reads!;
  assert.equal(Object.keys(want).length, 8);
  for (const [name, dp] of [['read_dp2', 2], ['read_pp2', 1], ['read_pp2_interleaved', 1], ['read_tp2_lp', 1]] as const) {
    for (const o of suite.read(name, 2)) {
      const got = o.reads!;
      assert.equal(Object.keys(got).length, 8 / dp, `${name}: rank ${o.rank} reads its data-parallel rank's rows`);
      for (const [row, v] of Object.entries(got)) {
        assert.ok(Math.abs(v - want[row]!) <= 1e-12 * Math.abs(want[row]!) + 1e-13, `${name}: rank ${o.rank}, row ${row}: ${v} vs the whole model's ${want[row]}`);
      }
    }
  }
});

test('packed rows (several documents each) under ZeRO-3, pipelines (1F1B, zero bubble, interleaved; full and selective activation checkpointing), tp with sequence and loss parallelism and cp (2, 4, cp x pp) equal one process', async () => {
  await Promise.all([reference, world2, world4]);
  for (const n of ['packed_z3_full', 'packed_pp2_1f1b_full', 'packed_pp2_zb_selective', 'packed_pp2_interleaved', 'packed_tp2_sp_lp', 'packed_cp2_full']) compare(n, 2, 'refPacked');
  compare('packed_cp2_pp2', 4, 'refPacked');
  compare('packed_cp4', 4, 'refPacked');
});
