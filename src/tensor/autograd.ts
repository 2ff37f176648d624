// Autograd entry points: grad mode scopes and multi-root backward.
import { native } from './native.js';
import type { Tensor } from './tensor.js';

/** Runs fn with gradient recording off (like torch.no_grad). */
export function noGrad<T>(fn: () => T): T {
  const prev = native.setGradEnabled(false);
  try {
    return fn();
  } finally {
    native.setGradEnabled(prev);
  }
}

export function isGradEnabled(): boolean {
  return native.isGradEnabled();
}

/** Backward from several roots at once, each with an optional explicit gradient. */
export function backward(roots: Tensor[], grads?: Tensor[], opts: { retainGraph?: boolean } = {}): void {
  native.backward(roots.map((r) => r.handle), grads?.map((g) => g.handle), opts.retainGraph ?? false);
}
