// What parallelize() returns for every layout: this rank's model parts and one way to train and
// evaluate them, so a training loop has no branch per layout (the trainer runs one loop); and the
// types every layout shares: a micro-batch, the values that flow through a model, the criterion.
import type { Tensor } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import type { GradientSource } from './grads.js';
import type { MemoryReport } from './data_parallel/memory.js';
import type { ParamPlacement } from './placement.js';
import type { DocumentLayout } from '../nn/documents.js';

/**
 * What a model (or a pipeline stage) takes and returns, and what a micro-batch holds: one tensor or
 * several ([Note: stage values] in pipeline/model.ts).
 */
export type StageValue = Tensor | readonly Tensor[];

/** A target no loss reads (a prompt's token, padding, the last token of a packed example): PyTorch's ignore_index. */
export const IGNORE_INDEX = -100;

/**
 * The sequences of a micro-batch of preference pairs (DPO, src/train/dpo.ts): each pair's chosen
 * and rejected responses are two documents of one row, so a pair never spans ranks or micro-batches.
 */
export interface SequenceTable {
  /** (B, T) int64: the sequence each target belongs to, nSeq for a target no sequence trains. */
  index: Tensor;
  /** Sequences in this micro-batch (the dump slot nSeq is not one). */
  nSeq: number;
  /** Per pair: the sequence numbers of its chosen and its rejected response. */
  chosen: Int32Array;
  rejected: Int32Array;
  /** Per pair: its index in the dataset (for reference log-probabilities computed once). */
  pairIds: Int32Array;
  /** Per sequence: its trained tokens (IPO's per-token mean). */
  lengths: Int32Array;
  /** Per sequence: the reference model's log-probability sum, filled before the step. */
  ref?: Float64Array;
}

/**
 * One micro-batch: `x` is the model's (the first stage's) input, `y` the target the loss reads
 * (IGNORE_INDEX where no loss is taken). `docs`, when a row holds more than one document (packed
 * examples, a preference pair), keeps attention and positions within each document
 * (src/nn/documents.ts); `seqs` is a preference batch's pairs.
 */
export interface MicroBatch {
  x: StageValue;
  y: StageValue;
  docs?: DocumentLayout;
  seqs?: SequenceTable;
}

/**
 * A loss on the model's output and the micro-batch's target: the mean over its trained targets,
 * or their sum with `{ reduction: 'sum' }` when the function sets `reduces` (every layout then
 * takes the mean over the trained targets of the whole global batch, see Criterion).
 */
export type LossFn = ((output: StageValue, target: StageValue, o?: { reduction?: 'mean' | 'sum' }) => Tensor) & { reduces?: boolean };

/**
 * What a layout's step minimises ([Note: global loss reduction] in loss_reduction.ts): a sum over
 * units (trained tokens, or preference pairs) divided by the units of the whole global batch, so
 * micro-batches and ranks holding different numbers of trained tokens weigh each token alike.
 */
export interface Criterion {
  /** This rank's units in the micro-batch as it sees it (its context-parallel chunk of y). */
  count(mb: MicroBatch): number;
  /**
   * The micro-batch's loss SUMMED over its units (what backward starts from), the value this rank
   * adds to the reported sum, and metrics summed likewise (divided by the global count when reported).
   */
  apply(output: StageValue, mb: MicroBatch): { loss: Tensor; value: number; metrics?: Record<string, number> };
}

/** What a layout's step returns: the same on every rank. */
export interface StepResult {
  /** The loss over the global batch (sum over its units / count). */
  loss: number;
  /** Units (trained tokens, pairs) of the global batch; 0 means no gradient was made and the step is skipped. */
  count: number;
  /** The criterion's metrics over the global batch (sum / count). */
  metrics?: Record<string, number>;
}

/**
 * Frees the documents of micro-batches a step or an evaluation ran (each once). A context-parallel
 * chunk (`full` set) belongs to the whole rows it was cut from, which the context-parallel layer frees.
 */
export function disposeDocuments(microBatches: readonly MicroBatch[]): void {
  const seen = new Set<DocumentLayout>();
  for (const mb of microBatches) {
    if (mb.docs && !mb.docs.full && !seen.has(mb.docs)) {
      seen.add(mb.docs);
      mb.docs.dispose();
    }
  }
}

/** A StageValue as a list (a model may return one tensor or several). */
export function asList(v: StageValue): Tensor[] {
  return Array.isArray(v) ? [...(v as readonly Tensor[])] : [v as Tensor];
}

