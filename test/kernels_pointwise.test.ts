// The one-pass pointwise kernels (src/nn/kernels/pointwise.ts, native/pointwise.cc) against the
// op-by-op path they replace: RMSNorm (F.rmsNorm), LayerNorm with and without bias (F.layerNorm),
// SwiGLU (silu(gate) * up), GELU exact and tanh, rotary (applyRotary, per-position and per-row
// tables). Forward and every input's gradient in float64 on odd widths (not a multiple of the
// vector or block lengths), float32 close to float64, bfloat16 within its rounding.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { arange, grad, manualSeed, ones, randn, tidy, type DType, type Tensor } from '../src/tensor/index.js';
import * as F from '../src/nn/functional.js';
import { applyRotary } from '../src/models/llama.js';
import { fusedGelu, fusedLayerNorm, fusedRmsNorm, fusedRotary, fusedSwiglu } from '../src/nn/kernels/pointwise.js';
import { assertClose } from './oracle/check.js';

interface Case {
  name: string;
  /** Inputs as float64 tensors; which of them are differentiated. */
  inputs: () => Tensor[];
  grads: boolean[];
  eager: (...xs: Tensor[]) => Tensor;
  fused: (...xs: Tensor[]) => Tensor;
}

const rotaryTables = (shape: number[]) => [randn(shape, { dtype: 'float64' }), randn(shape, { dtype: 'float64' })];
const cases: Case[] = [
  {
    name: 'RMSNorm', grads: [true, true],
    inputs: () => [randn([3, 5, 37], { dtype: 'float64' }).mul(2).add(0.5), randn([37], { dtype: 'float64' })],
    eager: (x, w) => F.rmsNorm(x, w, 1e-5), fused: (x, w) => fusedRmsNorm(x, w, 1e-5),
  },
  {
    name: 'LayerNorm with bias', grads: [true, true, true],
    inputs: () => [randn([4, 3, 37], { dtype: 'float64' }).mul(2).add(0.5), randn([37], { dtype: 'float64' }), randn([37], { dtype: 'float64' })],
    eager: (x, w, b) => F.layerNorm(x, [37], w, b, 1e-5), fused: (x, w, b) => fusedLayerNorm(x, w, b, 1e-5),
  },
  {
    name: 'LayerNorm without bias', grads: [true, true],
    inputs: () => [randn([7, 19], { dtype: 'float64' }), randn([19], { dtype: 'float64' })],
    eager: (x, w) => F.layerNorm(x, [19], w, undefined, 1e-5), fused: (x, w) => fusedLayerNorm(x, w, undefined, 1e-5),
  },
  {
    // 1113 values: two full blocks of 512 and a tail that is not a multiple of 8.
    name: 'SwiGLU', grads: [true, true],
    inputs: () => [randn([3, 7, 53], { dtype: 'float64' }).mul(4), randn([3, 7, 53], { dtype: 'float64' })],
    eager: (g, u) => g.silu().mul(u), fused: (g, u) => fusedSwiglu(g, u),
  },
  {
    name: 'GELU (exact)', grads: [true],
    inputs: () => [randn([5, 231], { dtype: 'float64' }).mul(3)],
    eager: (x) => x.gelu('none'), fused: (x) => fusedGelu(x, 'none'),
  },
  {
    name: 'GELU (tanh)', grads: [true],
    inputs: () => [randn([5, 231], { dtype: 'float64' }).mul(3)],
    eager: (x) => x.gelu('tanh'), fused: (x) => fusedGelu(x, 'tanh'),
  },
  {
    name: 'rotary, (T, hd) tables', grads: [true, false, false],
    inputs: () => [randn([2, 5, 3, 10], { dtype: 'float64' }), ...rotaryTables([5, 10])],
    eager: applyRotary, fused: fusedRotary,
  },
  {
    name: 'rotary, (1, T, hd) tables', grads: [true, false, false],
    inputs: () => [randn([2, 5, 3, 10], { dtype: 'float64' }), ...rotaryTables([1, 5, 10])],
    eager: applyRotary, fused: fusedRotary,
  },
  {
    name: 'rotary, (B, T, hd) tables (packed rows)', grads: [true, false, false],
    inputs: () => [randn([2, 5, 3, 10], { dtype: 'float64' }), ...rotaryTables([2, 5, 10])],
    eager: applyRotary, fused: fusedRotary,
  },
];

