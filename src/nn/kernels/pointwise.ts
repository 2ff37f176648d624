// One-pass RMSNorm, LayerNorm, SwiGLU, GELU and rotary ([Note: pointwise kernels] in
// native/pointwise.cc) with autograd through function nodes. What each saves for backward: the
// norms their input and the per-row rstd (and mean), SwiGLU its two inputs, GELU its input, rotary
// nothing but the tables (its backward is the rotation by -theta).
import { defineFunction, Tensor, type FunctionCtx } from '../../tensor/index.js';
import { native } from '../../tensor/native.js';

const norm = defineFunction<[Tensor, Tensor, Tensor | undefined, number, boolean]>({
  forward(ctx: FunctionCtx, x, w, b, eps, layer) {
    const [y, rstd, mean] = native.normForward(x.handle, w.handle, b?.handle, eps, layer).map((h) => new Tensor(h)) as [Tensor, Tensor, Tensor?];
    ctx.saveForBackward(x, w, rstd, ...(mean ? [mean] : []));
    ctx.state.withBias = b !== undefined;
    rstd.dispose();
    mean?.dispose();
    return y;
  },
  backward(ctx, g) {
    const [x, w, rstd, mean] = ctx.savedTensors as [Tensor, Tensor, Tensor, Tensor?];
    const [dx, dw, db] = native.normBackward(g!.handle, x.handle, w.handle, ctx.state.withBias as boolean, rstd.handle, mean?.handle).map((h) => new Tensor(h));
    return [dx, dw, db, undefined, undefined];
  },
}, 'FusedNorm');

/** x / sqrt(mean(x^2) + eps) * weight over the last dim, as F.rmsNorm. */
export function fusedRmsNorm(x: Tensor, weight: Tensor, eps: number): Tensor {
  return norm(x, weight, undefined, eps, false) as Tensor;
}

/** (x - mean) / sqrt(var + eps) * weight (+ bias) over the last dim, as F.layerNorm. */
export function fusedLayerNorm(x: Tensor, weight: Tensor, bias: Tensor | undefined, eps: number): Tensor {
  return norm(x, weight, bias, eps, true) as Tensor;
}

const swiglu = defineFunction<[Tensor, Tensor]>({
  forward(ctx, gate, up) {
    ctx.saveForBackward(gate, up);
    return new Tensor(native.swigluForward(gate.handle, up.handle));
  },
  backward(ctx, g) {
    const [gate, up] = ctx.savedTensors as [Tensor, Tensor];
    return native.swigluBackward(g!.handle, gate.handle, up.handle).map((h) => new Tensor(h));
  },
}, 'FusedSwiGLU');

/** silu(gate) * up (one shape), in their promoted dtype. Elementwise, so a column shard of each works alone. */
export function fusedSwiglu(gate: Tensor, up: Tensor): Tensor {
  return swiglu(gate, up) as Tensor;
}

const gelu = defineFunction<[Tensor, boolean]>({
  forward(ctx, x, tanh) {
    ctx.saveForBackward(x);
    ctx.state.tanh = tanh;
    return new Tensor(native.geluForward(x.handle, tanh));
  },
  backward(ctx, g) {
    const [x] = ctx.savedTensors as [Tensor];
    return [new Tensor(native.geluBackward(g!.handle, x.handle, ctx.state.tanh as boolean)), undefined];
  },
}, 'FusedGELU');

/** x.gelu(approximate). */
export function fusedGelu(x: Tensor, approximate: 'none' | 'tanh'): Tensor {
  return gelu(x, approximate === 'tanh') as Tensor;
}

const rotary = defineFunction<[Tensor, Tensor, Tensor]>({
  forward(ctx, x, cos, sinSigned) {
    ctx.saveForBackward(cos, sinSigned);
    return new Tensor(native.rotary(x.handle, cos.handle, sinSigned.handle, false));
  },
  backward(ctx, g) {
    const [cos, sinSigned] = ctx.savedTensors as [Tensor, Tensor];
    return [new Tensor(native.rotary(g!.handle, cos.handle, sinSigned.handle, true)), undefined, undefined];
  },
}, 'FusedRotary');

/**
 * x (B, T, nh, hd) rotated by its positions as applyRotary (src/models/llama.ts) computes it:
 * x * cos + swapHalves(x) * sinSigned, tables (T, hd), (1, T, hd) or (B, T, hd), not differentiated.
 */
export function fusedRotary(x: Tensor, cos: Tensor, sinSigned: Tensor): Tensor {
  return rotary(x, cos, sinSigned) as Tensor;
}
