// A GPT under tensor parallelism against one process, in float64 (test/fixtures/tp_gpt_rank.ts):
// 3 AdamW steps with clipping and 2 micro-batches per step; every rank's losses, gradient norms
// (before clipping), step 0's clipped gradients read through grads.fullGrad and every whole
// parameter it holds equal the one-process run's. tp=2 alone
// (with and without sequence parallelism and loss parallelism), tied embeddings, tp=2 x dp=2 under
// ZeRO-3, tp=2 x pp=2 (1F1B), and tp=2 x pp=2 x dp=2 on 8 ranks. A deliberately wrong norm that
// counts a replicated LayerNorm on every tp rank must fail the same comparison; dropout masks agree
// across tp ranks where activations are replicated and differ where they are sharded; and a
// config that tp cannot split is refused before any rank starts.
//
// Every launch (the worlds, the refused configs, the verify run) is queued when the file loads, two
// at a time (test/helpers/pool.ts); each test awaits the ones it reads.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { maxRelDiff, relDiff as rel } from './helpers/close.js';
import { REPO_ROOT } from './helpers/world.js';
import { BIN } from './helpers/cli.js';
import { pool, spawnAsync, started } from './helpers/pool.js';
import { equivalenceSuite } from './helpers/equivalence.js';
import type { Out, Run } from './fixtures/tp_gpt_rank.js';

const queue = pool();
const suite = equivalenceSuite<Run, Out>('tp', 'test/fixtures/tp_gpt_rank.ts', { timeoutMs: 240_000, queue });
const { dir, launch } = suite;
/** Losses and norms: float64 rounding of a different summation order. */
const TOL_SCALAR = 1e-12;
/** Parameters after 3 AdamW steps (Adam divides by sqrt(v), which magnifies rounding in tiny gradients). */
const TOL_PARAM = 1e-10;


const base = { micro: 2, steps: 3 };
const run = (name: string, layout: Run['layout'], extra: Partial<Run> = {}): Run => ({ name, layout, ...base, ...extra });

// The one-process references (one process), then the worlds.
// Frozen parameters (requiresGrad = false before parallelize): the embeddings, all of block 1 (a
// ZeRO-3 unit with nothing to train) and one matrix of block 0 (a unit partly frozen).
const FROZEN = ['^wte\\.', '^wpe\\.', '^layers\\.1\\.', '^layers\\.0\\.mlp\\.fc\\.weight$'];
const frozen = { frozen: FROZEN };
const reference = launch(1, [{ name: 'ref', ...base }, { name: 'ref_tied', ...base, tie: true }, { name: 'ref_frozen', ...base, ...frozen }]);
const sp = { sequenceParallel: true }, lp = { lossParallel: true };
const world2 = launch(2, [
  run('tp2', { tp: 2 }),
  run('tp2_sp', { tp: 2, ...sp }),
  run('tp2_lp', { tp: 2, ...lp }),
  run('tp2_sp_lp', { tp: 2, ...sp, ...lp }),
  run('tp2_tied', { tp: 2 }, { tie: true }),
  run('tp2_sp_lp_tied', { tp: 2, ...sp, ...lp }, { tie: true }),
  run('tp2_wrong_lnF', { tp: 2 }, { mutate: 'lnFEveryTpRank' }),
  run('tp2_wrong_all', { tp: 2, ...sp }, { mutate: 'normEveryTpRank' }),
  run('drop_a', { tp: 2 }, { dropout: 0.2 }),
  run('drop_b', { tp: 2 }, { dropout: 0.2 }),
  run('drop_sp', { tp: 2, ...sp }, { dropout: 0.2 }),
  run('drop_ac', { tp: 2 }, { dropout: 0.2, ac: 'full' }),
  run('drop_sp_sel', { tp: 2, ...sp }, { dropout: 0.2, ac: 'selective' }),
  run('frozen_dp2', {}, frozen),
  run('frozen_z1', { zero: 1 }, frozen),
  run('frozen_z2', { zero: 2 }, frozen),
  run('frozen_z3', { zero: 3 }, frozen),
  run('frozen_pp2', { pp: 2, ppSchedule: '1f1b' }, frozen),
  run('frozen_tp2', { tp: 2 }, frozen),
]);
const world4 = launch(4, [
  run('tp2_dp2_z3', { tp: 2, zero: 3 }),
  run('tp2_dp2_z3_sp_lp', { tp: 2, zero: 3, ...sp, ...lp }),
  run('tp2_pp2', { tp: 2, pp: 2, ppSchedule: '1f1b' }),
  run('tp2_pp2_sp_lp_tied', { tp: 2, pp: 2, ppSchedule: '1f1b', ...sp, ...lp }, { tie: true }),
  run('tp2_pp2_tied', { tp: 2, pp: 2, ppSchedule: '1f1b' }, { tie: true }),
  run('tp2_pp2_zb_sp', { tp: 2, pp: 2, ppSchedule: 'zb', ...sp }),
  run('frozen_hsdp', { zero: 3, dpShard: 2, dpReplicate: 2 }, frozen),
]);
const world8 = launch(8, [run('tp2_pp2_dp2', { tp: 2, pp: 2, zero: 1, ...sp })]);

