// [Note: gradient API] One public way to read gradients under every parallel mode: a parameter's
// full gradient (a collective when it is sharded), its local shard with offsets, and the global
// norm. Every mode implements GradientSource over the flat buffer of grad_buffer.ts; nobody keeps
// a private gradient store.
import { Tensor, noGrad, tidy, zeros } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import type { ProcessGroup } from '../distributed/process_group.js';

export interface GradShard {
  /** This rank's piece of the flattened gradient. */
  tensor: Tensor;
  /** Where the piece starts in the flattened full gradient. */
  offset: number;
  numel: number;
  fullNumel: number;
}

export interface GradientSource {
  /** The parameter's whole gradient, shaped like it (gathers when sharded). */
  fullGrad(param: Tensor): Tensor;
  /** The part of the parameter's flattened gradient that this rank holds. */
  localGradShard(param: Tensor): GradShard;
  /**
   * Flat local gradient pieces such that summing |g|^p over them, then over every group in
   * sumOver, counts each gradient element of the model exactly once.
   */
  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] };
}

/** Gradients of a plain single-process module (param.grad). */
export class LocalGrads implements GradientSource {
  constructor(private readonly module: Module) {}
  fullGrad(param: Tensor): Tensor {
    const g = param.grad;
    if (!g) throw new Error('parameter has no gradient yet (run backward first)');
    return g;
  }
  localGradShard(param: Tensor): GradShard {
    const g = this.fullGrad(param).flatten();
    return { tensor: g, offset: 0, numel: g.numel(), fullNumel: g.numel() };
  }
  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    const tensors: Tensor[] = [];
    for (const p of this.module.parameters()) {
      const g = p.grad;
      if (g) tensors.push(g);
    }
    return { tensors, sumOver: [] };
  }
}

/**
 * The norm of the whole model's gradient: sum |g|^p over local pieces, all-reduce SUM over every
 * group that splits the gradient, then ^(1/p); p = Infinity uses MAX. Computed in float64. Every
 * rank returns the same value (NaN/Inf included), so decisions taken on it agree everywhere.
 */
export function gradNorm(src: GradientSource, p = 2): number {
  // tidy: pieces a source makes for the call (LocalGrads' .grad handles) are freed; buffer views stay.
  return tidy(() => normOf(src.normPieces(), p));
}

function normOf({ tensors, sumOver }: { tensors: Tensor[]; sumOver: ProcessGroup[] }, p: number): number {
  const inf = p === Infinity;
  const acc = zeros([1], { dtype: 'float64' });
  noGrad(() => {
    for (const t of tensors) {
      if (t.numel() === 0) continue;
      const n = t.norm(p).to('float64');
      if (inf) acc.copy_(acc.maximum(n.reshape(1)));
      else acc.add_(n.pow(p).reshape(1));
    }
  });
  for (const g of sumOver) g.allReduce(acc, inf ? 'max' : 'sum').wait();
  const total = acc.item();
  return inf ? total : total ** (1 / p);
}

export interface ClipResult {
  /** The global norm before clipping. */
  norm: number;
  /** The factor gradients were multiplied by (1 when within maxNorm). */
  scale: number;
}

/**
 * Scales every gradient so the global norm is at most maxNorm (torch.nn.utils.clip_grad_norm_
 * semantics: coef = maxNorm / (norm + 1e-6), capped at 1). With errorIfNonfinite, a NaN/Inf norm
 * throws on every rank (they all computed the same norm).
 */
export function clipGradNorm(src: GradientSource, maxNorm: number, opts: { p?: number; errorIfNonfinite?: boolean } = {}): ClipResult {
  if (!(maxNorm > 0)) throw new Error(`clipGradNorm: maxNorm must be > 0, got ${maxNorm}`);
  return tidy(() => {
    const pieces = src.normPieces();
    const norm = normOf(pieces, opts.p ?? 2);
    if (!Number.isFinite(norm)) {
      if (opts.errorIfNonfinite) throw new Error(`clipGradNorm: the total gradient norm is ${norm}; gradients hold NaN or Inf`);
      return { norm, scale: 1 };
    }
    const coef = maxNorm / (norm + 1e-6);
    if (coef >= 1) return { norm, scale: 1 };
    noGrad(() => {
      for (const t of pieces.tensors) t.mul_(coef);
    });
    return { norm, scale: coef };
  });
}
