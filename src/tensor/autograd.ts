// Autograd entry points: grad mode scopes and multi-root backward.
import { native } from './native.js';
import { Tensor } from './tensor.js';

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

/**
 * Backward from several roots at once, each with an optional explicit gradient. With opts.inputs,
 * gradients accumulate into those tensors' .grad only, and the engine runs only what they need:
 * weight-gradient kernels of parameters left out are skipped (the zero-bubble pipeline's
 * input-gradient pass uses this).
 */
export function backward(roots: Tensor[], grads?: Tensor[], opts: { retainGraph?: boolean; inputs?: Tensor[] } = {}): void {
  if (opts.inputs && opts.inputs.length === 0) throw new Error('backward: opts.inputs must name at least one tensor (leave it out to reach every leaf)');
  native.backward(roots.map((r) => r.handle), grads?.map((g) => g.handle), opts.retainGraph ?? false, opts.inputs?.map((t) => t.handle));
}

/**
 * The gradients of outputs with respect to inputs (torch.autograd.grad), returned rather than
 * accumulated into .grad; undefined for an input that outputs do not depend on (with allowUnused).
 */
export function grad(
  outputs: Tensor[], inputs: Tensor[],
  opts: { gradOutputs?: Tensor[]; retainGraph?: boolean; allowUnused?: boolean } = {},
): (Tensor | undefined)[] {
  const res = native.autogradGrad(
    outputs.map((t) => t.handle), inputs.map((t) => t.handle), opts.gradOutputs?.map((g) => g.handle),
    opts.retainGraph ?? false, opts.allowUnused ?? false,
  );
  return res.map((h) => (h === undefined ? undefined : new Tensor(h)));
}