/** Every rank's losses, norms and whole parameters against the reference; every parameter held by some rank. */
function compare(name: string, nproc: number, refName = 'ref', opts: { split?: boolean } = {}): void {
  const who = (o: Out): string => `${name}: rank ${o.rank} (tp ${o.tpRank}, pp ${o.ppRank}, dp ${o.dpRank})`;
  const { ref, outs } = suite.compare(name, nproc, refName, { loss: TOL_SCALAR, norm: TOL_SCALAR, param: TOL_PARAM }, who);
  for (const o of outs) {
    // The gradient API: fullGrad(p) is the whole gradient (slices gathered over tp) after clipping.
    for (const [k, v] of Object.entries(o.grads0)) {
      const d = maxRelDiff(v, ref.grads0[k]!);
      assert.ok(d <= TOL_PARAM, `${who(o)}: grads.fullGrad(${k}) at step 0 differs from one process's gradient by ${d}`);
    }
    assert.deepEqual(Object.keys(o.grads0).sort(), Object.keys(o.params).sort());
    if (opts.split) assert.ok(Object.keys(o.params).length < Object.keys(ref.params).length, `${who(o)} holds the whole model`);
  }
}

test('GPT at tp=2, 3 steps x 2 micro-batches, AdamW + clipping, float64: every rank\'s losses, gradient norms and whole parameters equal one process (plain, sequence parallel, loss parallel, both)', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['tp2', 'tp2_sp', 'tp2_lp', 'tp2_sp_lp']) compare(name, 2);
});

test('grads.localGradShard(p).tp names the slice a tp rank holds: fused q, k, v in 3 chunks along dim 0, row-parallel weights along dim 1, vocabulary rows of the embedding; none for LayerNorms, position embeddings and row-parallel biases', async () => {
  await world2;
  for (const o of suite.read('tp2_sp_lp', 2)) {
    const t = o.shards!;
    const at = (dim: number, chunks = 1) => ({ dim, index: o.tpRank, parts: 2, chunks });
    assert.deepEqual(t['layers.0.attn.qkv.weight'], at(0, 3));
    assert.deepEqual(t['layers.1.attn.qkv.bias'], at(0, 3));
    assert.deepEqual(t['layers.0.attn.proj.weight'], at(1));
    assert.deepEqual(t['layers.0.mlp.fc.weight'], at(0));
    assert.deepEqual(t['layers.1.mlp.proj.weight'], at(1));
    assert.deepEqual(t['wte.weight'], at(0));
    assert.deepEqual(t['head.weight'], at(0));
    for (const k of ['wpe.weight', 'lnF.weight', 'lnF.bias', 'layers.0.ln1.weight', 'layers.1.ln2.bias', 'layers.0.attn.proj.bias', 'layers.1.mlp.proj.bias']) assert.equal(t[k], null, `${k} is whole on every tp rank`);
  }
});

/**
 * A run with FROZEN parameters against one process training the same frozen model: losses, norms,
 * whole parameters and the trainable parameters' gradients; frozen parameters unchanged to the bit
 * and without gradients; the memory report's gradient bytes those of the trainable parameters
 * (over `shards` ranks when sharded).
 */
