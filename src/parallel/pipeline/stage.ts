// Pipeline stages: the per-stage state the executor needs for a stage module of any model (see
// model.ts): its module, which parameters get their gradient in the input-gradient pass I and which
// Linear layers finish theirs in the weight-gradient pass W. How a model is cut into stages is the
// model's (PipelineModel.stage; the GPT's split is in src/models/gpt_parallel.ts).
import { Linear, type Module } from '../../nn/index.js';
import type { Tensor } from '../../tensor/index.js';

/** A Linear whose weight gradient the zero-bubble schedule computes in W, from captures taken in F/I. */
export interface SplitLinear {
  module: Linear;
  weight: Tensor;
  bias?: Tensor;
}

/** One stage on this rank: its module and how its parameters' gradients are produced. */
export class Stage {
  readonly module: Module;
  readonly isFirst: boolean;
  readonly isLast: boolean;
  /** Local parameters in module order (tied copies included). */
  readonly params: Tensor[];
  /** Linear layers whose weight (and bias) gradients come from W when the backward is split. */
  readonly splitLinears: SplitLinear[];
  /** Parameters that get their gradient in I (everything not in splitLinears but frozen ones, which get none). */
  readonly inputPassParams: Tensor[];

  /**
   * `restyled`: modules whose forward a tensor-parallel style replaced (communication around the
   * matmul), whose gradients stay in I (TensorParallelApplied.styled).
   */
  constructor(readonly index: number, readonly numStages: number, module: Module, restyled: (m: Module) => boolean = () => false) {
    this.module = module;
    this.isFirst = index === 0;
    this.isLast = index === numStages - 1;
    this.params = this.module.parameters();
    // A Linear's weight used by another module too (a tied head on a single stage that also holds
    // the embedding) cannot be finished from the Linear's captures alone: it stays in I.
    const uses = new Map<Tensor, number>();
    for (const [, m] of this.module.namedModules()) for (const p of ownParams(m)) uses.set(p, (uses.get(p) ?? 0) + 1);
    this.splitLinears = [];
    for (const [, m] of this.module.namedModules()) {
      if (m instanceof Linear && uses.get(m.weight) === 1 && !restyled(m)) this.splitLinears.push({ module: m, weight: m.weight, bias: m.bias });
    }
    const split = new Set<Tensor>(this.splitLinears.flatMap((l) => (l.bias ? [l.weight, l.bias] : [l.weight])));
    this.inputPassParams = this.params.filter((p) => !split.has(p) && p.requiresGrad);
  }

  dispose(): void {
    this.module.dispose();
  }
}

/** A module's own (non-inherited) parameters: those under a name without a dot. */
function ownParams(m: Module): Tensor[] {
  return m.namedParameters().filter(([n]) => !n.includes('.')).map(([, p]) => p);
}
