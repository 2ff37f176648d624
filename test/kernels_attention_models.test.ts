// [train] kernels = "fused" in the models ([Note: kernel choice]): a tiny GPT and a tiny Llama
// (grouped-query heads, a sliding window) give the same loss and parameter gradients in float64
// with the fused kernel as with the eager ops, on single sequences and on packed documents.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { getDefaultDtype, grad, manualSeed, randint, setDefaultDtype, tidy, type Tensor } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { Llama } from '../src/models/llama.js';
import { documentLayout, withDocuments } from '../src/nn/documents.js';
import { withKernels, kernelChoice } from '../src/nn/kernels/choice.js';
import { assertClose } from './oracle/check.js';
import { parseConfig } from '../src/config/index.js';

const B = 2, T = 24;
// Row 0: documents of 9 and 15 tokens; row 1: 5, 12 and 7.
const lengths = [[9, 15], [5, 12, 7]];
function layout() {
  const positions = new Int32Array(B * T), ids = new Int32Array(B * T);
  lengths.forEach((row, b) => {
    let t = 0;
    row.forEach((n, d) => {
      for (let p = 0; p < n; p++, t++) positions[b * T + t] = p, ids[b * T + t] = d;
    });
  });
  return documentLayout(positions, ids, B, T);
}

function lossAndGrads(model: GPT | Llama, idx: Tensor, targets: Tensor, packed: boolean): Tensor[] {
  const docs = packed ? layout() : undefined;
  try {
    const loss = withDocuments(docs, () => model.forward(idx, targets).loss!);
    return [loss, ...grad([loss], model.parameters()).map((g) => g!)];
  } finally {
    docs?.dispose();
  }
}

for (const [name, make] of [
  ['GPT', () => new GPT({ vocabSize: 40, blockSize: T, nLayer: 2, nHead: 2, nEmbd: 16 }, { initSeed: 3 })],
  ['Llama (grouped-query heads, sliding window)', () => new Llama({ vocabSize: 40, blockSize: T, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 48, slidingWindow: 6, ropeScaling: 'none' }, { initSeed: 3 })],
] as const) {
  test(`kernels = "fused": the ${name} matches its eager attention in float64 (loss and gradients, single and packed rows)`, () => {
    const prev = getDefaultDtype();
    setDefaultDtype('float64');
    try {
      tidy(() => {
        const model = make();
        manualSeed(1);
        const idx = randint(0, 40, [B, T]), targets = randint(0, 40, [B, T]);
        for (const packed of [false, true]) {
          const eager = lossAndGrads(model, idx, targets, packed);
          const fused = withKernels('fused', () => {
            assert.equal(kernelChoice(), 'fused');
            return lossAndGrads(model, idx, targets, packed);
          });
          assert.equal(kernelChoice(), 'eager');
          assert.equal(fused.length, eager.length);
          fused.forEach((f, i) => assertClose(f, eager[i]!, { rtol: 1e-9, atol: 1e-12 }, `${packed ? 'packed ' : ''}${i === 0 ? 'loss' : `gradient ${i}`}`));
          // Another path ran: its sums in another order leave float64 rounding differences somewhere.
          assert.ok(fused.some((f, i) => f.sub(eager[i]!).abs().max().item() !== 0), 'the fused kernel computed the attention');
        }
        model.dispose();
      });
    } finally {
      setDefaultDtype(prev);
    }
  });
}

test('[train] kernels: "fused" by default, "eager" when asked, anything else refused naming both; outside the trainer eager', () => {
  assert.equal(parseConfig('').train.kernels, 'fused');
  assert.equal(parseConfig('[train]\nkernels = "eager"\n').train.kernels, 'eager');
  assert.equal(kernelChoice(), 'eager');
  assert.throws(() => parseConfig('', ['--train.kernels=flash']), /eager.*fused/);
});