function compareFrozen(name: string, nproc: number, shards: number, opts: { split?: boolean } = {}): Out[] {
  const who = (o: Out): string => `${name}: rank ${o.rank} (tp ${o.tpRank}, pp ${o.ppRank}, dp ${o.dpRank})`;
  const { ref, outs } = suite.compare(name, nproc, 'ref_frozen', { loss: TOL_SCALAR, norm: TOL_SCALAR, param: TOL_PARAM }, who);
  const isFrozen = (k: string): boolean => FROZEN.some((f) => new RegExp(f).test(k));
  assert.deepEqual(ref.frozenMoved, [], 'one process moved a frozen parameter');
  assert.equal(Object.keys(ref.params).filter(isFrozen).length, 15, 'frozen parameters of the reference');
  assert.ok(Object.keys(ref.grads0).every((k) => !isFrozen(k)), 'one process has gradients for frozen parameters');
  for (const o of outs) {
    for (const [k, v] of Object.entries(o.grads0)) {
      const d = maxRelDiff(v, ref.grads0[k]!);
      assert.ok(d <= TOL_PARAM, `${who(o)}: grads.fullGrad(${k}) at step 0 differs from one process's gradient by ${d}`);
    }
    // Every parameter the rank holds is placed (frozen ones too); only the trainable ones have gradients.
    assert.deepEqual(Object.keys(o.grads0).sort(), Object.keys(o.params).filter((k) => !isFrozen(k)).sort(), `${who(o)}: gradients`);
    assert.deepEqual(Object.keys(o.frozenHeld!).sort(), Object.keys(o.params).filter(isFrozen).sort(), `${who(o)}: placements of frozen parameters`);
    assert.deepEqual(o.frozenMoved, [], `${who(o)}: frozen parameters changed in training`);
    for (const k of Object.keys(o.params).filter(isFrozen)) assert.deepEqual(o.params[k], ref.params[k], `${who(o)}: frozen ${k} is not the initial value`);
    // Gradient storage for the trainable parameters only: padding (under 64 elements per bucket) aside.
    const m = o.memory!;
    const grads = m.gradBytes * shards;
    assert.ok(grads >= m.trainableBytes && grads < m.trainableBytes + 8 * 64 * shards && m.frozenBytes > 8 * 64 * shards,
      `${who(o)}: ${m.gradBytes} gradient bytes over ${shards} shard(s) for ${m.trainableBytes} bytes of trainable and ${m.frozenBytes} of frozen parameters`);
    if (opts.split) assert.ok(Object.keys(o.params).length < Object.keys(ref.params).length, `${who(o)} holds the whole model`);
  }
  return outs;
}

test('frozen parameters (embeddings, a whole block, one matrix) under dp, ZeRO-1/2/3, pp=2 (1F1B) and tp=2 on 2 ranks: equal to one process training the same frozen model; frozen values never move, have no gradients and no gradient bytes', async () => {
  await Promise.all([reference, world2]);
  compareFrozen('frozen_dp2', 2, 1);
  compareFrozen('frozen_z1', 2, 1);
  compareFrozen('frozen_z2', 2, 2);
  compareFrozen('frozen_pp2', 2, 1, { split: true });
  compareFrozen('frozen_tp2', 2, 1);
  // ZeRO-3: a frozen parameter is sharded with its unit: between steps the ranks hold disjoint parts of it.
  const ref = suite.read('ref_frozen', 1)[0]!;
  for (const [name, nproc, replicas] of [['frozen_z3', 2, 1], ['frozen_hsdp', 4, 2]] as const) {
    if (name === 'frozen_hsdp') await world4;
    const outs = compareFrozen(name, nproc, nproc / replicas);
    for (const k of Object.keys(outs[0]!.frozenHeld!)) {
      const held = outs.map((o) => o.frozenHeld![k]!);
      const whole = ref.params[k]!.length;
      assert.equal(held.reduce((a, b) => a + b, 0), whole * replicas, `${name}: ${k} held ${held.join(' + ')} of ${whole} elements x ${replicas} replica(s)`);
    }
    // Each rank holds its shard of the frozen elements (a small parameter may lie in one shard): about 1 / shards of them.
    const total = Object.keys(outs[0]!.frozenHeld!).reduce((a, k) => a + ref.params[k]!.length, 0);
    for (const o of outs) {
      const mine = Object.values(o.frozenHeld!).reduce((a, b) => a + b, 0);
      assert.ok(mine <= total / (nproc / replicas) + 16 && mine > 0, `${name}: rank ${o.rank} holds ${mine} of the ${total} frozen elements`);
    }
  }
});

