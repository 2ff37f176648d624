// Gradients of every differentiable op the GPT (and its neighbours) uses, against central finite
// differences in float64.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { tensor, tidy, cat, stack, where, setNumThreads, type Tensor } from '../src/tensor/index.js';
import { run } from '../src/tensor/tensor.js';
import { F } from '../src/nn/index.js';
import { gradcheck, uniformArray, assertClose } from './oracle/check.js';

setNumThreads(1);

const u = (n: number, seed: number, lo = -1, hi = 1) => uniformArray(n, seed, lo, hi);
const idx = (values: number[], shape: number[]) => tensor(BigInt64Array.from(values.map(BigInt)), { shape });
const mask = (values: boolean[], shape: number[]) => tensor(values).view(...shape);

test('linear, matmul, mm, bmm (with broadcasting)', () => {
  gradcheck('linear', (x, w, b) => F.linear(x, w, b), [
    { data: u(24, 1), shape: [2, 3, 4] }, { data: u(20, 2), shape: [5, 4] }, { data: u(5, 3), shape: [5] },
  ]);
  gradcheck('linear without bias', (x, w) => F.linear(x, w), [{ data: u(12, 4), shape: [3, 4] }, { data: u(8, 5), shape: [2, 4] }]);
  gradcheck('matmul 2-D', (a, b) => a.matmul(b), [{ data: u(6, 6), shape: [2, 3] }, { data: u(12, 7), shape: [3, 4] }]);
  gradcheck('matmul 4-D (attention scores)', (a, b) => a.matmul(b.transpose(-2, -1)), [
    { data: u(2 * 2 * 3 * 4, 8), shape: [2, 2, 3, 4] }, { data: u(2 * 2 * 3 * 4, 9), shape: [2, 2, 3, 4] },
  ]);
  gradcheck('matmul broadcast (B,T,C)@(C,D)', (a, b) => a.matmul(b), [{ data: u(24, 10), shape: [2, 3, 4] }, { data: u(8, 11), shape: [4, 2] }]);
  gradcheck('mm', (a, b) => a.mm(b), [{ data: u(6, 12), shape: [3, 2] }, { data: u(8, 13), shape: [2, 4] }]);
  gradcheck('bmm', (a, b) => a.bmm(b), [{ data: u(12, 14), shape: [2, 3, 2] }, { data: u(8, 15), shape: [2, 2, 2] }]);
});

test('embedding (repeated indices accumulate)', () => {
  const ids = idx([0, 2, 2, 4, 0, 1], [2, 3]);
  gradcheck('embedding', (w, i) => F.embedding(i, w), [{ data: u(15, 20), shape: [5, 3] }, { data: ids }]);
  ids.dispose();
});

test('layer_norm (with and without affine), rmsNorm', () => {
  gradcheck('layerNorm affine', (x, w, b) => F.layerNorm(x, [4], w, b, 1e-5), [
    { data: u(24, 30), shape: [2, 3, 4] }, { data: u(4, 31, 0.5, 1.5), shape: [4] }, { data: u(4, 32), shape: [4] },
  ]);
  gradcheck('layerNorm plain', (x) => F.layerNorm(x, [3, 4]), [{ data: u(24, 33), shape: [2, 3, 4] }]);
  gradcheck('rmsNorm weighted', (x, w) => F.rmsNorm(x, w, 1e-6), [{ data: u(12, 34), shape: [3, 4] }, { data: u(4, 35), shape: [4] }]);
  gradcheck('rmsNorm plain', (x) => F.rmsNorm(x, undefined), [{ data: u(12, 36), shape: [2, 6] }]);
});

test('gelu (erf and tanh), softmax, log_softmax', () => {
  gradcheck('gelu erf', (x) => x.gelu(), [{ data: u(10, 40, -3, 3) }]);
  gradcheck('gelu tanh', (x) => F.gelu(x, 'tanh'), [{ data: u(10, 41, -3, 3) }]);
  gradcheck('softmax last dim', (x) => x.softmax(-1), [{ data: u(12, 42, -2, 2), shape: [3, 4] }]);
  gradcheck('softmax dim 0', (x) => F.softmax(x, 0), [{ data: u(12, 43, -2, 2), shape: [3, 4] }]);
  gradcheck('logSoftmax', (x) => x.logSoftmax(1), [{ data: u(12, 44, -2, 2), shape: [3, 4] }]);
});

test('masked_fill: masked entries get no gradient; causal -inf mask through softmax', () => {
  const m = mask([false, true, false, false, true, true], [2, 3]);
  gradcheck('maskedFill finite', (x) => x.maskedFill(m, 0.25), [{ data: u(6, 50), shape: [2, 3] }]);
  const causal = tidy(() => tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]).to('bool').logicalNot());
  gradcheck('causal attention probabilities', (x) => x.maskedFill(causal, -Infinity).softmax(-1), [{ data: u(18, 51, -2, 2), shape: [2, 3, 3] }]);
  m.dispose();
  causal.dispose();
});

