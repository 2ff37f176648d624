// Base optimizer: parameter groups, zeroGrad that keeps gradients allocated, state dicts.
import { Tensor, noGrad, keep, tidy } from '../tensor/index.js';

export interface ParamGroup<O> {
  params: Tensor[];
  options: O;
}

export type ParamsArg<O> = Tensor[] | { params: Tensor[]; options?: Partial<O> }[];

export abstract class Optimizer<O extends { lr: number }> {
  readonly groups: ParamGroup<O>[];
  stepCount = 0;
  /** Per-parameter state tensors, created lazily on the first step. */
  protected readonly state = new Map<Tensor, Record<string, Tensor>>();

  constructor(params: ParamsArg<O>, defaults: O) {
    const list = params.length > 0 && params[0] instanceof Tensor
      ? [{ params: params as Tensor[] }]
      : (params as { params: Tensor[]; options?: Partial<O> }[]);
    this.groups = list.map((g) => ({ params: g.params, options: { ...defaults, ...(g as { options?: Partial<O> }).options } }));
    const all = this.groups.flatMap((g) => g.params);
    if (all.length === 0) throw new Error('optimizer got no parameters');
    if (new Set(all).size !== all.length) throw new Error('a parameter appears in more than one group');
  }

  /** Learning rate of every group (schedules set it each step). */
  get lr(): number {
    return this.groups[0]!.options.lr;
  }
  set lr(v: number) {
    for (const g of this.groups) g.options.lr = v;
  }

  /** Zeroes gradients in place: the tensors (possibly views of a flat buffer) stay allocated. */
  zeroGrad(): void {
    noGrad(() => {
      for (const g of this.groups) {
        for (const p of g.params) {
          const grad = p.grad;
          if (grad) {
            grad.zero_();
            grad.dispose();
          }
        }
      }
    });
  }

  step(): void {
    this.stepCount++;
    noGrad(() => {
      for (const g of this.groups) {
        for (const p of g.params) {
          const grad = p.grad;
          if (!grad) continue;
          let st = this.state.get(p);
          if (!st) {
            st = this.initState(p);
            for (const t of Object.values(st)) keep(t);
            this.state.set(p, st);
          }
          const state = st;
          tidy(() => this.update(p, grad, state, g.options));
          grad.dispose();
        }
      }
    });
  }

  protected abstract initState(p: Tensor): Record<string, Tensor>;
  protected abstract update(p: Tensor, grad: Tensor, state: Record<string, Tensor>, o: O): void;

  /** State keyed by parameter position (group order, then parameter order). */
  stateDict(): { step: number; state: Record<string, Record<string, Tensor>> } {
    const state: Record<string, Record<string, Tensor>> = {};
    this.groups.flatMap((g) => g.params).forEach((p, i) => {
      const st = this.state.get(p);
      if (st) state[String(i)] = st;
    });
    return { step: this.stepCount, state };
  }

  /** Frees the optimizer state (moments, momentum buffers). */
  dispose(): void {
    for (const st of this.state.values()) for (const t of Object.values(st)) t.dispose();
    this.state.clear();
  }

  loadStateDict(sd: { step: number; state: Record<string, Record<string, Tensor>> }): void {
    const params = this.groups.flatMap((g) => g.params);
    noGrad(() => {
      for (const [k, st] of Object.entries(sd.state)) {
        const p = params[Number(k)];
        if (!p) throw new Error(`optimizer state has parameter #${k}, this optimizer has ${params.length}`);
        const own: Record<string, Tensor> = {};
        for (const [n, t] of Object.entries(st)) own[n] = keep(t.clone());
        this.state.set(p, own);
      }
    });
    this.stepCount = sd.step;
  }
}
