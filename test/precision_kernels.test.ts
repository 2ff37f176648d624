// The kernel facts the bf16-mixed op table rests on (src/nn/precision.ts), checked against the
// linked libtorch: its CPU softmax and GELU take bfloat16 in and out but compute in float32 and
// round once, so running them in bfloat16 loses nothing against float32-then-cast; and the fused
// bfloat16 attention scores (one baddbmm, src/nn/functional.ts) are at least as close to the exact
// scores as autocast's bmm, mul and masked_fill. A libtorch whose kernels round elsewhere fails here.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randn, ones, manualSeed, setNumThreads, tidy, type Tensor } from '../src/tensor/index.js';
import { attentionScores } from '../src/nn/functional.js';

setNumThreads(1);

const bitsEqual = (a: Tensor, b: Tensor) =>
  a.dtype === b.dtype && a.viewAsDtype('int16').eq(b.viewAsDtype('int16')).all().item() === 1;

/** Runs f on a bf16 leaf and returns (output, input gradient) for the upstream gradient g. */
function fwdBwd(x: Tensor, g: Tensor, f: (x: Tensor) => Tensor): [Tensor, Tensor] {
  const leaf = x.detach().requiresGrad_();
  const y = f(leaf);
  y.backward(g);
  return [y.detach(), leaf.grad!.clone()];
}

test('softmax in bfloat16 equals float32 softmax then a cast, forward bit for bit; backward within one rounding', () => tidy(() => {
  manualSeed(7);
  const T = 64;
  const allowed = ones([T, T], { dtype: 'bool' }).tril();
  const scores = randn([4, 4, T, T]).mul(4).to('bfloat16').maskedFill(allowed.logicalNot(), -Infinity);
  const g = randn([4, 4, T, T]).to('bfloat16');
  const [y16, dx16] = fwdBwd(scores, g, (x) => x.softmax(-1));
  const [y32, dx32] = fwdBwd(scores, g, (x) => x.float().softmax(-1).to('bfloat16'));
  assert.equal(y16.dtype, 'bfloat16');
  assert.ok(bitsEqual(y16, y32), 'softmax forward: the bf16 kernel must compute in float32 and round once');
  // The backward rounds one intermediate more than float32-then-cast: at most a few bf16 ulps of the
  // largest gradient element.
  const err = dx16.float().sub(dx32.float()).abs().max().item() / dx32.float().abs().max().item();
  assert.ok(err <= 2 ** -6, `softmax backward: ${err} of the largest element`);
}));

test('GELU in bfloat16 equals float32 GELU then a cast, forward and backward bit for bit', () => tidy(() => {
  manualSeed(8);
  const h = randn([8, 32, 256]).mul(3).to('bfloat16');
  const g = randn([8, 32, 256]).to('bfloat16');
  const [y16, dx16] = fwdBwd(h, g, (x) => x.gelu());
  const [y32, dx32] = fwdBwd(h, g, (x) => x.float().gelu().to('bfloat16'));
  assert.ok(bitsEqual(y16, y32), 'GELU forward');
  assert.ok(bitsEqual(dx16, dx32), 'GELU backward');
}));

test('bfloat16 attention scores: one rounding, no further from exact than bmm, mul and masked_fill', () => tidy(() => {
  manualSeed(9);
  const [B, nh, T, hs] = [2, 4, 32, 16];
  const allowed = ones([T, T], { dtype: 'bool' }).tril();
  const q = randn([B, nh, T, hs]).to('bfloat16'), k = randn([B, nh, T, hs]).to('bfloat16');
  const scale = 1 / Math.sqrt(hs + 3); // not a power of two: the scale rounds
  const fused = attentionScores(q, k, allowed, scale);
  const threeOps = q.matmul(k.transpose(-2, -1)).mul(scale).maskedFill(allowed.logicalNot(), -Infinity);
  const exact = attentionScores(q.double(), k.double(), allowed, scale);
  assert.deepEqual(fused.shape, [B, nh, T, T]);
  assert.equal(fused.dtype, 'bfloat16');
  assert.ok(fused.isfinite().eq(exact.isfinite()).all().item() === 1, 'the mask is -inf exactly where it is not allowed');
  const finite = allowed.expand(B, nh, T, T);
  const errOf = (x: Tensor) => x.double().sub(exact).maskedFill(finite.logicalNot(), 0).abs().div(exact.abs().clamp(1e-3).maskedFill(finite.logicalNot(), 1));
  const eFused = errOf(fused).max().item(), eThree = errOf(threeOps).max().item();
  assert.ok(eFused <= 2 ** -8 * 1.01, `fused scores are one rounding from exact: relative error ${eFused}`);
  assert.ok(eFused <= eThree, `fused ${eFused} vs three ops ${eThree}`);
}));
