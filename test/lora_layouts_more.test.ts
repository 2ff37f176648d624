// LoRA under every layout but tensor parallelism, against one process (test/fixtures/lora_layouts_rank.ts):
// a GPT (4 blocks) with rank-4 adapters on every Linear but the head, and the MLP-Mixer of
// examples/own_model with rank-2 adapters, trained 3 AdamW steps with clipping in float64 (float32
// under bf16-mixed). Every rank's losses, gradient norms, whole parameters and last-step adapter
// gradients equal one process's; the frozen base never moves and has no gradients. Layouts: pp = 2
// under GPipe, 1F1B, interleaved and zero bubble (whose W pass forms the adapters' weight
// gradients), pp x dp, pp x ZeRO-2/3, cp = 2 and cp x ZeRO-3, HSDP, full and selective activation
// checkpointing (the adapters inside a checkpointed block recompute), bf16-mixed, ep = 2 on an MoE
// GPT (adapters on attention only; the experts and the router stay frozen), ZeRO-3 built with
// deferred init. Corner cases: adapters in the last blocks only (the first pipeline rank trains
// nothing: no gradient bytes, an empty optimizer, and the schedule still runs), a frozen tied
// embedding across stages, and a tied embedding frozen in one copy only (refused on every rank).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { maxRelDiff, scaledDiff } from './helpers/close.js';
import { pool } from './helpers/pool.js';
import { equivalenceSuite, type Tolerance } from './helpers/equivalence.js';
import type { Out, Run } from './fixtures/lora_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('lora-more', 'test/fixtures/lora_layouts_rank.ts', { timeoutMs: 400_000, queue: pool() });
/** float64: a different summation order only. */
const F64: Tolerance = { loss: 1e-12, norm: 1e-12, param: 1e-10 };
/**
 * bf16-mixed against one process in bf16-mixed with micro-batches of the same shape, as
 * test/llama_layouts.test.ts has it: float32 reduction order only. The base holds bfloat16 values
 * (a base stored in bfloat16), so ZeRO-3's bfloat16 gathers read what one process reads: measured 0
 * under dp, ZeRO-3 and zero bubble alike.
 */
const BF16: Tolerance = { loss: 1e-6, norm: 1e-6, param: 1e-6, scaled: true };

const steps = 3;
const L = { rank: 4, alpha: 8, targets: ['all-linear'] };
/** Adapters in the last block only: a 2-stage split's first stage holds nothing that trains. */
const LAST = { rank: 4, alpha: 8, targets: ['layers.3.attn.qkv', 'layers.3.mlp.fc'] };
const ML = { rank: 2, alpha: 4, targets: ['all-linear'] };
const MLAST = { rank: 2, alpha: 4, targets: ['4.tok', '4.out'] };
/** Top-2 softmax router with the auxiliary loss and a shared expert, every block. */
const MOE = { topK: 2, router: 'softmax', balance: 'aux', sharedExperts: 1 } as const;

const g = (name: string, layout: Run['layout'], extra: Partial<Run> = {}): Run => ({ name, layout, micro: 2, steps, lora: L, ...extra });
const m = (name: string, layout: Run['layout'], extra: Partial<Run> = {}): Run => ({ name, layout, micro: 2, steps, model: 'mixer', lora: ML, ...extra });

