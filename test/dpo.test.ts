// DPO (src/train/dpo.ts): the criterion on hand-built preference micro-batches of a tiny float64 GPT
// against a PyTorch oracle of its own (test/oracle/dpo.py: each sequence run alone, its own DPO and
// IPO code): loss, rewards, margin, accuracy and gradients, with a frozen copy and with LoRA's
// adapters off as the reference; the first step's loss is ln 2 exactly; logSigmoid.
import { test } from 'node:test';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import assert from 'node:assert/strict';
import { manualSeed, noGrad, setNumThreads, tensor, tidy, type Tensor } from '../src/tensor/index.js';
import { GPT, type GPTConfig } from '../src/models/gpt.js';
import { applyLora, withAdaptersDisabled } from '../src/nn/lora.js';
import { withDocuments } from '../src/nn/documents.js';
import type { MicroBatch } from '../src/parallel/parallel_model.js';
import { preferenceMicroBatch, preferencePairs, sequenceTargets, type Seq } from './fixtures/preference_batches.js';
import { dpoCriterion, readSequenceLogps } from '../src/train/dpo.js';
import { PairTable, readPairTable, writePairTable } from '../src/train/reference.js';
import { parseConfig, validateConfig } from '../src/config/index.js';
import { WordCounter, trainBpe } from '../src/data/bpe_train.js';
import { objectiveConfig, referenceKind } from '../src/train/objective.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';
import { scaledErr, withFloat64 } from './oracle/check.js';

setNumThreads(1);
const skip = oracleMissing();
const TOL = 1e-12; // float64 rounding, scaled by each tensor's largest magnitude
const CFG: Partial<GPTConfig> = { vocabSize: 23, blockSize: 24, nLayer: 2, nHead: 2, nEmbd: 12 };
const T = 12;

function gpt(seed: number): GPT {
  manualSeed(seed);
  const m = new GPT(CFG);
  noGrad(() => {
    for (const [n, p] of m.namedParameters()) {
      if (/ln\w*\.weight$/.test(n)) p.normal_(1, 0.3);
      else p.normal_(0, 0.4);
    }
  });
  return m;
}

const pairs = (n: number, seed: number): Seq[] => preferencePairs(n, seed, { vocab: CFG.vocabSize!, T });
const targets = sequenceTargets;
const microBatch = (seqs: Seq[], pairIds: number[], packed = false): MicroBatch => preferenceMicroBatch(seqs, pairIds, packed ? 2 * T : T, { packed });

/** The model's logits on a micro-batch, within its documents when it packs them. */
const logitsOf = (m: GPT, mb: MicroBatch): Tensor => withDocuments(mb.docs, () => m.forward(mb.x as Tensor).logits);

interface Case { loss: 'sigmoid' | 'ipo'; beta: number; reference: 'copy' | 'adapters'; packed?: boolean }

/**
 * One DPO step's loss and gradients over two micro-batches of unequal size (3 pairs and 1: the sum
 * over pairs divided by the global count, as a layout's step does), against the oracle.
 */
function againstOracle(c: Case): void {
  withFloat64(() => tidy(() => {
    const seqs = pairs(4, 4);
    const policy = gpt(8);
    let reference: GPT | undefined;
    let trainable: [string, Tensor][];
    let scale = 1;
    if (c.reference === 'copy') {
      reference = gpt(9); // a different model: the log-ratios are not zero, so every term of the loss is exercised
      trainable = policy.namedParameters();
    } else {
      const applied = applyLora(policy, { rank: 2, alpha: 3, targets: ['qkv', 'proj', 'fc'], initSeed: 5 });
      for (const a of applied.adapters.values()) noGrad(() => a.B.weight.normal_(0, 0.3)); // adapters as if trained
      scale = [...applied.adapters.values()][0]!.scale;
      trainable = policy.namedParameters().filter(([n]) => applied.trainable.includes(n));
    }
    const mbs = [microBatch(seqs, [0, 1, 2], c.packed), microBatch(seqs, [3], c.packed)];
    const refLogps: number[] = [];
    for (const mb of mbs) {
      mb.seqs!.ref = c.reference === 'copy' ? readSequenceLogps(logitsOf(reference!, mb), mb) : withAdaptersDisabled(policy, () => readSequenceLogps(logitsOf(policy, mb), mb));
      refLogps.push(...mb.seqs!.ref);
    }
    const crit = dpoCriterion({ beta: c.beta, loss: c.loss });
    const N = mbs.reduce((a, mb) => a + crit.count(mb), 0);
    assert.equal(N, 4, 'the count is the pairs');
    let value = 0;
    const metrics: Record<string, number> = {};
    for (const mb of mbs) {
      const r = crit.apply(logitsOf(policy, mb), mb);
      r.loss.div(N).backward();
      value += r.value;
      for (const [k, v] of Object.entries(r.metrics ?? {})) metrics[k] = (metrics[k] ?? 0) + v;
    }
    const inputs: Record<string, Tensor> = Object.fromEntries(policy.namedParameters());
    if (reference) for (const [n, p] of reference.namedParameters()) inputs[`ref.${n}`] = p;
    seqs.forEach((s, i) => {
      const t = targets(s);
      inputs[`seq.${i}.x`] = tensor(t.x, { dtype: 'int64' });
      inputs[`seq.${i}.y`] = tensor(t.y, { dtype: 'int64' });
    });
    const ref = runOracle('dpo', inputs, { ...policy.cfg, beta: c.beta, loss: c.loss, reference: c.reference, scale, pairs: [[0, 1], [2, 3], [4, 5], [6, 7]] }).tensors;
    const close = (a: number, b: number, what: string) => assert.ok(Math.abs(a - b) <= TOL * Math.max(1, Math.abs(b)), `${what}: ${a} vs PyTorch ${b}`);
    assert.ok(scaledErr(tensor(refLogps), ref.reference!) <= TOL, 'reference log-probabilities');
    close(value / N, ref.loss!.item(), 'loss');
    for (const k of ['rewardsChosen', 'rewardsRejected', 'rewardsMargin', 'rewardsAccuracy']) close(metrics[k]! / N, ref[k]!.item(), k);
    const acc = ref.rewardsAccuracy!.item();
    assert.ok(acc > 0 && acc < 1, `the pairs mix right and wrong preferences (accuracy ${acc}), so accuracy is tested`);
    const grads = Object.keys(ref).filter((k) => k.startsWith('grad.')).map((k) => k.slice(5));
    assert.deepEqual(grads.sort(), trainable.map(([n]) => n).sort());
    for (const [name, p] of trainable) {
      const e = scaledErr(p.grad!, ref[`grad.${name}`]!);
      assert.ok(e <= TOL, `grad of ${name}: ${e}`);
    }
    for (const t of Object.values(ref) as Tensor[]) t.dispose();
    policy.dispose();
    reference?.dispose();
  }));
}