/** The output, then the gradient of sum(out * g) for each differentiated input. */
function outAndGrads(c: Case, fn: (...xs: Tensor[]) => Tensor, xs: Tensor[], g: Tensor): Tensor[] {
  const ins = xs.map((x, i) => (c.grads[i] ? x.detach().requiresGrad_() : x));
  const y = fn(...ins);
  const gs = grad([y.mul(g.to(y.dtype)).sum()], ins.filter((_, i) => c.grads[i]));
  return [y, ...gs.map((t) => t!)];
}

for (const c of cases) {
  test(`fused ${c.name}: output and gradients equal the op-by-op path in float64, float32 close, bfloat16 within its rounding`, () => {
    tidy(() => {
      manualSeed(11);
      const xs = c.inputs();
      const g = randn(c.eager(...xs).shape, { dtype: 'float64' });
      const eager = outAndGrads(c, c.eager, xs, g);
      const fused = outAndGrads(c, c.fused, xs, g);
      assert.equal(fused.length, 1 + c.grads.filter(Boolean).length);
      fused.forEach((f, i) => {
        assert.equal(f.dtype, 'float64');
        assertClose(f, eager[i]!, { rtol: 1e-12, atol: 1e-12 }, `float64 ${i === 0 ? 'output' : `gradient ${i}`}`);
      });
      // Lower precisions against float64 on the same rounded inputs: float32 to its own rounding,
      // bfloat16 (computed in float32, rounded once per output) to a few of its ulps.
      for (const [dtype, tol] of [['float32', 2e-5], ['bfloat16', 3e-2]] as [DType, number][]) {
        const low = xs.map((x, i) => (c.name.startsWith('rotary') && i > 0 ? x.to('float32') : x.to(dtype)));
        const ref = outAndGrads(c, c.eager, low.map((x) => x.to('float64')), g);
        const got = outAndGrads(c, c.fused, low, g.to(dtype));
        got.forEach((f, i) => {
          const scale = ref[i]!.abs().max().item();
          assertClose(f.to('float64'), ref[i]!, { rtol: tol, atol: tol * scale }, `${dtype} ${i === 0 ? 'output' : `gradient ${i}`}`);
        });
      }
    });
  });
}

// float32's exact GELU is its own approximation of erf (native/pointwise_kernel.h, GeluErf*), not
// std::erf: over a fine grid of [-12, 12] (the Gaussian tails included) it stays within 1e-6 of
// libtorch's float32 GELU, forward and derivative, and for |x| <= 3 within 7e-7 relative of float64
// (libtorch's own float32 GELU is off by up to 6e-5 relative there, in the negative tail).
test('fused exact GELU in float32: within 1e-6 of libtorch over [-12, 12], forward and derivative; within 7e-7 relative of float64 on [-3, 3]', () => {
  tidy(() => {
    const outAndDerivative = (x: Tensor, fn: (x: Tensor) => Tensor): [Tensor, Tensor] => {
      const xi = x.detach().requiresGrad_(), y = fn(xi);
      return [y, grad([y], [xi], { gradOutputs: [ones(y.shape, { dtype: y.dtype })] })[0]!];
    };
    const fused = (x: Tensor) => fusedGelu(x, 'none'), eager = (x: Tensor) => x.gelu('none');
    const wide = arange(-12, 12, 1 / 4096, { dtype: 'float32' });
    const [fy, fd] = outAndDerivative(wide, fused), [ey, ed] = outAndDerivative(wide, eager);
    assertClose(fy.to('float64'), ey.to('float64'), { rtol: 1e-6, atol: 1e-6 }, 'float32 output against libtorch');
    assertClose(fd.to('float64'), ed.to('float64'), { rtol: 1e-6, atol: 1e-6 }, 'float32 derivative against libtorch');
    const mid = arange(-3, 3, 1 / 4096, { dtype: 'float32' });
    const [my, md] = outAndDerivative(mid, fused), [ry, rd] = outAndDerivative(mid.to('float64'), eager);
    assertClose(my.to('float64'), ry, { rtol: 7e-7 }, 'float32 output against float64');
    assertClose(md.to('float64'), rd, { rtol: 7e-7, atol: 3e-7 }, 'float32 derivative against float64');
  });
});
