// SGD with momentum, dampening, Nesterov and L2 weight decay, as torch.optim.SGD computes it,
// over flat ranges ([Note: flat step] in optimizer.ts).
import { Tensor, zerosLike } from '../tensor/index.js';
import { fusedSGD } from './fused.js';
import { Optimizer, type ParamsArg, type OptimizerExtras, type UpdateRun } from './optimizer.js';

export interface SGDOptions {
  lr: number;
  momentum: number;
  dampening: number;
  weightDecay: number;
  nesterov: boolean;
}

export class SGD extends Optimizer<SGDOptions> {
  constructor(params: ParamsArg<SGDOptions>, opts: Partial<SGDOptions> & { lr: number }, extras: OptimizerExtras = {}) {
    const o: SGDOptions = { momentum: 0, dampening: 0, weightDecay: 0, nesterov: false, ...opts };
    if (o.nesterov && (o.momentum <= 0 || o.dampening !== 0)) throw new Error('SGD: nesterov needs momentum > 0 and dampening 0');
    super(params, o, extras);
  }

  protected initState(flat: Tensor): Record<string, Tensor> {
    return this.groups.some((g) => g.options.momentum !== 0) ? { momentumBuffer: zerosLike(flat) } : {};
  }

  // Weight decay enters the gradient (L2), so ranges with different decay are updated apart.
  protected override fuseKey(o: SGDOptions): string {
    return JSON.stringify(o);
  }

  protected update({ param: p, grad: g, state, step, weightDecay }: UpdateRun, o: SGDOptions): void {
    const wd = weightDecay as number;
    let d = wd !== 0 ? g.add(p, wd) : g;
    if (o.momentum !== 0) {
      const buf = state.momentumBuffer!;
      // torch starts the buffer as a copy of the first gradient (no dampening on step 1).
      if (step === 1) buf.copy_(d);
      else buf.mul_(o.momentum).add_(d, 1 - o.dampening);
      d = o.nesterov ? d.add(buf, o.momentum) : buf;
    }
    p.add_(d, -o.lr);
  }

  protected override fusedUpdate(run: UpdateRun, o: SGDOptions): void {
    fusedSGD(run, o);
  }
}
