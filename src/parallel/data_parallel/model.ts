// A whole model under data parallelism (plain, ZeRO-1/2/3, HSDP) as a ParallelModel: the
// micro-batch loop of one step, with every micro-batch but the last inside noSync, so that what is
// reduced when is the layout's accumulation flavour ([Note: accumulation] in data_parallel.ts). The
// loss is the criterion's sum over the global count ([Note: global loss reduction]).
import { type Tensor, noGrad, tensor, tidy } from '../../tensor/index.js';
import { withDocuments } from '../../nn/documents.js';
import type { Module } from '../../nn/module.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import type { DataParallel, MemoryReport } from './data_parallel.js';
import { placementsOf, type ParamPlacement } from '../placement.js';
import type { GradientSource } from '../grads.js';
import { asList, disposeDocuments, type Criterion, type LossFn, type MicroBatch, type ParallelModel, type StageValue, type StepResult } from '../parallel_model.js';
import { addMetrics, criterionOf, globalCount, localCount, reduceResult } from '../loss_reduction.js';

/** The mean of a per-rank scalar over the group (no collective for one rank). */
export function meanOverRanks(group: ProcessGroup, v: number): number {
  if (group.size === 1) return v;
  const t = tensor(new Float64Array([v]));
  try {
    group.allReduce(t, 'avg').wait();
    return t.item();
  } finally {
    t.dispose();
  }
}

export class DataParallelModel implements ParallelModel {
  readonly parts: Module[];
  readonly grads: GradientSource;
  readonly optimizerGrads: GradientSource;
  readonly tiedCopiesLeftOutOfNorm: ReadonlySet<Tensor> = new Set();

  private readonly criterion: Criterion;

  constructor(readonly module: Module, readonly dp: DataParallel, loss: LossFn | Criterion, grads: GradientSource = dp) {
    this.criterion = criterionOf(loss);
    this.parts = [module];
    this.grads = grads;
    this.optimizerGrads = grads;
  }

  summary(): string {
    const buckets = this.dp.buffers.reduce((a, b) => a + b.buckets.length, 0);
    return `${buckets} bucket(s)${this.dp.zero === 3 ? ' (one per wrapping unit)' : ''}, overlap ${this.dp.overlap ? 'on' : 'off'}`;
  }

  /** Every parameter, frozen ones included (placed like the rest; the optimizer takes the trainable ones). */
  namedParameters(): [string, Tensor][] {
    return this.module.namedParameters();
  }

  placements(): ParamPlacement[] {
    return placementsOf(this.namedParameters(), { dp: this.dp });
  }

  whole(param: Tensor): Tensor {
    return param;
  }

  finishParameterGathers(): void {
    this.dp.waitParams();
  }

  private output(mb: MicroBatch): StageValue {
    return (this.module as unknown as { call: (...a: Tensor[]) => StageValue }).call(...asList(mb.x));
  }

  step(microBatches: MicroBatch[]): StepResult {
    try {
      const M = microBatches.length;
      const N = globalCount(this.dp.group, localCount(this.criterion, microBatches));
      if (N === 0) return { loss: 0, count: 0 }; // nothing trained anywhere: no gradient (every rank agrees)
      // Divided by N / D: DataParallel's 1 / D average then gives the sum over the global batch / N.
      const per = N / this.dp.group.size;
      let sum = 0;
      const metrics: Record<string, number> = {};
      microBatches.forEach((mb, k) => {
        // Each micro-batch in its own scope: its activations go before the next one starts. Its
        // documents are in effect through its backward too (activation checkpoints recompute).
        const micro = (): number => withDocuments(mb.docs, () => tidy(() => {
          const r = this.criterion.apply(this.output(mb), mb);
          r.loss.div(per).backward();
          addMetrics(metrics, r.metrics);
          return r.value;
        }));
        sum += k < M - 1 ? this.noSync(micro) : micro();
      });
      this.finishGradSync();
      return reduceResult([this.dp.group], sum, metrics, N);
    } finally {
      disposeDocuments(microBatches);
    }
  }

  /** Runs fn over each micro-batch's output, forward only, in eval mode and inside its documents. */
  private eachForward<R>(microBatches: MicroBatch[], fn: (out: StageValue, mb: MicroBatch) => R): R[] {
    const training = this.module.training;
    this.module.eval();
    try {
      return noGrad(() => microBatches.map((mb) => withDocuments(mb.docs, () => tidy(() => fn(this.output(mb), mb)))));
    } finally {
      this.module.train(training);
    }
  }

  evaluate(microBatches: MicroBatch[]): StepResult {
    try {
      const N = globalCount(this.dp.group, localCount(this.criterion, microBatches));
      const metrics: Record<string, number> = {};
      const values = this.eachForward(microBatches, (out, mb) => {
        const r = this.criterion.apply(out, mb);
        addMetrics(metrics, r.metrics);
        return r.value;
      });
      return reduceResult([this.dp.group], values.reduce((a, v) => a + v, 0), metrics, N);
    } finally {
      disposeDocuments(microBatches);
    }
  }

  forwardOnly(microBatches: MicroBatch[], read: (output: StageValue, mb: MicroBatch) => Float64Array): Float64Array[] {
    return this.eachForward(microBatches, read);
  }

  memory(optimizerBytes = 0): MemoryReport {
    return this.dp.memory(optimizerBytes);
  }

  withFullParameters<T>(fn: () => T): T {
    return this.dp.withFullParameters(fn);
  }

  /** Runs a micro-batch that accumulates without reducing (every one but a step's last). */
  protected noSync<T>(fn: () => T): T {
    return this.dp.noSync(fn);
  }

  protected finishGradSync(): void {
    this.dp.finishGradSync();
  }

  dispose(): void {
    this.dp.dispose();
    this.module.dispose();
  }
}