test('DPO (sigmoid) against a frozen copy: loss, rewards, margin, accuracy and gradients equal the float64 oracle', { skip }, () => {
  againstOracle({ loss: 'sigmoid', beta: 0.5, reference: 'copy' });
});

test('IPO against a frozen copy: per-token means, loss, rewards and gradients equal the float64 oracle', { skip }, () => {
  againstOracle({ loss: 'ipo', beta: 0.3, reference: 'copy' });
});

test('packed pairs (chosen and rejected two documents of one row) equal each sequence run alone: DPO and IPO', { skip }, () => {
  againstOracle({ loss: 'sigmoid', beta: 0.5, reference: 'copy', packed: true });
  againstOracle({ loss: 'ipo', beta: 0.3, reference: 'adapters', packed: true });
});

test('DPO with LoRA, the reference being the adapters off: loss, rewards and adapter gradients equal the float64 oracle', { skip }, () => {
  againstOracle({ loss: 'sigmoid', beta: 0.2, reference: 'adapters' });
});

test('the first step loses ln 2 per pair exactly: new adapters (B = 0) against the adapters off, and a copy of the policy', () => {
  withFloat64(() => tidy(() => {
    const seqs = pairs(3, 4);
    const mb = microBatch(seqs, [0, 1, 2]);
    const crit = dpoCriterion({ beta: 0.1, loss: 'sigmoid' });
    const lora = gpt(3);
    applyLora(lora, { rank: 2, targets: ['qkv', 'fc'], initSeed: 1 });
    mb.seqs!.ref = withAdaptersDisabled(lora, () => readSequenceLogps(logitsOf(lora, mb), mb));
    const a = crit.apply(logitsOf(lora, mb), mb);
    assert.equal(a.value / 3, Math.LN2, 'adapters');
    assert.deepEqual(a.metrics, { rewardsChosen: 0, rewardsRejected: 0, rewardsMargin: 0, rewardsAccuracy: 0 });
    const policy = gpt(3), copy = gpt(3);
    mb.seqs!.ref = readSequenceLogps(logitsOf(copy, mb), mb);
    assert.equal(crit.apply(logitsOf(policy, mb), mb).value / 3, Math.LN2, 'copy');
    // IPO's first step: (0 - 1/(2 beta))^2 per pair.
    assert.equal(dpoCriterion({ beta: 0.1, loss: 'ipo' }).apply(logitsOf(policy, mb), mb).value / 3, (1 / 0.2) ** 2);
    for (const m of [lora, policy, copy]) m.dispose();
  }));
});

test('a micro-batch with no pair gives zero and still a loss to start backward from; missing tables and references are named', () => {
  withFloat64(() => tidy(() => {
    const m = gpt(2);
    const crit = dpoCriterion({ beta: 0.1, loss: 'sigmoid' });
    const seqs = pairs(1, 1);
    const x = tensor(targets(seqs[0]!).x, { dtype: 'int64' }).unsqueeze(0);
    const none: MicroBatch = { x, y: x, seqs: { index: x.mul(0), nSeq: 0, chosen: new Int32Array(0), rejected: new Int32Array(0), pairIds: new Int32Array(0), lengths: new Int32Array(0) } };
    assert.equal(crit.count(none), 0);
    const r = crit.apply(logitsOf(m, none), none);
    assert.equal(r.value, 0);
    r.loss.backward();
    assert.equal(m.wte.weight.grad!.abs().sum().item(), 0);
    const mb = microBatch(seqs, [0]);
    assert.throws(() => crit.apply(logitsOf(m, mb), mb), /reference log-probabilities of this micro-batch were not filled/);
    assert.throws(() => crit.count({ x, y: x }), /train.objective = "dpo" needs preference batches \(data.format = "preference"\)/);
    m.dispose();
  }));
});

