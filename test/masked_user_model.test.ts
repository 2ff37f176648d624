// A model flotilla does not know (the MLP-Mixer of examples/own_model/model.ts, through
// test/fixtures/user_model_rank.ts) trained on labels with gaps (-100: not trained) with a loss the
// user wrote, a cross-entropy that ignores -100 and says it `reduces`: every layout minimises the
// mean over the global batch's trained rows ([Note: global loss reduction]), though each
// micro-batch and each data-parallel rank holds a different number of them, one micro-batch of each
// step holds none and one step trains nothing at all (skipped alike everywhere). Every rank's
// losses, gradient norms (before clipping) and parameters equal one process's, the whole model on
// the whole global batch in one forward, in float64: data parallel, ZeRO-1/2/3, tensor parallel,
// pipelines (1F1B, zero bubble), HSDP, and pipelines over ZeRO-3 and over HSDP.
// A loss that only means (the model's own, which never heard of masks) keeps its old meaning: the
// mean of the micro-batch means, which differs from the mean over trained rows on the same data.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { equivalenceSuite, type RankResult } from './helpers/equivalence.js';
import { relDiff } from './helpers/close.js';

interface Run { name: string; layout?: Record<string, unknown>; micro: number; masked: 'empty' | 'every'; reduces?: boolean }
const suite = equivalenceSuite<Run, RankResult>('masked-user', 'test/fixtures/user_model_rank.ts', { timeoutMs: 240_000 });
/**
 * float64: a different summation order only. Losses and norms agree to a few ulps; some token-mixing
 * biases get gradients near 0, whose rounding AdamW's normalisation turns into visible steps (the
 * user-model test's 1e-7 on parameters).
 */
const TOL = { loss: 1e-12, norm: 1e-11, param: 1e-7 };

// Every masked run's micro-batches hold 3 of the global batch's 12 rows (the fixture's maskedRow).
const masked = { masked: 'empty', reduces: true } as const;
const mean = { masked: 'every' } as const;
const reference = suite.launch(1, [
  { name: 'ref', micro: 1, ...masked },
  // The mean of the 4 micro-batches' means; and the mean over the trained rows of the same batches.
  { name: 'ref_mean', micro: 4, ...mean },
  { name: 'ref_mean_tokens', micro: 1, ...mean, reduces: true },
]);
const world2 = suite.launch(2, [
  { name: 'dp', layout: {}, micro: 2, ...masked },
  { name: 'z1', layout: { zero: 1 }, micro: 2, ...masked },
  { name: 'z2', layout: { zero: 2 }, micro: 2, ...masked },
  { name: 'z3', layout: { zero: 3 }, micro: 2, ...masked },
  { name: 'tp2', layout: { tp: 2 }, micro: 4, ...masked },
  { name: 'pp2_1f1b', layout: { pp: 2, ppSchedule: '1f1b' }, micro: 4, ...masked },
  { name: 'pp2_zb', layout: { pp: 2, ppSchedule: 'zb' }, micro: 4, ...masked },
  { name: 'mean_dp', layout: {}, micro: 2, ...mean },
  { name: 'mean_pp2_zb', layout: { pp: 2, ppSchedule: 'zb' }, micro: 4, ...mean },
]);
const world4 = suite.launch(4, [
  // dp = 4, a micro-batch per rank: at each step one rank holds no trained row but takes part.
  { name: 'hsdp', layout: { zero: 2, dpReplicate: 2, dpShard: 2 }, micro: 1, ...masked },
  { name: 'pp2_z3', layout: { pp: 2, zero: 3, ppSchedule: '1f1b' }, micro: 2, ...masked },
  { name: 'pp2_hsdp_rs', layout: { pp: 2, zero: 2, dpReplicate: 2, accumulate: 'reduceScatterEachAllReduceLast', ppSchedule: 'zb' }, micro: 2, ...masked },
  { name: 'mean_z3', layout: { zero: 3 }, micro: 1, ...mean },
]);

test('your own model with your own reducing loss on labels with gaps: dp, ZeRO-1/2/3, tp, pp (1F1B, zero bubble) on 2 ranks equal one process', async () => {
  await Promise.all([reference, world2]);
  const ref = suite.read('ref', 1)[0]!;
  assert.equal(ref.norms[2], 0, 'step 2 trains nothing and is skipped');
  assert.ok(ref.norms.every((n, i) => i === 2 || n > 0), `the other steps train (${ref.norms})`);
  for (const n of ['dp', 'z1', 'z2', 'z3', 'tp2', 'pp2_1f1b', 'pp2_zb']) suite.compare(n, 2, 'ref', TOL);
});

test('your own model with your own reducing loss on labels with gaps: HSDP (a rank with no trained row), pp over ZeRO-3 and over HSDP on 4 ranks equal one process', async () => {
  await Promise.all([reference, world4]);
  for (const n of ['hsdp', 'pp2_z3', 'pp2_hsdp_rs']) suite.compare(n, 4, 'ref', TOL);
});

test('a loss without `reduces` still gives the mean of the micro-batch means under dp, ZeRO-3 and zero bubble', async () => {
  await Promise.all([reference, world2]);
  // The two reductions differ on these batches, so the comparison below tells them apart.
  const means = suite.read('ref_mean', 1)[0]!.losses, tokens = suite.read('ref_mean_tokens', 1)[0]!.losses;
  assert.ok(relDiff(means[0]!, tokens[0]!) > 1e-3, `the mean of means ${means[0]} vs the mean over trained rows ${tokens[0]}`);
  for (const n of ['mean_dp', 'mean_pp2_zb']) suite.compare(n, 2, 'ref_mean', TOL);
  await world4;
  suite.compare('mean_z3', 4, 'ref_mean', TOL);
});