export interface ParallelModel {
  /** This rank's model parts: its pipeline stages, or the whole model. */
  readonly parts: Module[];
  /** The gradient API (grads.ts): norms, clipping, fullGrad / localGradShard. */
  readonly grads: GradientSource;
  /** What the optimizer takes as `grads` (the sharded ranges it updates), when the layout has them. */
  readonly optimizerGrads: GradientSource | undefined;
  /** Tied copies left out of the norm (and of checkpoints' writes): the first copy stands for them. */
  readonly tiedCopiesLeftOutOfNorm: ReadonlySet<Tensor>;
  /** One line for the run's header: how the parts are wrapped. */
  summary(): string;
  /** This rank's trainable parameters by whole-model name (a tied copy under its declared name). */
  namedParameters(): [string, Tensor][];
  /**
   * Where each of namedParameters() lives ([Note: placement] in placement.ts): what this rank
   * holds, keeps optimizer state for and writes to a checkpoint. Computed from the layout as it was
   * applied (its buckets and shards, tensor-parallel slices, tied copies).
   */
  placements(): ParamPlacement[];
  /**
   * The whole parameter from this rank's part of it: a tensor-parallel slice gathered over tp (a
   * collective: every tp rank calls it), else the parameter itself. Read it inside withFullParameters.
   */
  whole(param: Tensor): Tensor;
  /**
   * Lets parameter gathers still in flight land (ZeRO-1/2 start them after each optimizer step),
   * so that parameters can be read directly, e.g. through placements() by a checkpoint save.
   */
  finishParameterGathers(): void;
  /**
   * Forward and backward over this rank's micro-batches of one step, then the gradients finished
   * (reduced, tied copies summed) so that they equal one process's on the whole global batch.
   * Returns the loss over the global batch (its criterion's sum over the global count, [Note:
   * global loss reduction] in loss_reduction.ts), the same on every rank; a count of 0 made no
   * gradient, and the step must not be applied. Each micro-batch's documents are in effect around
   * its forward and backward, and disposed at the end.
   */
  step(microBatches: MicroBatch[]): StepResult;
  /** The loss over these micro-batches and every data-parallel rank's (sum over the global count), forward only. */
  evaluate(microBatches: MicroBatch[]): StepResult;
  /**
   * Forward only (noGrad, parts in eval mode) over these micro-batches, as evaluate runs them:
   * `read` turns each micro-batch's output (the model's, or the last pipeline stage's) into numbers
   * (a preference batch's reference log-probabilities). Returns them per micro-batch on every rank
   * (a pipeline broadcasts them from its last stage over its pipeline group). Under context
   * parallelism `read` sees this rank's chunks of the output and of the micro-batch (summing over
   * cp is the reader's); under loss parallelism its crossEntropy is the vocab-parallel one. The
   * micro-batches' documents are not disposed (a step reads them next).
   */
  forwardOnly(microBatches: MicroBatch[], read: (output: StageValue, mb: MicroBatch) => Float64Array): Float64Array[];
  /** This rank's parameter, gradient and optimizer bytes and the step's peak (activations not counted). */
  memory(optimizerBytes?: number): MemoryReport;
  /** Runs fn with every local parameter materialised and current (every rank calls it). */
  withFullParameters<T>(fn: () => T): T;
  dispose(): void;
}

/**
 * A layer that wraps the layout's model and changes some of what it does (tensor parallelism's
 * gradients and placements, context parallelism's micro-batches): every member it does not
 * override is the inner model's.
 */
export abstract class WrappedModel implements ParallelModel {
  constructor(protected readonly inner: ParallelModel) {}

  get parts(): Module[] {
    return this.inner.parts;
  }
  get grads(): GradientSource {
    return this.inner.grads;
  }
  get optimizerGrads(): GradientSource | undefined {
    return this.inner.optimizerGrads;
  }
  get tiedCopiesLeftOutOfNorm(): ReadonlySet<Tensor> {
    return this.inner.tiedCopiesLeftOutOfNorm;
  }
  summary(): string {
    return this.inner.summary();
  }
  namedParameters(): [string, Tensor][] {
    return this.inner.namedParameters();
  }
  placements(): ParamPlacement[] {
    return this.inner.placements();
  }
  whole(param: Tensor): Tensor {
    return this.inner.whole(param);
  }
  finishParameterGathers(): void {
    this.inner.finishParameterGathers();
  }
  step(microBatches: MicroBatch[]): StepResult {
    return this.inner.step(microBatches);
  }
  evaluate(microBatches: MicroBatch[]): StepResult {
    return this.inner.evaluate(microBatches);
  }
  forwardOnly(microBatches: MicroBatch[], read: (output: StageValue, mb: MicroBatch) => Float64Array): Float64Array[] {
    return this.inner.forwardOnly(microBatches, read);
  }
  memory(optimizerBytes?: number): MemoryReport {
    return this.inner.memory(optimizerBytes);
  }
  withFullParameters<T>(fn: () => T): T {
    return this.inner.withFullParameters(fn);
  }
  dispose(): void {
    this.inner.dispose();
  }
}
