// What parallelize() returns for every layout: this rank's model parts and one way to train and
// evaluate them, so a training loop has no branch per layout (the trainer runs one loop).
import type { Tensor } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import type { GradientSource } from './grads.js';
import type { DataParallel, MemoryReport } from './data_parallel.js';
import type { MicroBatch } from './pipeline/model.js';

export interface ParallelModel {
  /** This rank's model parts: its pipeline stages, or the whole model. */
  readonly parts: Module[];
  /** The gradient API (grads.ts): norms, clipping, fullGrad / localGradShard. */
  readonly grads: GradientSource;
  /** What the optimizer takes as `grads` (the sharded ranges it updates), when the layout has them. */
  readonly optimizerGrads: GradientSource | undefined;
  /** The data-parallel wrapper holding this rank's flat buffers, when the layout has one. */
  readonly dataParallel: DataParallel | undefined;
  /** Tied copies left out of the norm (and of checkpoints' writes): the first copy stands for them. */
  readonly tiedCopiesLeftOutOfNorm: ReadonlySet<Tensor>;
  /** One line for the run's header: how the parts are wrapped. */
  summary(): string;
  /** This rank's trainable parameters by whole-model name (a tied copy under its declared name). */
  namedParameters(): [string, Tensor][];
  /**
   * Forward and backward over this rank's micro-batches of one step, then the gradients finished
   * (reduced, tied copies summed) so that they equal one process's on the whole global batch.
   * Returns the mean loss over the global batch, the same on every rank.
   */
  step(microBatches: MicroBatch[]): { loss: number };
  /** The mean loss over these micro-batches and every data-parallel rank's, forward only. */
  evaluate(microBatches: MicroBatch[]): number;
  /** This rank's parameter, gradient and optimizer bytes and the step's peak (activations not counted). */
  memory(optimizerBytes?: number): MemoryReport;
  /** Runs fn with every local parameter materialised and current (every rank calls it). */
  withFullParameters<T>(fn: () => T): T;
  dispose(): void;
}