const reference = suite.launch(1, [
  { name: 'ref', micro: 2, steps, lora: L },
  { name: 'ref_last', micro: 2, steps, lora: LAST },
  { name: 'ref_tied', micro: 2, steps, lora: L, tie: true },
  // Micro-batches of 2 rows, as each rank of dp 2 x micro 2 and a pipeline of micro 4 run them.
  { name: 'ref_bf16', micro: 4, steps, lora: L, precision: 'bf16-mixed' },
  { name: 'ref_moe', micro: 4, steps, lora: L, moe: MOE },
  { name: 'ref_m', micro: 2, steps, model: 'mixer', lora: ML },
  { name: 'ref_m_last', micro: 2, steps, model: 'mixer', lora: MLAST },
  { name: 'ref_m_bf16', micro: 2, steps, model: 'mixer', lora: ML, precision: 'bf16-mixed' },
]);
const world2 = suite.launch(2, [
  g('pp2_gpipe', { pp: 2, ppSchedule: 'gpipe' }),
  g('pp2_1f1b', { pp: 2, ppSchedule: '1f1b' }),
  g('pp2_interleaved', { pp: 2, ppSchedule: 'interleaved', ppVirtualStages: 2 }),
  g('pp2_zb', { pp: 2, ppSchedule: 'zb' }),
  g('pp2_1f1b_last', { pp: 2, ppSchedule: '1f1b' }, { lora: LAST }),
  g('pp2_zb_last', { pp: 2, ppSchedule: 'zb' }, { lora: LAST }),
  g('pp2_1f1b_tied', { pp: 2, ppSchedule: '1f1b' }, { tie: true }),
  g('cp2', { cp: 2 }),
  g('z3', { zero: 3 }), // built with deferred init: the base has no memory until ZeRO-3 shards it
  g('dp2_ac_full', {}, { ac: 'full' }),
  g('z3_ac_selective', { zero: 3 }, { ac: 'selective' }),
  g('pp2_zb_ac_full', { pp: 2, ppSchedule: 'zb' }, { ac: 'full' }),
  g('pp2_1f1b_ac_selective', { pp: 2, ppSchedule: '1f1b' }, { ac: 'selective' }),
  g('dp2_bf16', {}, { precision: 'bf16-mixed' }),
  g('z3_bf16', { zero: 3 }, { precision: 'bf16-mixed' }),
  g('pp2_zb_bf16', { pp: 2, ppSchedule: 'zb' }, { precision: 'bf16-mixed', micro: 4 }),
  g('ep2', { ep: 2 }, { moe: MOE }),
  g('ep2_z3', { ep: 2, zero: 3 }, { moe: MOE }),
  // A tied embedding frozen by its stage-0 name only: its last-stage copy ('head.weight') still trains.
  { name: 'pp2_tied_half_frozen', layout: { pp: 2, ppSchedule: '1f1b' }, micro: 2, steps, tie: true, frozen: ['^wte\\.'], fails: true },
  m('m_pp2_gpipe', { pp: 2, ppSchedule: 'gpipe' }),
  m('m_pp2_1f1b', { pp: 2, ppSchedule: '1f1b' }),
  // Four stages of 2, 2, 1 and 1 layers: the middle ones pass the embedded input h0 through unchanged.
  m('m_pp2_interleaved', { pp: 2, ppSchedule: 'interleaved', ppVirtualStages: 2 }),
  m('m_pp2_zb', { pp: 2, ppSchedule: 'zb' }),
  m('m_pp2_zb_last', { pp: 2, ppSchedule: 'zb' }, { lora: MLAST }),
  m('m_z3', { zero: 3 }),
  m('m_dp2_bf16', {}, { micro: 1, precision: 'bf16-mixed' }),
]);
const world4 = suite.launch(4, [
  g('pp2_dp2_tied', { pp: 2, ppSchedule: '1f1b' }, { tie: true }),
  g('pp2_z3_zb', { pp: 2, zero: 3, ppSchedule: 'zb' }),
  g('pp2_z2_zb_last', { pp: 2, zero: 2, ppSchedule: 'zb' }, { lora: LAST }),
  g('hsdp_z3', { zero: 3, dpShard: 2, dpReplicate: 2 }, { micro: 1 }),
  g('cp2_z3', { cp: 2, zero: 3 }, { micro: 1 }),
  m('m_pp2_z3', { pp: 2, zero: 3, ppSchedule: '1f1b' }, { micro: 1 }),
  m('m_hsdp_z3', { zero: 3, dpShard: 2, dpReplicate: 2 }, { micro: 1 }),
]);

const isAdapter = (k: string): boolean => /\.lora[AB]\.weight$/.test(k);

/** The reference trained its adapters, and only them; its last-step gradients can tell a wrong one from a right one. */
function checkReference(name: string): Out {
  const ref = suite.read(name, 1)[0]!;
  const adapters = Object.keys(ref.params).filter(isAdapter).sort();
  assert.ok(adapters.length > 0, `${name}: no adapters`);
  assert.deepEqual([...ref.trainable].sort(), adapters, `${name}: the adapters train, nothing else`);
  assert.deepEqual(Object.keys(ref.gradsLast).sort(), adapters);
  for (const k of adapters) assert.ok(ref.gradsLast[k]!.some((x) => x !== 0), `${name}: ${k} has a zero gradient at the last step`);
  assert.deepEqual(ref.frozenMoved, [], `${name}: the base moved`);
  return ref;
}

/**
 * Run `name` against `refName` (tolerance `tol`): losses, norms and parameters (suite.compare), and
 * on every rank: only adapters train, their last-step gradients equal one process's, the frozen base
 * never moved; over the ranks every adapter trains somewhere.
 */
function compare(name: string, nproc: number, refName: string, tol: Tolerance = F64): Out[] {
  const ref = checkReference(refName);
  const { outs } = suite.compare(name, nproc, refName, tol);
  const trained = new Set<string>();
  for (const o of outs) {
    const who = `${name}: rank ${o.rank}`;
    assert.deepEqual(o.trainable.filter((k) => !isAdapter(k)), [], `${who}: base parameters train`);
    assert.deepEqual(Object.keys(o.gradsLast).sort(), [...new Set(o.trainable)].sort(), `${who}: gradients for its adapters only`);
    for (const [k, v] of Object.entries(o.gradsLast)) {
      const d = tol.scaled ? scaledDiff(v, ref.gradsLast[k]!) : maxRelDiff(v, ref.gradsLast[k]!);
      assert.ok(d <= tol.param * 10, `${who}: last-step gradient of ${k} differs from one process by ${d}`);
      trained.add(k);
    }
    assert.deepEqual(o.frozenMoved, [], `${who}: the base moved`);
  }
  assert.deepEqual(ref.trainable.filter((k) => !trained.has(k)), [], `${name}: adapters no rank trains`);
  return outs;
}

