// The kernel facts the bf16-mixed op table rests on (src/nn/precision.ts), checked against the
// linked libtorch: its CPU softmax takes bfloat16 in and out but computes in float32 and rounds
// once, so running it in bfloat16 loses nothing against float32-then-cast; its bfloat16 GELU stays
// within the roundings of its own steps (libtorch 1.13's AVX2 and default kernels round each step
// to bfloat16, as autocast's GELU does; see the GELU test for the bound); and the fused
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

// [Note: bf16 GELU bound] libtorch 1.13's CPU GELU in bfloat16 (AVX2 and default kernels) rounds
// every step to bfloat16: y = (x/2)*(1 + erf(x*a)) with a = bf16(1/sqrt 2), and the backward
// dx = g*(cdf + x*pdf), cdf = (1 + erf(x*a))/2, pdf = bf16(b)*exp(-(x*x)/2). With u = 2^-9 (bf16's
// unit roundoff), to first order in u:
// - x*a carries 2u relative error, which moves erf by at most 2u * (2/sqrt(pi)) * max t*e^(-t^2)
//   = 0.968u; rounding erf adds u*|erf| <= u, rounding 1 + erf adds u*s <= 2u: |ds| <= 3.968u.
//   Forward: |dy| <= (|x|/2)*3.968u + u*|y| <= 2.984u*|x| (|y| <= |x|): bound 3u*|x|.
// - cdf = s/2 exactly: |dcdf| <= 1.984u. pdf carries u*(3 + x^2/2) relative (x*x, exp's argument,
//   exp, b), x*pdf one u more: |x|*pdf(x)*u*(4 + x^2/2) <= 1.105u at its maximum (x near 1.1).
//   The sum (|c| <= 1.129, GELU's largest slope) rounds once more, and the product with g:
//   |ddx| <= |g|*(1.984 + 1.105 + 1.129)u + u*|g|*1.129 = 5.347u*|g|: bound 5.35u*|g|.
// A kernel that computes in float32 and rounds once is within u*|y| and u*|dx|, inside both bounds.
// The float32 erf/exp underneath are accurate to a float32 ulp (2^-24), far below u: the bounds
// carry 1% for those and the second-order terms. Rounding is relative only above bfloat16's
// subnormals (|x| < 2^-126, where it is absolute); randn inputs stay clear of them. Over every
// bfloat16 x in [-20, 20] with normal magnitude, libtorch 1.13's AVX2 kernels came to 2.48 and 5.03.
test('GELU in bfloat16 is within the roundings of its steps from exact GELU, forward and backward', (t) => tidy(() => {
  manualSeed(8);
  const h = randn([8, 32, 256]).mul(3).to('bfloat16');
  const g = randn([8, 32, 256]).to('bfloat16');
  const [y16, dx16] = fwdBwd(h, g, (x) => x.gelu());
  const [yExact, dxExact] = fwdBwd(h.double(), g.double(), (x) => x.gelu());
  assert.equal(y16.dtype, 'bfloat16');
  const u = 2 ** -9, slack = 1.01;
  const worst = (err: Tensor, scale: Tensor) => err.div(scale.clamp(2 ** -126)).max().item();
  const fwd = worst(y16.double().sub(yExact).abs(), h.double().abs()) / u;
  const bwd = worst(dx16.double().sub(dxExact).abs(), g.double().abs()) / u;
  assert.ok(fwd <= 3 * slack, `GELU forward: ${fwd.toFixed(3)} u * |x| from exact, bound 3`);
  assert.ok(bwd <= 5.35 * slack, `GELU backward: ${bwd.toFixed(3)} u * |g| from exact, bound 5.35`);
  const [y32, dx32] = fwdBwd(h, g, (x) => x.float().gelu().to('bfloat16'));
  t.diagnostic(`bf16 GELU ${bitsEqual(y16, y32) && bitsEqual(dx16, dx32) ? 'is' : 'is not'} bit-identical to float32 then a cast with this libtorch and CPU`);
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
