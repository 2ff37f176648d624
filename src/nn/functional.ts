// Stateless neural-network functions over the op table.
import { Tensor, run } from '../tensor/tensor.js';
import { zerosLike } from '../tensor/creation.js';

export function linear(x: Tensor, weight: Tensor, bias?: Tensor): Tensor {
  return run('linear', x, weight, bias);
}

/** Rows of weight picked by integer indices. */
export function embedding(indices: Tensor, weight: Tensor): Tensor {
  return run('embedding', weight, indices);
}

export function layerNorm(x: Tensor, normalizedShape: number[], weight?: Tensor, bias?: Tensor, eps = 1e-5): Tensor {
  return run('layerNorm', x, normalizedShape, weight, bias, eps);
}

/** x / sqrt(mean(x^2) + eps) * weight over the last dim. */
export function rmsNorm(x: Tensor, weight: Tensor | undefined, eps = 1e-6): Tensor {
  // The mean square from the 2-norm: one reduction pass over x (and one in backward) where
  // square-then-mean writes and reads a whole squared copy; about 30% of the norm's time.
  const ms = x.norm(2, -1, true).square().div(x.shape[x.ndim - 1]!);
  const n = x.mul(ms.add(eps).rsqrt());
  return weight ? n.mul(weight) : n;
}

export function dropout(x: Tensor, p: number, training: boolean): Tensor {
  if (!training || p === 0) return x;
  return run('dropout', x, p, training);
}

export type Reduction = 'none' | 'mean' | 'sum';
const REDUCTION: Record<Reduction, number> = { none: 0, mean: 1, sum: 2 };

export interface CrossEntropyOptions { reduction?: Reduction; ignoreIndex?: number; labelSmoothing?: number }
export type CrossEntropyFn = (logits: Tensor, targets: Tensor, opts: CrossEntropyOptions) => Tensor;
let crossEntropyImpl: CrossEntropyFn | undefined;

/** Cross entropy of logits (N, C) against class indices (N); ignoreIndex targets are skipped. */
export function crossEntropy(logits: Tensor, targets: Tensor, opts: CrossEntropyOptions = {}): Tensor {
  if (crossEntropyImpl) return crossEntropyImpl(logits, targets, opts);
  return run('crossEntropy', logits, targets, undefined, REDUCTION[opts.reduction ?? 'mean'], opts.ignoreIndex ?? -100, opts.labelSmoothing ?? 0);
}

/**
 * Runs fn with crossEntropy computed by impl: how a criterion written for whole logits runs on
 * logits sharded over the vocabulary (tensor parallelism's loss parallel, torchtitan's
 * loss_parallel() context) without being rewritten.
 */
export function withCrossEntropy<T>(impl: CrossEntropyFn, fn: () => T): T {
  const prev = crossEntropyImpl;
  crossEntropyImpl = impl;
  try {
    return fn();
  } finally {
    crossEntropyImpl = prev;
  }
}

export function mseLoss(x: Tensor, target: Tensor, reduction: Reduction = 'mean'): Tensor {
  return run('mseLoss', x, target, REDUCTION[reduction]);
}

/**
 * Attention scores q k^T * scale, -inf where `allowed` is false: (B, nh, T, hs) x 2 -> (B, nh, T, T).
 * `allowed` is (T, T) (a causal mask, or any other) or per row, (B, 1, T, T) (packed documents).
 * In float32 these are three ops (product, scale, mask) as PyTorch's reference GPT writes them, so
 * float32 runs stay bit-identical to it. In bfloat16 they are one baddbmm: the scale is the GEMM's
 * alpha, applied to the float32 accumulator before the one rounding to bfloat16, and the mask is an
 * additive 0 / -inf bias. That is two fewer passes over the (T, T) scores forward and backward than
 * autocast's bmm, mul and masked_fill, and one rounding fewer. `bias`, (B nh, T, T) in bfloat16,
 * is that bias made already (a per-row mask's is kept for every layer, DocumentLayout.bias).
 */
export function attentionScores(q: Tensor, k: Tensor, allowed: Tensor, scale: number, bias?: Tensor): Tensor {
  const [B, nh, T, hs] = q.shape as [number, number, number, number];
  if (q.dtype !== 'bfloat16') return q.matmul(k.transpose(-2, -1)).mul(scale).maskedFill(allowed.logicalNot(), -Infinity);
  let b = bias;
  if (!b) {
    const made = zerosLike(allowed, { dtype: 'bfloat16' }).maskedFill(allowed.logicalNot(), -Infinity);
    b = allowed.ndim === 4 ? made.expand(B, nh, T, T).reshape(B * nh, T, T) : made.expand(B * nh, T, T);
  }
  return b
    .baddbmm(q.reshape(B * nh, T, hs), k.reshape(B * nh, T, hs).transpose(1, 2), { alpha: scale })
    .view(B, nh, T, T);
}

export function softmax(x: Tensor, dim: number): Tensor {
  return x.softmax(dim);
}

export function gelu(x: Tensor, approximate: 'none' | 'tanh' = 'none'): Tensor {
  return x.gelu(approximate);
}