test('LoRA under every pipeline schedule on 2 stages (GPipe, 1F1B, interleaved, zero bubble) equals one process, GPT and Mixer', async () => {
  await Promise.all([reference, world2]);
  for (const s of ['gpipe', '1f1b', 'interleaved', 'zb']) {
    const outs = compare(`pp2_${s}`, 2, 'ref');
    // Each rank holds and trains its own stages' adapters only.
    assert.ok(outs.every((o) => o.trainable.length > 0 && o.trainable.length < checkReference('ref').trainable.length), `pp2_${s}: a rank trains every adapter`);
    compare(`m_pp2_${s}`, 2, 'ref_m');
  }
});

test('LoRA with adapters in the last block only: the first pipeline rank trains nothing (no gradient bytes, no optimizer state) and the schedule still runs, alone and over ZeRO-2', async () => {
  await Promise.all([reference, world2, world4]);
  for (const [name, nproc, ref] of [['pp2_1f1b_last', 2, 'ref_last'], ['pp2_zb_last', 2, 'ref_last'], ['m_pp2_zb_last', 2, 'ref_m_last'], ['pp2_z2_zb_last', 4, 'ref_last']] as const) {
    const outs = compare(name, nproc, ref);
    for (const o of outs) {
      if (o.ppRank !== 0) continue;
      assert.deepEqual(o.trainable, [], `${name}: rank ${o.rank} holds adapters`);
      assert.equal(o.memory!.gradBytes, 0, `${name}: rank ${o.rank} holds gradient bytes`);
      assert.equal(o.memory!.trainableBytes, 0);
    }
    assert.ok(outs.some((o) => o.ppRank === 1 && o.trainable.length === 4), `${name}: the last stage trains the 4 adapters`);
  }
});

test('LoRA with a frozen tied embedding across pipeline stages (pp = 2, and pp 2 x dp 2) equals one process; a tied embedding frozen in one copy only is refused on every rank', async () => {
  await Promise.all([reference, world2, world4]);
  compare('pp2_1f1b_tied', 2, 'ref_tied');
  compare('pp2_dp2_tied', 4, 'ref_tied');
  for (const o of suite.read('pp2_tied_half_frozen', 2)) {
    assert.match(o.error ?? '', /tied parameter 'wte\.weight' is frozen \(requiresGrad = false\) in 1 of its copies and trains in 1; freeze every copy/, `rank ${o.rank}`);
  }
});

test('LoRA under pp x ZeRO-3 (zero bubble), HSDP 2 x 2 (ZeRO-3), cp = 2 and cp 2 x ZeRO-3, ZeRO-3 built with deferred init, equals one process, GPT and Mixer', async () => {
  await Promise.all([reference, world2, world4]);
  compare('pp2_z3_zb', 4, 'ref');
  compare('hsdp_z3', 4, 'ref');
  compare('cp2', 2, 'ref');
  compare('cp2_z3', 4, 'ref');
  compare('z3', 2, 'ref');
  compare('m_z3', 2, 'ref_m');
  compare('m_pp2_z3', 4, 'ref_m');
  compare('m_hsdp_z3', 4, 'ref_m');
});

test('LoRA under full and selective activation checkpointing (dp, ZeRO-3, pipelines) equals one process without: the adapters recompute inside their blocks', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['dp2_ac_full', 'z3_ac_selective', 'pp2_zb_ac_full', 'pp2_1f1b_ac_selective']) compare(name, 2, 'ref');
});

test('LoRA under bf16-mixed (dp, ZeRO-3, zero bubble; the Mixer under dp) equals one process in bf16-mixed', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['dp2_bf16', 'z3_bf16', 'pp2_zb_bf16']) compare(name, 2, 'ref_bf16', BF16);
  compare('m_dp2_bf16', 2, 'ref_m_bf16', BF16);
  // The tolerance tells precisions apart: the float64 run is far outside it.
  assert.throws(() => suite.compare('ref', 1, 'ref_bf16', BF16), /vs one process|differs from one process/);
});

test('LoRA on an MoE GPT under ep = 2 (and ep 2 x ZeRO-3) equals one process: adapters on attention only, the experts and the router frozen and unchanged', async () => {
  await Promise.all([reference, world2]);
  const ref = checkReference('ref_moe');
  assert.ok(ref.trainable.every((k) => /\.attn\.(qkv|proj)\.lora[AB]\.weight$/.test(k)), `adapters outside attention: ${ref.trainable.join(', ')}`);
  const experts = Object.keys(ref.params).filter((k) => /\.mlp\.(experts|shared)\.|\.router$/.test(k));
  assert.ok(experts.some((k) => k.endsWith('.router')) && experts.some((k) => k.includes('.experts.')));
  for (const name of ['ep2', 'ep2_z3']) {
    for (const o of compare(name, 2, 'ref_moe')) {
      for (const k of experts) assert.deepEqual(o.params[k], ref.params[k], `${name}: rank ${o.rank}: ${k} is not the frozen value`);
    }
  }
});
