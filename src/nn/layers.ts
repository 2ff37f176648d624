// Basic layers. Initialisation follows PyTorch's defaults unless a model re-initialises (gpt.ts does).
import { Tensor, empty, ones, zeros, noGrad, defineFunction, type DType } from '../tensor/index.js';
import { Module } from './module.js';
import * as F from './functional.js';
import { castFor, castParam, readsParametersThroughPolicy, widenedDtype } from './precision.js';
import { kernelChoice } from './kernels/choice.js';
import { fusedLayerNorm, fusedRmsNorm } from './kernels/pointwise.js';

export class Linear extends Module {
  readonly weight: Tensor; // (out, in)
  readonly bias?: Tensor;
  /** opts.weight shares an existing (out, in) parameter instead of creating one (tied embeddings). */
  constructor(readonly inFeatures: number, readonly outFeatures: number, opts: { bias?: boolean; weight?: Tensor } = {}) {
    super();
    const bound = 1 / Math.sqrt(inFeatures);
    if (opts.weight && opts.weight.shape.join('x') !== `${outFeatures}x${inFeatures}`) {
      throw new Error(`Linear: shared weight has shape [${opts.weight.shape}], expected [${outFeatures}, ${inFeatures}]`);
    }
    this.weight = this.registerParameter('weight', opts.weight ?? noGrad(() => empty([outFeatures, inFeatures]).uniform_(-bound, bound)));
    if (opts.bias ?? true) this.bias = this.registerParameter('bias', noGrad(() => empty([outFeatures]).uniform_(-bound, bound)));
  }
  forward(x: Tensor): Tensor {
    // The precision policy picks the dtype (src/nn/precision.ts); under fp32 these are no-ops.
    const [xc] = castFor('linear', x) as [Tensor];
    const wide = widenedDtype(this.weight);
    if (wide !== undefined && !this.weight.requiresGrad && !this.bias?.requiresGrad) return frozenLinear(xc, this.weight, this.bias, wide);
    const w = castParam('linear', this.weight), b = castParam('linear', this.bias);
    return F.linear(xc, w, b);
  }
}

// A frozen bfloat16 weight computed in float32 ([Note: bf16 base] in precision.ts): widened for the
// forward's GEMM and again for the input gradient's, so what the graph keeps between forward and
// backward is the bfloat16 weight itself (under ZeRO-3 the alias of its gathered unit, freed after
// forward and gathered again for backward), not a float32 copy of every frozen weight.
const frozenLinear = defineFunction<[Tensor, Tensor, Tensor | undefined, DType]>({
  forward(ctx, x, w, b, dtype) {
    ctx.saveForBackward(w);
    ctx.state.dtype = dtype;
    const wide = w.to(dtype), bias = b?.to(dtype);
    try {
      return F.linear(x, wide, bias);
    } finally {
      wide.dispose();
      bias?.dispose();
    }
  },
  backward(ctx, g) {
    const [w] = ctx.savedTensors as [Tensor];
    const wide = w.to(ctx.state.dtype as DType);
    return [g.matmul(wide), undefined, undefined, undefined];
  },
}, 'FrozenLinear');

export class Embedding extends Module {
  readonly weight: Tensor; // (num, dim)
  constructor(readonly numEmbeddings: number, readonly embeddingDim: number) {
    super();
    this.weight = this.registerParameter('weight', noGrad(() => empty([numEmbeddings, embeddingDim]).normal_(0, 1)));
  }
  forward(indices: Tensor): Tensor {
    return F.embedding(indices, castParam('embedding', this.weight));
  }
}

export class LayerNorm extends Module {
  readonly weight: Tensor;
  readonly bias?: Tensor;
  constructor(readonly dim: number, opts: { eps?: number; bias?: boolean } = {}) {
    super();
    this.eps = opts.eps ?? 1e-5;
    this.weight = this.registerParameter('weight', ones([dim]));
    if (opts.bias ?? true) this.bias = this.registerParameter('bias', zeros([dim]));
  }
  readonly eps: number;
  forward(x: Tensor): Tensor {
    const [xc] = castFor('layerNorm', x) as [Tensor];
    // The one-pass kernel under kernels = "fused" ([Note: kernel choice]), in the policy's dtype as the eager op.
    if (kernelChoice() === 'fused') return fusedLayerNorm(xc, castParam('layerNorm', this.weight)!, castParam('layerNorm', this.bias), this.eps);
    return F.layerNorm(xc, [this.dim], castParam('layerNorm', this.weight), castParam('layerNorm', this.bias), this.eps);
  }
}

export class RMSNorm extends Module {
  readonly weight: Tensor;
  constructor(readonly dim: number, readonly eps = 1e-6) {
    super();
    this.weight = this.registerParameter('weight', ones([dim]));
  }
  forward(x: Tensor): Tensor {
    const [xc] = castFor('rmsNorm', x) as [Tensor];
    if (kernelChoice() === 'fused') return fusedRmsNorm(xc, castParam('rmsNorm', this.weight)!, this.eps);
    return F.rmsNorm(xc, castParam('rmsNorm', this.weight), this.eps);
  }
}

// Each reads its parameters only through castParam (ZeRO-3 may hold them as bfloat16 copies, [Note: bf16-mixed]).
for (const cls of [Linear, Embedding, LayerNorm, RMSNorm]) readsParametersThroughPolicy(cls);

export class Dropout extends Module {
  constructor(readonly p: number) {
    super();
    if (p < 0 || p >= 1) throw new Error(`Dropout: p must be in [0, 1), got ${p}`);
  }
  forward(x: Tensor): Tensor {
    return F.dropout(x, this.p, this.training);
  }
}

/** An ordered list of modules registered under "0", "1", ... */
export class ModuleList<M extends Module = Module> extends Module {
  readonly items: M[];
  constructor(items: M[]) {
    super();
    this.items = items;
    items.forEach((m, i) => this.registerModule(String(i), m));
  }
}