test('tied embeddings under tp=2 (also with sequence and loss parallelism): the gradient norm, losses and parameters are one process\'s', async () => {
  await Promise.all([reference, world2]);
  compare('tp2_tied', 2, 'ref_tied');
  compare('tp2_sp_lp_tied', 2, 'ref_tied');
});

test('a norm that counts the replicated final LayerNorm on every tp rank (or every replicated parameter) fails the comparison: double counting over tp is caught', async () => {
  await Promise.all([reference, world2]);
  const ref = suite.read('ref', 1)[0]!;
  for (const name of ['tp2_wrong_lnF', 'tp2_wrong_all']) {
    assert.throws(() => compare(name, 2), /rank 0 .*gradient norm at step 0/, `${name}: the wrong norm passed the comparison`);
    const o = suite.read(name, 2)[0]!;
    const err = rel(o.norms[0]!, ref.norms[0]!);
    assert.ok(o.norms[0]! > ref.norms[0]!, `${name}: double counting makes the norm larger`);
    // The final LayerNorm alone is a small error, far above float64 rounding all the same.
    if (name === 'tp2_wrong_lnF') assert.ok(err > 1e3 * TOL_SCALAR && err < 0.1, `${name}: relative error ${err}`);
  }
});

test('tp=2 x dp=2 under ZeRO-3 (also with sequence and loss parallelism) on 4 ranks: equal to one process on every rank', async () => {
  await Promise.all([reference, world4]);
  compare('tp2_dp2_z3', 4);
  compare('tp2_dp2_z3_sp_lp', 4);
});

test('tp=2 x pp=2 (1F1B; zero bubble with sequence parallelism) on 4 ranks, untied and tied (the tied copies sliced alike on both stages; with sequence and loss parallelism): equal to one process on every rank', async () => {
  await Promise.all([reference, world4]);
  compare('tp2_pp2', 4, 'ref', { split: true });
  compare('tp2_pp2_tied', 4, 'ref_tied', { split: true });
  compare('tp2_pp2_sp_lp_tied', 4, 'ref_tied', { split: true });
  // Zero bubble: tensor-parallel Linears keep their weight gradients in I (communication sits around their matmul).
  compare('tp2_pp2_zb_sp', 4, 'ref', { split: true });
});

test('tp=2 x pp=2 x dp=2 (ZeRO-1, sequence parallel) on 8 ranks: equal to one process on every rank', async () => {
  await Promise.all([reference, world8]);
  compare('tp2_pp2_dp2', 8, 'ref', { split: true });
});

