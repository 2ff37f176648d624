// The GPT's loss, logits and every parameter gradient against an independent PyTorch implementation
// (test/oracle/gpt.py) on identical float32 weights and batch, with and without tied embeddings.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randint, manualSeed, setNumThreads, tidy, noGrad, type Tensor } from '../src/tensor/index.js';
import { GPT, type GPTConfig } from '../src/models/gpt.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';
import { scaledErr, assertClose } from './oracle/check.js';

setNumThreads(1);
const skip = oracleMissing();
const TOL = 1e-5;

function compare(cfg: Partial<GPTConfig>, B: number, T: number): void {
  manualSeed(1234);
  const model = new GPT({ vocabSize: 37, blockSize: 16, nLayer: 2, nHead: 2, nEmbd: 16, dropout: 0, ...cfg });
  const full = model.cfg;
  // Weights far from GPT-2 init, so activations are O(1) and every nonlinearity is exercised (with
  // 0.02-scale weights GELU is nearly linear and a tanh-GELU would pass unnoticed).
  noGrad(() => {
    for (const [name, p] of model.namedParameters()) {
      if (/ln1|ln2|lnF/.test(name)) p.normal_(name.endsWith('.weight') ? 1 : 0, 0.3);
      else p.normal_(0, name.endsWith('.bias') ? 0.3 : 0.5);
    }
  });
  tidy(() => {
    const idx = randint(0, full.vocabSize, [B, T]);
    const targets = randint(0, full.vocabSize, [B, T]);
    const { logits, loss } = model.forward(idx, targets);
    loss!.backward();
    const params = Object.fromEntries(model.namedParameters());
    if (full.tieEmbeddings) {
      assert.ok(!('head.weight' in params), 'a tied head shares wte.weight (one parameter)');
      assert.equal(model.head.weight, model.wte.weight);
    }
    const ref = runOracle('gpt', { ...params, idx, targets }, full).tensors;
    const rel = Math.abs(loss!.item() - ref.loss!.item()) / Math.abs(ref.loss!.item());
    assert.ok(rel <= TOL, `loss ${loss!.item()} vs PyTorch ${ref.loss!.item()} (relative ${rel})`);
    assert.ok(scaledErr(logits, ref.logits!) <= TOL, `logits differ: ${scaledErr(logits, ref.logits!)}`);
    const names = Object.keys(params);
    assert.deepEqual(Object.keys(ref).filter((k) => k.startsWith('grad.')).map((k) => k.slice(5)).sort(), [...names].sort());
    const worst: string[] = [];
    for (const [name, p] of Object.entries(params)) {
      const g = p.grad;
      assert.ok(g, `${name} has no gradient`);
      const err = scaledErr(g, ref[`grad.${name}`]!);
      if (!(err <= TOL)) worst.push(`${name}: ${err.toExponential(2)}`);
      // Elementwise as well, with an absolute floor at the tensor's scale.
      assertClose(g, ref[`grad.${name}`]!, { rtol: TOL, atol: TOL * Math.max(...ref[`grad.${name}`]!.abs().toNumbers()) }, `grad of ${name}`);
    }
    assert.deepEqual(worst, [], `gradients off by more than ${TOL} relative to their scale`);
    for (const t of Object.values(ref) as Tensor[]) t.dispose();
  });
  model.dispose();
}

test('GPT loss, logits and every parameter gradient match PyTorch (untied)', { skip }, () => {
  compare({ tieEmbeddings: false, bias: true }, 3, 11);
});

test('GPT loss, logits and every parameter gradient match PyTorch (tied embeddings)', { skip }, () => {
  compare({ tieEmbeddings: true, bias: true }, 3, 11);
});

test('GPT without biases, full context, tied, three layers', { skip }, () => {
  compare({ tieEmbeddings: true, bias: false, nLayer: 3, nHead: 4 }, 2, 16);
});