test('cross_entropy: mean, sum, none, ignoreIndex, label smoothing', () => {
  const t = idx([1, 0, 3, 2], [4]);
  const tIgnore = idx([1, -100, 3, 2], [4]);
  const logits = { data: u(16, 60, -2, 2), shape: [4, 4] };
  gradcheck('crossEntropy mean', (x) => F.crossEntropy(x, t), [logits]);
  gradcheck('crossEntropy sum', (x) => F.crossEntropy(x, t, { reduction: 'sum' }), [logits]);
  gradcheck('crossEntropy none', (x) => F.crossEntropy(x, t, { reduction: 'none' }), [logits]);
  gradcheck('crossEntropy ignoreIndex', (x) => F.crossEntropy(x, tIgnore), [logits]);
  gradcheck('crossEntropy labelSmoothing', (x) => F.crossEntropy(x, t, { labelSmoothing: 0.1 }), [logits]);
  gradcheck('mseLoss', (x, y) => F.mseLoss(x, y), [{ data: u(6, 61) }, { data: u(6, 62) }]);
  // The ignored row really gets nothing.
  tidy(() => {
    const x = tensor(Float64Array.from(logits.data), { shape: [4, 4] }).requiresGrad_();
    F.crossEntropy(x, tIgnore).backward();
    assert.deepEqual(x.grad!.narrow(0, 1, 1).toNumbers(), [0, 0, 0, 0]);
  });
  t.dispose();
  tIgnore.dispose();
});

test('views and copies: view, reshape, transpose, permute, split, chunk, narrow, slice, select, contiguous, flatten, squeeze, expand', () => {
  const x = { data: u(24, 70), shape: [2, 3, 4] };
  gradcheck('view', (a) => a.view(6, 4), [x]);
  gradcheck('reshape of a transpose', (a) => a.transpose(0, 2).reshape(4, 6), [x]);
  gradcheck('transpose + contiguous', (a) => a.transpose(1, 2).contiguous(), [x]);
  gradcheck('permute', (a) => a.permute(2, 0, 1), [x]);
  gradcheck('split (equal)', (a) => a.split(2, 2), [x]);
  gradcheck('split (sizes)', (a) => a.split([1, 3], 2), [x]);
  gradcheck('chunk', (a) => a.chunk(3, 1), [x]);
  gradcheck('narrow', (a) => a.narrow(2, 1, 2), [x]);
  gradcheck('slice with step', (a) => a.slice(2, 0, 4, 2), [x]);
  gradcheck('select', (a) => a.select(1, 2), [x]);
  gradcheck('flatten', (a) => a.flatten(1), [x]);
  gradcheck('squeeze/unsqueeze', (a) => a.unsqueeze(1).squeeze(1), [x]);
  gradcheck('expand', (a) => a.expand(3, 2, 4), [{ data: u(8, 71), shape: [1, 2, 4] }]);
  gradcheck('repeat', (a) => a.repeat(2, 1), [{ data: u(6, 72), shape: [2, 3] }]);
  gradcheck('tril', (a) => a.tril(), [{ data: u(9, 73), shape: [3, 3] }]);
  gradcheck('flip', (a) => a.flip(0), [{ data: u(6, 74), shape: [3, 2] }]);
  // The GPT's head split: qkv -> (B, nh, T, hs) for each of q, k, v.
  gradcheck('qkv split into heads', (a) => {
    const [q, k, v] = a.split(4, 2) as [Tensor, Tensor, Tensor];
    return [q, k, v].map((t) => t.view(2, 3, 2, 2).transpose(1, 2));
  }, [{ data: u(2 * 3 * 12, 75), shape: [2, 3, 12] }]);
});

test('arithmetic with broadcasting and scalars: add, sub, mul, div, pow, addcmul', () => {
  const a = { data: u(6, 80), shape: [2, 3] }, b = { data: u(3, 81, 0.5, 2), shape: [3] };
  gradcheck('add alpha', (x, y) => x.add(y, 0.5), [a, b]);
  gradcheck('sub', (x, y) => x.sub(y), [a, b]);
  gradcheck('mul', (x, y) => x.mul(y), [a, b]);
  gradcheck('div', (x, y) => x.div(y), [a, b]);
  gradcheck('scalar ops', (x) => x.add(2).sub(0.5).mul(3).div(4), [a]);
  gradcheck('pow scalar', (x) => x.pow(3), [a]);
  gradcheck('pow tensor', (x, y) => x.pow(y), [{ data: u(3, 82, 0.5, 2) }, { data: u(3, 83) }]);
  gradcheck('addcmul (broadcast, value)', (x, y, z) => x.addcmul(y, z, 0.5), [a, { data: u(6, 84), shape: [2, 3] }, b]);
});