test('dropout under tp=2: masks in replicated regions are equal on both tp ranks, masks of sharded activations differ; the same seed gives the same run', async () => {
  await world2;
  const [a, b, s] = ['drop_a', 'drop_b', 'drop_sp'].map((n) => suite.read(n, 2));
  const plain = suite.read('tp2', 2);
  // Two runs of one config: bit-identical, on every rank.
  for (let r = 0; r < 2; r++) {
    assert.deepEqual(a![r]!.losses, b![r]!.losses, `rank ${r}: two runs with the same seed give other losses`);
    assert.deepEqual(a![r]!.params, b![r]!.params, `rank ${r}: two runs with the same seed end with other parameters`);
    assert.notDeepEqual(a![r]!.losses, plain[r]!.losses, 'dropout changed nothing');
  }
  const ac = suite.read('drop_ac', 2), sel = suite.read('drop_sp_sel', 2);
  for (const [runs, name] of [[a!, 'drop_a'], [s!, 'drop_sp'], [ac, 'drop_ac'], [sel, 'drop_sp_sel']] as const) {
    const [m0, m1] = [runs[0]!.masks!, runs[1]!.masks!];
    assert.deepEqual(Object.keys(m0).sort(), Object.keys(m1).sort());
    assert.ok(Object.keys(m0).length >= 7, `${name}: masks of ${Object.keys(m0).join(', ')}`);
    for (const [k, v] of Object.entries(m0)) {
      const kept = v.reduce((x, y) => x + y, 0) / v.length;
      // attnDrop acts after the causal softmax: the masked upper triangle is zero whatever the draw.
      assert.ok(kept > 0.3 && kept < (k.endsWith('attnDrop') ? 0.7 : 0.95), `${name}: ${k} keeps ${kept} of its elements (p = 0.2)`);
      // Replicated regions (no sequence parallelism: the embeddings' dropout and the residual-branch
      // dropouts after the row-parallel sums): the same mask. Sharded (attention heads, or this
      // rank's tokens under sequence parallelism): a mask of its own.
      const replicated = (name === 'drop_a' || name === 'drop_ac') && !k.endsWith('attnDrop');
      if (replicated) assert.deepEqual(m1[k], v, `${name}: ${k} runs on replicated activations and draws another mask on tp rank 1`);
      else assert.notDeepEqual(m1[k], v, `${name}: ${k} runs on sharded activations and draws the same mask on both tp ranks`);
    }
    assert.deepEqual(runs[0]!.losses, runs[1]!.losses, `${name}: tp ranks report other losses`);
    assert.ok(runs[0]!.losses.every(Number.isFinite));
  }
});

test('dropout under tp=2 with activation checkpointing (full; selective with sequence parallelism): each block\'s recompute replays the masks of its forward on every rank', async () => {
  await world2;
  for (const name of ['drop_ac', 'drop_sp_sel']) {
    for (const o of suite.read(name, 2)) {
      const blocks = Object.keys(o.masks!).filter((k) => k.startsWith('layers.'));
      assert.equal(blocks.length, 6, `${name}: ${blocks.join(', ')}`);
      // A recomputed dropout is called twice for the first micro-batch: forward, then recompute. The
      // last block keeps its graph for its backward ([Note: last region] in src/nn/checkpoint.ts), and
      // selective recomputes the attention core only: their second call is the next micro-batch.
      const last = Math.max(...blocks.map((k) => Number(k.split('.')[1])));
      const recomputed = blocks.filter((k) => !k.startsWith(`layers.${last}.`) && (name === 'drop_ac' || k.endsWith('attnDrop')));
      assert.ok(recomputed.length > 0, `${name}: no recomputed dropout among ${blocks.join(', ')}`);
      for (const k of blocks) {
        if (recomputed.includes(k)) assert.deepEqual(o.second![k], o.masks![k], `${name}: rank ${o.rank}: the recompute of ${k} drew another mask`);
        else assert.notDeepEqual(o.second![k], o.masks![k], `${name}: rank ${o.rank}: ${k} drew one mask for two micro-batches`);
      }
      // Outside the blocks (the embeddings' dropout is not checkpointed) the second call is the next micro-batch.
      assert.notDeepEqual(o.second!.drop, o.masks!.drop, `${name}: rank ${o.rank}: two micro-batches drew one mask`);
    }
  }
  // Without checkpointing, the second call is the next micro-batch everywhere: a fresh mask.
  for (const o of suite.read('drop_a', 2)) {
    for (const k of Object.keys(o.masks!)) assert.notDeepEqual(o.second![k], o.masks![k], `drop_a: rank ${o.rank}: ${k} drew one mask for two micro-batches`);
  }
});