test('logSigmoid is log(sigmoid(x)) without overflow, and its gradient is sigmoid(-x)', () => {
  withFloat64(() => tidy(() => {
    const x = tensor([-800, -3, 0, 2.5, 800], { requiresGrad: true });
    const y = x.logSigmoid();
    const want = [-800, -3, 0, 2.5, 800].map((v) => (v < 0 ? v - Math.log1p(Math.exp(v)) : -Math.log1p(Math.exp(-v))));
    y.toNumbers().forEach((v, i) => assert.ok(Math.abs(v - want[i]!) <= 1e-15 * Math.max(1, Math.abs(want[i]!)), `logSigmoid(${i}): ${v} vs ${want[i]}`));
    y.sum().backward();
    x.grad!.toNumbers().forEach((g, i) => {
      const v = [-800, -3, 0, 2.5, 800][i]!;
      assert.ok(Math.abs(g - 1 / (1 + Math.exp(v))) <= 1e-15, `gradient at ${v}: ${g}`);
    });
  }));
});

test('[dpo] rules before any rank starts: DPO and preference data go together; the adapters reference needs adapters; dropout is turned off', () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-dpo-config-'));
  const counts = new WordCounter();
  counts.add('preference pairs');
  const tok = join(dir, 'tokenizer.json');
  writeFileSync(tok, JSON.stringify(trainBpe(counts.counts, 270).json)); // example data needs a tokenizer with added tokens
  const dpo = ['--train.objective=dpo', '--data.format=preference', `--data.tokenizer=${tok}`];
  assert.deepEqual(validateConfig(parseConfig('', dpo)), []);
  assert.throws(() => parseConfig('', ['--train.objective=dpo', `--data.tokenizer=${tok}`]), /train\.objective = "dpo" trains on preference pairs: set data\.format = "preference"/);
  assert.throws(() => parseConfig('', ['--data.format=preference', `--data.tokenizer=${tok}`]), /data\.format = "preference" holds preference pairs, which train\.objective = "dpo" trains on: set train\.objective = "dpo"/);
  assert.throws(() => parseConfig('', [...dpo, '--dpo.reference=adapters']), /dpo\.reference = "adapters" compares the policy with its LoRA adapters off, and lora\.rank = 0 \(no adapters\): set lora\.rank > 0, or dpo\.reference = "copy"/);
  const lora = parseConfig('', [...dpo, '--lora.rank=2', '--train.initFrom=/b', '--lora.targets=c_attn', '--lora.dropout=0.1', '--model.dropout=0.2']);
  assert.equal(referenceKind(lora), 'adapters');
  assert.equal(referenceKind(parseConfig('', dpo)), 'copy');
  const run = objectiveConfig(lora);
  assert.deepEqual([run.model.dropout, run.lora.dropout], [0, 0]);
  assert.equal(objectiveConfig(parseConfig('', ['--model.dropout=0.2'])).model.dropout, 0.2, 'the lm objective keeps dropout');
  rmSync(dir, { recursive: true });
});

test('precomputed reference values: kept per pair id, read back only under the same key, applied to any batch holding those pairs', () => {
  withFloat64(() => tidy(() => {
    const seqs = pairs(3, 5);
    const m = gpt(6);
    const table = PairTable.empty(3);
    const a = microBatch(seqs, [2, 0]);
    a.seqs!.ref = readSequenceLogps(logitsOf(m, a), a);
    table.record(a);
    const b = microBatch(seqs, [1]);
    assert.throws(() => table.apply(b), /pair 1 has no precomputed reference log-probability/);
    b.seqs!.ref = readSequenceLogps(logitsOf(m, b), b);
    table.record(b);
    const dir = mkdtempSync(join(tmpdir(), 'flotilla-dpo-ref-'));
    const key = { data: 'd', base: 'seed 6', reference: 'copy' };
    writePairTable(dir, key, table);
    assert.equal(readPairTable(dir, { ...key, base: 'seed 7' }, 3), undefined, 'another base');
    assert.equal(readPairTable(dir, key, 4), undefined, 'another dataset size');
    const back = readPairTable(dir, key, 3)!;
    // Another grouping of the same pairs gets the values each pair had.
    const c = microBatch(seqs, [0, 1, 2]);
    back.apply(c);
    const want = readSequenceLogps(logitsOf(m, c), c);
    assert.deepEqual(Array.from(c.seqs!.ref!), Array.from(want));
    rmSync(dir, { recursive: true });
    m.dispose();
  }));
});
