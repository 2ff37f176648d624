// SGD with momentum, dampening, Nesterov and L2 weight decay, as torch.optim.SGD computes it.
import { Tensor, keep } from '../tensor/index.js';
import { Optimizer, type ParamsArg } from './optimizer.js';

export interface SGDOptions {
  lr: number;
  momentum: number;
  dampening: number;
  weightDecay: number;
  nesterov: boolean;
}

export class SGD extends Optimizer<SGDOptions> {
  constructor(params: ParamsArg<SGDOptions>, opts: Partial<SGDOptions> & { lr: number }) {
    const o: SGDOptions = { momentum: 0, dampening: 0, weightDecay: 0, nesterov: false, ...opts };
    if (o.nesterov && (o.momentum <= 0 || o.dampening !== 0)) throw new Error('SGD: nesterov needs momentum > 0 and dampening 0');
    super(params, o);
  }

  protected initState(): Record<string, Tensor> {
    return {};
  }

  protected update(p: Tensor, g: Tensor, st: Record<string, Tensor>, o: SGDOptions): void {
    let d = o.weightDecay !== 0 ? g.add(p, o.weightDecay) : g;
    if (o.momentum !== 0) {
      const buf = st.momentumBuffer;
      if (!buf) {
        st.momentumBuffer = keep(d.clone());
      } else {
        buf.mul_(o.momentum).add_(d, 1 - o.dampening);
      }
      const b = st.momentumBuffer!;
      d = o.nesterov ? d.add(b, o.momentum) : b;
    }
    p.add_(d, -o.lr);
  }
}
