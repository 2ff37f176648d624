// AdamW with decoupled weight decay, computed in the same order as torch.optim.AdamW
// (single-tensor path), so results agree to float rounding.
import { Tensor, zeros, zerosLike } from '../tensor/index.js';
import { Optimizer, type ParamsArg } from './optimizer.js';

export interface AdamWOptions {
  lr: number;
  betas: [number, number];
  eps: number;
  weightDecay: number;
}

export class AdamW extends Optimizer<AdamWOptions> {
  constructor(params: ParamsArg<AdamWOptions>, opts: Partial<AdamWOptions> & { lr: number }) {
    const o: AdamWOptions = { betas: [0.9, 0.999], eps: 1e-8, weightDecay: 0.01, ...opts };
    if (!(o.lr >= 0)) throw new Error(`AdamW: lr must be >= 0, got ${o.lr}`);
    if (!(o.betas[0] >= 0 && o.betas[0] < 1 && o.betas[1] >= 0 && o.betas[1] < 1)) throw new Error(`AdamW: betas must be in [0, 1), got ${o.betas}`);
    super(params, o);
  }

  protected initState(p: Tensor): Record<string, Tensor> {
    // The step count is per parameter, as in torch: a parameter that had no gradient on some steps
    // (or joined late) gets the bias correction of the updates it actually received.
    return { step: zeros([], { dtype: 'float64' }), expAvg: zerosLike(p), expAvgSq: zerosLike(p) };
  }

  protected update(p: Tensor, g: Tensor, st: Record<string, Tensor>, o: AdamWOptions): void {
    const [b1, b2] = o.betas;
    const step = st.step!.add_(1).item();
    const m = st.expAvg!, v = st.expAvgSq!;
    if (o.weightDecay !== 0) p.mul_(1 - o.lr * o.weightDecay);
    m.mul_(b1).add_(g, 1 - b1);
    v.mul_(b2).addcmul_(g, g, 1 - b2);
    const bc1 = 1 - b1 ** step;
    const bc2 = 1 - b2 ** step;
    const denom = v.sqrt().div_(Math.sqrt(bc2)).add_(o.eps);
    p.addcdiv_(m, denom, -o.lr / bc1);
    denom.dispose();
  }
}
