// bf16-mixed against PyTorch 1.13's torch.autocast('cpu', dtype=torch.bfloat16) on the same weights
// and batch (test/oracle/gpt_autocast.py): the dtype of each op, the loss and every gradient.
//
// Tolerance: bfloat16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3). Both sides round
// some intermediates differently (our attention scores are one baddbmm with the scale and mask, one
// rounding; autocast's are bmm, mul and masked_fill, two), so we ask for agreement at a few bfloat16 ulps: loss within 1e-2 relative, each gradient within 5e-2 of its
// largest element. The float32 reference tells the bf16 error apart from a bug: ours must be no
// further from float32 than twice autocast's own distance from float32 (plus a small floor).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randint, manualSeed, setNumThreads, tidy, noGrad, type Tensor } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { autocast, BF16_MIXED_OPS, type OpClass } from '../src/nn/precision.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';
import { scaledErr } from './oracle/check.js';

setNumThreads(1);
const skip = oracleMissing();

test('bf16-mixed GPT: op dtypes, loss and gradients against PyTorch autocast', { skip }, () => {
  manualSeed(4321);
  const model = new GPT({ vocabSize: 64, blockSize: 16, nLayer: 2, nHead: 2, nEmbd: 32, dropout: 0, bias: true, tieEmbeddings: true });
  noGrad(() => {
    for (const [name, p] of model.namedParameters()) {
      if (/ln1|ln2|lnF/.test(name)) p.normal_(name.endsWith('.weight') ? 1 : 0, 0.2);
      else p.normal_(0, name.endsWith('.bias') ? 0.1 : 0.2);
    }
  });
  tidy(() => {
    const idx = randint(0, 64, [3, 16]);
    const targets = randint(0, 64, [3, 16]);
    const { logits, loss } = autocast('bf16-mixed', () => {
      const out = model.forward(idx, targets);
      out.loss!.backward();
      return out;
    });
    assert.equal(logits.dtype, 'bfloat16', 'the head is a linear: bfloat16 out');
    assert.equal(loss!.dtype, 'float32', 'the loss is float32');
    const params = Object.fromEntries(model.namedParameters());
    for (const p of Object.values(params)) assert.equal(p.dtype, 'float32', 'master parameters stay float32');
    const ref = runOracle('gpt_autocast', { ...params, idx, targets }, model.cfg);
    const seen = JSON.parse(ref.metadata.dtypes!) as Record<OpClass, string>;
    assert.deepEqual(Object.keys(seen).sort(), Object.keys(BF16_MIXED_OPS).filter((op) => op !== 'rmsNorm' && op !== 'router' && op !== 'swiglu').sort(), 'the oracle records every op of the GPT');
    for (const op of Object.keys(seen) as OpClass[]) {
      assert.equal(BF16_MIXED_OPS[op], seen[op], `${op}: our table says ${BF16_MIXED_OPS[op]}, autocast ${seen[op]}`);
    }
    const t = ref.tensors;
    const l = loss!.item(), lr = t.loss!.item(), l32 = t['fp32.loss']!.item();
    assert.ok(Math.abs(l - lr) / Math.abs(lr) <= 1e-2, `loss ${l} vs autocast ${lr}`);
    assert.ok(Math.abs(l - l32) <= 2 * Math.abs(lr - l32) + 2e-3 * Math.abs(l32), `loss ${l} vs float32 ${l32} (autocast ${lr})`);
    assert.ok(scaledErr(logits.float(), t.logits!) <= 5e-2, `logits: ${scaledErr(logits.float(), t.logits!)}`);
    const bad: string[] = [];
    for (const [name, p] of Object.entries(params)) {
      const g = p.grad!;
      assert.equal(g.dtype, 'float32', `${name}: gradients accumulate in float32`);
      const vsAuto = scaledErr(g, t[`grad.${name}`]!);
      const ours32 = scaledErr(g, t[`fp32.grad.${name}`]!);
      const auto32 = scaledErr(t[`grad.${name}`]!, t[`fp32.grad.${name}`]!);
      if (!(vsAuto <= 5e-2) || !(ours32 <= 2 * auto32 + 5e-3)) bad.push(`${name}: vs autocast ${vsAuto.toExponential(2)}, vs fp32 ${ours32.toExponential(2)} (autocast vs fp32 ${auto32.toExponential(2)})`);
    }
    assert.deepEqual(bad, []);
    for (const x of Object.values(t) as Tensor[]) x.dispose();
  });
  model.dispose();
});
