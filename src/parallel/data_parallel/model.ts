// A whole model under data parallelism (plain, ZeRO-1/2/3, HSDP) as a ParallelModel: the
// micro-batch loop of one step, with every micro-batch but the last inside noSync, so that what is
// reduced when is the layout's accumulation flavour ([Note: accumulation] in data_parallel.ts).
import { type Tensor, noGrad, tensor, tidy } from '../../tensor/index.js';
import type { Module } from '../../nn/module.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import type { DataParallel, MemoryReport } from './data_parallel.js';
import { placementsOf, type ParamPlacement } from '../placement.js';
import type { GradientSource } from '../grads.js';
import { asList, type LossFn, type MicroBatch, type ParallelModel, type StageValue } from '../parallel_model.js';

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

  constructor(readonly module: Module, readonly dp: DataParallel, private readonly loss: LossFn, grads: GradientSource = dp) {
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

  private lossOf(mb: MicroBatch): Tensor {
    const out = (this.module as unknown as { call: (...a: Tensor[]) => StageValue }).call(...asList(mb.x));
    return this.loss(out, mb.y);
  }

  step(microBatches: MicroBatch[]): { loss: number } {
    const M = microBatches.length;
    let sum = 0;
    microBatches.forEach((mb, k) => {
      // Each micro-batch in its own scope: its activations go before the next one starts.
      const micro = (): number => tidy(() => {
        const l = this.lossOf(mb);
        l.div(M).backward(); // the mean over micro-batches, as one big batch would give
        return l.item();
      });
      sum += k < M - 1 ? this.noSync(micro) : micro();
    });
    this.finishGradSync();
    return { loss: meanOverRanks(this.dp.group, sum / M) };
  }

  evaluate(microBatches: MicroBatch[]): number {
    const training = this.module.training;
    this.module.eval();
    let sum = 0;
    try {
      noGrad(() => {
        for (const mb of microBatches) sum += tidy(() => this.lossOf(mb).item());
      });
    } finally {
      this.module.train(training);
    }
    // Equal-sized micro-batches everywhere, so the mean of means is the global mean.
    return meanOverRanks(this.dp.group, sum / microBatches.length);
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
