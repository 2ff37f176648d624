// The chunked cross-entropy from the hidden state ([Note: chunked linear cross-entropy] in
// src/nn/kernels/linear_cross_entropy.ts) against the op-by-op path (head matmul, then the ATen
// cross-entropy with reduction 'sum'), in float64: loss and the gradients of hidden, weight and
// bias, with ignored targets, label smoothing, a tied head (the weight also read as an embedding)
// and N not a multiple of the chunk; and under bf16-mixed against the eager path's float32 loss.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { tensor, randn, tidy, manualSeed, type Tensor } from '../src/tensor/index.js';
import { F } from '../src/nn/index.js';
import { autocast, castFor } from '../src/nn/precision.js';
import { linearCrossEntropy, tileShape } from '../src/nn/kernels/linear_cross_entropy.js';
import { assertClose, withFloat64 } from './oracle/check.js';

const N = 23, d = 8, V = 37, IGNORE = -100;

function targetsOf(n: number, v: number): Tensor {
  // every 4th target ignored, the rest spread over the vocabulary (the first and last ids included)
  return tensor(Array.from({ length: n }, (_, i) => (i % 4 === 3 ? IGNORE : (i * 7) % v)), { dtype: 'int64' });
}

interface Grads { loss: number; h: number[]; w: number[]; b?: number[] }

function run(fused: boolean, o: { smoothing: number; bias: boolean; tied: boolean; chunk?: number; vocabChunk?: number }): Grads {
  return tidy(() => {
    const h = randn([N, d]).requiresGrad_();
    const w = randn([V, d]).mul(0.5).detach().requiresGrad_();
    const b = o.bias ? randn([V]).detach().requiresGrad_() : undefined;
    const t = targetsOf(N, V);
    let loss: Tensor;
    if (fused) {
      const r = linearCrossEntropy(h, w, t, { bias: b, labelSmoothing: o.smoothing, chunk: o.chunk, vocabChunk: o.vocabChunk });
      assert.equal(r.count, N - Math.floor(N / 4));
      loss = r.loss;
    } else {
      loss = F.crossEntropy(F.linear(h, w, b), t, { reduction: 'sum', labelSmoothing: o.smoothing });
    }
    // tied: the same weight also feeds an embedding lookup, so its gradient has two contributions
    if (o.tied) loss = loss.add(F.embedding(tensor([1, 5, 5, 36], { dtype: 'int64' }), w).square().sum());
    loss.backward();
    return { loss: loss.item(), h: h.grad!.toNumbers(), w: w.grad!.toNumbers(), ...(b ? { b: b.grad!.toNumbers() } : {}) };
  });
}

test('chunked linear cross-entropy equals the op-by-op loss and gradients (float64)', () => {
  withFloat64(() => {
    const cases = [
      { smoothing: 0, bias: false, tied: false, chunk: 5, vocabChunk: 37 }, // 23 rows: four chunks of 5 and one of 3
      { smoothing: 0.1, bias: true, tied: false, chunk: 4, vocabChunk: 10 }, // and 37 columns: three of 10 and one of 7
      { smoothing: 0.2, bias: false, tied: true, chunk: 7, vocabChunk: 6 },
      { smoothing: 0, bias: true, tied: true }, // the default chunk (all rows at this size)
    ];
    for (const c of cases) {
      manualSeed(11);
      const want = run(false, c);
      manualSeed(11);
      const got = run(true, c);
      const what = JSON.stringify(c);
      assertClose([got.loss], [want.loss], { rtol: 1e-12 }, `${what} loss`);
      assertClose(got.h, want.h, { rtol: 1e-10, atol: 1e-13 }, `${what} dHidden`);
      assertClose(got.w, want.w, { rtol: 1e-10, atol: 1e-13 }, `${what} dWeight`);
      if (want.b) assertClose(got.b!, want.b, { rtol: 1e-10, atol: 1e-13 }, `${what} dBias`);
    }
  });
});

test('tiles keep float32 logits within 4 MiB, square where the shape allows', () => {
  assert.deepEqual(tileShape(8192, 32000), { rows: 1024, cols: 1024 });
  assert.deepEqual(tileShape(100, 32000), { rows: 100, cols: 10485 });
  assert.deepEqual(tileShape(8192, 50), { rows: 8192, cols: 50 });
  assert.deepEqual(tileShape(8192, 500), { rows: 2097, cols: 500 });
  assert.deepEqual(tileShape(10, 50), { rows: 10, cols: 50 });
});

test('under bf16-mixed the chunked loss computes its logits in float32 as the eager loss does', () => {
  manualSeed(3);
  tidy(() => {
    const h = randn([N, d]).requiresGrad_();
    const w = randn([V, d]).mul(0.5).detach().requiresGrad_();
    const t = targetsOf(N, V);
    const grads = (fused: boolean) => autocast('bf16-mixed', () => {
      const [hc, wc] = castFor('linear', h, w) as [Tensor, Tensor];
      const l = fused
        ? linearCrossEntropy(hc, wc, t, { chunk: 6, vocabChunk: 9 }).loss
        : F.crossEntropy((castFor('loss', F.linear(hc, wc)) as [Tensor])[0], t, { reduction: 'sum' });
      assert.equal(l.dtype, 'float32');
      l.backward();
      const r = { loss: l.item(), h: h.grad!.toNumbers(), w: w.grad!.toNumbers() };
      h.grad!.zero_();
      w.grad!.zero_();
      return r;
    });
    const eager = grads(false), fused = grads(true);
    // the same bf16 logits, float32 math: equal up to float32 summation order and one bf16 rounding of dz
    assertClose([fused.loss], [eager.loss], { rtol: 1e-5 }, 'bf16 loss');
    assertClose(fused.h, eager.h, { rtol: 2e-2, atol: 2e-2 }, 'bf16 dHidden');
    assertClose(fused.w, eager.w, { rtol: 2e-2, atol: 2e-2 }, 'bf16 dWeight');
  });
});
