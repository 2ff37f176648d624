// The optimizers' one-pass updates ([Note: fused optimizer] in native/optim.cc), chosen by
// `[train] kernels = "fused"` ([Note: kernel choice]): the same arithmetic as AdamW.update and
// SGD.update in adamw.ts and sgd.ts, each array of a run read and written once instead of once per
// op. The hyper-parameters are computed here as the eager updates compute them; the gradient is
// read times the run's gradScale ([Note: folded clip] in native/optim.cc).
import type { Tensor } from '../tensor/index.js';
import { native } from '../tensor/native.js';
import type { UpdateRun } from './optimizer.js';
import type { AdamWOptions } from './adamw.js';
import type { SGDOptions } from './sgd.js';

/** AdamW over a run: one kernel call per range of uniform weight decay. */
export function fusedAdamW({ param, grad, state, step, weightDecay, gradScale }: UpdateRun, o: AdamWOptions): void {
  const [b1, b2] = o.betas;
  const stepSize = o.lr / (1 - b1 ** step), bc2sqrt = Math.sqrt(1 - b2 ** step);
  const apply = (view: (t: Tensor) => Tensor, decay: number) =>
    native.adamwStep(view(param).handle, view(grad).handle, view(state.expAvg!).handle, view(state.expAvgSq!).handle,
      decay !== 0 ? 1 - o.lr * decay : 1, b1, b2, o.eps, stepSize, bc2sqrt, gradScale);
  if (typeof weightDecay === 'number') return apply((t) => t, weightDecay);
  for (const r of weightDecay) apply((t) => t.narrow(0, r.start, r.numel), r.decay);
}

/** SGD over a run (its weight decay is one number: SGD fuses only equal options). */
export function fusedSGD({ param, grad, state, step, weightDecay, gradScale }: UpdateRun, o: SGDOptions): void {
  const buf = o.momentum !== 0 ? state.momentumBuffer!.handle : undefined;
  native.sgdStep(param.handle, grad.handle, buf, o.lr, o.momentum, o.dampening, weightDecay as number, o.nesterov, step === 1, gradScale);
}