// ---- configs tensor parallelism cannot split: refused by the launcher, before any rank starts ----
interface Refused { code: number | null; out: string; runDir: string }
function train(overrides: string[]): Promise<Refused> {
  const runDir = join(dir, `cfg-${Math.random().toString(36).slice(2)}`);
  return started(queue(async () => {
    const r = await spawnAsync(process.execPath, [BIN, 'train', 'examples/gpt-tiny.toml', '--nproc', '2', ...overrides, `--train.runDir=${runDir}`], {
      cwd: REPO_ROOT, timeout: 60_000,
    });
    return { code: r.status, out: `${r.stdout}${r.stderr}`, runDir };
  }));
}
const headCount = train(['--parallel.tp=2', '--model.nHead=3', '--model.nEmbd=96']);
const headCountAndModel = train(['--parallel.tp=2', '--model.nHead=3']);
const vocabulary = train(['--parallel.tp=2', '--parallel.sequenceParallel=true', '--data.seqLen=126', '--data.tokenizer=byte', '--model.vocabSize=257']);
const seqLen = train(['--parallel.tp=2', '--parallel.sequenceParallel=true', '--data.seqLen=127']);
const lossParallelAlone = train(['--parallel.lossParallel=true']);

function refusedBeforeRanks(r: Refused): void {
  assert.notEqual(r.code, 0, r.out);
  assert.ok(!/\[(mesh|model|data)\]|rank \d/.test(r.out), `a rank started:\n${r.out}`);
  assert.ok(!existsSync(r.runDir), 'the refused run created its run directory');
  // One report (a config with several problems lists them under it).
  assert.equal(r.out.trim().split('\n').filter((l) => l.startsWith('flotilla:')).length, 1, `one message:\n${r.out}`);
}

test('a head count tp does not divide (--parallel.tp=2 --model.nHead=3 --model.nEmbd=96) is one message naming model.nHead and parallel.tp, before any rank starts', async () => {
  const r = await headCount;
  refusedBeforeRanks(r);
  assert.match(r.out, /model\.nHead = 3 does not divide by parallel\.tp = 2/);
});

// The model's own problem (nEmbd 128 % nHead 3) and tp's are listed in the same report.
test('flotilla train examples/gpt-tiny.toml --nproc 2 --parallel.tp=2 --model.nHead=3 exits non-zero with one message naming model.nHead and parallel.tp', async () => {
  const r = await headCountAndModel;
  refusedBeforeRanks(r);
  assert.match(r.out, /model\.nHead/);
  assert.match(r.out, /parallel\.tp/);
});

test('a vocabulary or (under sequence parallelism) a sequence length tp does not divide is named with the fix, before any rank starts', async () => {
  const r = await vocabulary;
  assert.notEqual(r.code, 0, r.out);
  assert.ok(!existsSync(r.runDir));
  assert.match(r.out, /model\.vocabSize = 257 does not divide by parallel\.tp = 2; .*pad the vocabulary/);
  assert.doesNotMatch(r.out, /data\.seqLen/, 'seqLen 126 divides by 2');
  const s = await seqLen;
  assert.notEqual(s.code, 0, s.out);
  assert.match(s.out, /data\.seqLen \(sequence parallelism shards tokens\) = 127 does not divide by parallel\.tp = 2/);
  const l = await lossParallelAlone;
  assert.notEqual(l.code, 0, l.out);
  assert.match(l.out, /parallel\.lossParallel shards the logits over the tensor-parallel ranks: set parallel\.tp > 1/);
});

const small = ['--model.nLayer=2', '--model.nEmbd=64', '--data.seqLen=32', '--data.globalBatch=8', '--parallel.bucketSizeMb=0.1'];
const verifyTp = started(queue(() => spawnAsync(process.execPath, [BIN, 'verify', 'examples/gpt-tiny.toml', '--nproc', '4', '--steps', '3', ...small,
  '--parallel.tp=2', '--parallel.sequenceParallel=true', '--parallel.lossParallel=true', '--parallel.zero=3', '--data.microBatches=2'], {
  cwd: REPO_ROOT, timeout: 240_000,
})));

test('flotilla verify: the trainer at tp=2 + sequence and loss parallelism x dp=2 under ZeRO-3 with 2 micro-batches PASSes against one process', async () => {
  const r = await verifyTp;
  const out = `${r.stdout}${r.stderr}`;
  assert.equal(r.status, 0, out);
  assert.match(out, /tp 2 \+ sequence parallel \+ loss parallel, zero 3/);
  assert.match(out, /^PASS \(tolerance/m);
  assert.equal(out.match(/^ +\d+ +[\d.]+ +[\d.e+-]+ +[\d.]+ +[\d.e+-]+$/gm)?.length, 3, `one line per step:\n${out}`);
});