test('unary functions: tanh, exp, log, sqrt, rsqrt, sigmoid, relu, silu, sin, cos, reciprocal, square, neg, abs', () => {
  const pos = { data: u(8, 90, 0.3, 2) }, any = { data: u(8, 91, -2, 2).map((v) => (Math.abs(v) < 0.1 ? v + 0.3 : v)) };
  for (const [name, fn, inp] of [
    ['tanh', (x: Tensor) => x.tanh(), any], ['exp', (x: Tensor) => x.exp(), any], ['log', (x: Tensor) => x.log(), pos],
    ['sqrt', (x: Tensor) => x.sqrt(), pos], ['rsqrt', (x: Tensor) => x.rsqrt(), pos], ['sigmoid', (x: Tensor) => x.sigmoid(), any],
    ['relu', (x: Tensor) => x.relu(), any], ['silu', (x: Tensor) => x.silu(), any], ['sin', (x: Tensor) => x.sin(), any],
    ['cos', (x: Tensor) => x.cos(), any], ['reciprocal', (x: Tensor) => x.reciprocal(), pos], ['square', (x: Tensor) => x.square(), any],
    ['neg', (x: Tensor) => x.neg(), any], ['abs', (x: Tensor) => x.abs(), any], ['clamp', (x: Tensor) => x.clamp(-1, 1), any],
  ] as const) {
    gradcheck(name, fn, [inp]);
  }
});

test('reductions: sum, mean (dims, keepdim), max over dim, amax, norm, var', () => {
  const x = { data: u(24, 100), shape: [2, 3, 4] };
  gradcheck('sum', (a) => a.sum(), [x]);
  gradcheck('sum dims', (a) => a.sum([0, 2]), [x]);
  gradcheck('mean', (a) => a.mean(), [x]);
  gradcheck('mean keepdim', (a) => a.mean(-1, true), [x]);
  gradcheck('max over dim', (a) => a.max(1)[0], [x]);
  gradcheck('amax', (a) => a.amax(2), [x]);
  gradcheck('norm', (a) => a.norm(), [x]);
  gradcheck('norm dim', (a) => a.norm(2, 1), [x]);
  gradcheck('var', (a) => a.var(-1), [x]);
});

test('combining: cat, stack, where, indexSelect, gather, maximum, minimum', () => {
  const a = { data: u(6, 110), shape: [2, 3] }, b = { data: u(6, 111), shape: [2, 3] };
  gradcheck('cat', (x, y) => cat([x, y], 1), [a, b]);
  gradcheck('stack', (x, y) => stack([x, y], 0), [a, b]);
  const c = mask([true, false, true, false, false, true], [2, 3]);
  gradcheck('where', (x, y) => where(c, x, y), [a, b]);
  const i = idx([2, 0, 2], [3]);
  gradcheck('indexSelect', (x) => x.indexSelect(1, i), [a]);
  const gi = idx([0, 2, 1, 1], [2, 2]);
  gradcheck('gather', (x) => x.gather(1, gi), [a]);
  gradcheck('maximum/minimum', (x, y) => x.maximum(y).add(x.minimum(y).mul(2)), [a, b]);
  for (const t of [c, i, gi]) t.dispose();
});

test('dropout: p = 0 is the identity for the gradient; p > 0 scales kept entries by 1/(1-p)', () => {
  gradcheck('dropout op p=0', (x) => run('dropout', x, 0, true) as Tensor, [{ data: u(6, 120) }]);
  gradcheck('F.dropout p=0', (x) => F.dropout(x, 0, true), [{ data: u(6, 121) }]);
  tidy(() => {
    const x = tensor(Float64Array.from(u(200, 122, 0.5, 1)), { shape: [200] }).requiresGrad_();
    const y = F.dropout(x, 0.25, true);
    y.sum().backward();
    const kept = y.ne(0).to('float64');
    const dropped = 200 - kept.sum().item();
    assert.ok(dropped > 20 && dropped < 80, `about a quarter dropped, got ${dropped}`);
    assertClose(x.grad!, kept.div(0.75), { rtol: 1e-15 }, 'dropout grad');
    assert.equal(F.dropout(x, 0.25, false), x, 'eval mode returns the input itself');
  });
});

test('a causal self-attention block, written out in ops, end to end', () => {
  const B = 2, T = 3, C = 4, nh = 2, hs = 2;
  const causal = tidy(() => tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]).to('bool').logicalNot());
  gradcheck('attention', (x, wq, bq, wp, lw, lb) => {
    const h = F.layerNorm(x, [C], lw, lb);
    const [q, k, v] = F.linear(h, wq, bq).split(C, 2) as [Tensor, Tensor, Tensor];
    const heads = (t: Tensor) => t.view(B, T, nh, hs).transpose(1, 2);
    const att = heads(q).matmul(heads(k).transpose(-2, -1)).mul(1 / Math.sqrt(hs)).maskedFill(causal, -Infinity).softmax(-1);
    const y = att.matmul(heads(v)).transpose(1, 2).contiguous().view(B, T, C);
    return x.add(F.linear(y, wp).gelu());
  }, [
    { data: u(B * T * C, 130), shape: [B, T, C] }, { data: u(3 * C * C, 131), shape: [3 * C, C] }, { data: u(3 * C, 132), shape: [3 * C] },
    { data: u(C * C, 133), shape: [C, C] }, { data: u(C, 134, 0.5, 1.5), shape: [C] }, { data: u(C, 135), shape: [C] },
  ]);
  causal.dispose();
});
