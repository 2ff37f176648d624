// Stateless neural-network functions over the op table.
import { Tensor, run } from '../tensor/tensor.js';

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
  const ms = x.square().mean(-1, true);
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

export function softmax(x: Tensor, dim: number): Tensor {
  return x.softmax(dim);
}

export function gelu(x: Tensor, approximate: 'none' | 'tanh' = 'none'): Tensor {
  return x.gelu(approximate);
}
