// AdamW with decoupled weight decay, computed in the same order as torch.optim.AdamW
// (single-tensor path), so results agree to float rounding; it runs over flat ranges ([Note: flat
// step] in optimizer.ts), each op once per range instead of once per parameter.
import { Tensor, zerosLike } from '../tensor/index.js';
import { fusedAdamW } from './fused.js';
import { Optimizer, type ParamsArg, type OptimizerExtras, type UpdateRun } from './optimizer.js';

export interface AdamWOptions {
  lr: number;
  betas: [number, number];
  eps: number;
  weightDecay: number;
}

export class AdamW extends Optimizer<AdamWOptions> {
  constructor(params: ParamsArg<AdamWOptions>, opts: Partial<AdamWOptions> & { lr: number }, extras: OptimizerExtras = {}) {
    const o: AdamWOptions = { betas: [0.9, 0.999], eps: 1e-8, weightDecay: 0.01, ...opts };
    if (!(o.lr >= 0)) throw new Error(`AdamW: lr must be >= 0, got ${o.lr}`);
    if (!(o.betas[0] >= 0 && o.betas[0] < 1 && o.betas[1] >= 0 && o.betas[1] < 1)) throw new Error(`AdamW: betas must be in [0, 1), got ${o.betas}`);
    super(params, o, extras);
  }

  protected initState(flat: Tensor): Record<string, Tensor> {
    // The step count is kept per parameter by the base class, as in torch: a parameter that had no
    // gradient on some steps (or joined late) gets the bias correction of the updates it received.
    return { expAvg: zerosLike(flat), expAvgSq: zerosLike(flat) };
  }

  protected update({ param: p, grad: g, state, step, weightDecay }: UpdateRun, o: AdamWOptions): void {
    const [b1, b2] = o.betas;
    const m = state.expAvg!, v = state.expAvgSq!;
    if (typeof weightDecay === 'number') {
      if (weightDecay !== 0) p.mul_(1 - o.lr * weightDecay);
    } else {
      // A run that mixes groups: each range of uniform decay by its own factor (decay is elementwise).
      for (const r of weightDecay) if (r.decay !== 0) p.narrow(0, r.start, r.numel).mul_(1 - o.lr * r.decay);
    }
    m.mul_(b1).add_(g, 1 - b1);
    v.mul_(b2).addcmul_(g, g, 1 - b2);
    const bc1 = 1 - b1 ** step;
    const bc2 = 1 - b2 ** step;
    const denom = v.sqrt().div_(Math.sqrt(bc2)).add_(o.eps);
    p.addcdiv_(m, denom, -o.lr / bc1);
  }

  protected override fusedUpdate(run: UpdateRun, o: AdamWOptions): void {
    fusedAdamW(run, o);
  }
}
