// What the text loader (loader.ts) and the example loader (example_loader.ts) share: the batch
// geometry and its checks, the (step, micro) cursor, the global batch partition of
// [Note: global batch partition] (a rank's slice, cut into micro-batches), reading ahead on the
// prefetch worker, and the position part of a resumed state. A loader says only how a micro-batch
// is read (inline, or rebuilt from a worker's slot) and what the worker reads.
import type { LoaderState } from './loader.js';
import { globalBatchProblem } from './batch_split.js';
import { Prefetcher, type PrefetchSource } from './prefetch.js';

export function positiveInt(v: number, name: string): number {
  if (!Number.isInteger(v) || v <= 0) throw new Error(`loader: ${name} must be a positive integer, got ${v}`);
  return v;
}

export interface GeometryOptions {
  /** Tokens per row (T). */
  seqLen: number;
  /** Rows per optimizer step, summed over every DP rank and micro-batch. */
  globalBatch: number;
  /** This process's data-parallel rank (default 0). */
  dpRank?: number;
  /** Number of data-parallel ranks (default 1). */
  dpSize?: number;
  /** Gradient-accumulation micro-batches per step (default 1). */
  microBatches?: number;
}

export abstract class BatchCursor<B> {
  readonly seqLen: number;
  readonly globalBatch: number;
  readonly dpRank: number;
  readonly dpSize: number;
  readonly microBatches: number;
  /** Rows this rank reads per step (all micro-batches). */
  readonly localBatch: number;
  /** Rows per micro-batch on this rank (the B of each batch). */
  readonly microBatchSize: number;
  protected stepValue = 0;
  protected microValue = 0;
  private prefetcher: Prefetcher | undefined;

  constructor(o: GeometryOptions, private readonly prefetchDepth: number) {
    this.seqLen = positiveInt(o.seqLen, 'seqLen');
    this.globalBatch = positiveInt(o.globalBatch, 'globalBatch');
    this.dpSize = positiveInt(o.dpSize ?? 1, 'dpSize');
    this.microBatches = positiveInt(o.microBatches ?? 1, 'microBatches');
    this.dpRank = o.dpRank ?? 0;
    if (!Number.isInteger(this.dpRank) || this.dpRank < 0 || this.dpRank >= this.dpSize) {
      throw new Error(`loader: dpRank ${this.dpRank} is outside 0..${this.dpSize - 1} (dpSize ${this.dpSize})`);
    }
    const split = globalBatchProblem({ globalBatch: this.globalBatch, microBatches: this.microBatches, dp: this.dpSize });
    if (split) throw new Error(split);
    this.localBatch = this.globalBatch / this.dpSize;
    this.microBatchSize = this.localBatch / this.microBatches;
  }

  /** Step of the next batch next() returns. */
  get step(): number {
    return this.stepValue;
  }
  /** Micro-batch of the next batch next() returns. */
  get micro(): number {
    return this.microValue;
  }

  /** Indices into the global batch that this rank reads at `step` (all its micro-batches, in order). */
  localSampleIds(step: number): number[] {
    void step; // the slice is the same every step; the argument keeps the contract open to shuffling
    const first = this.dpRank * this.localBatch;
    return Array.from({ length: this.localBatch }, (_, i) => first + i);
  }

  /** Indices into the global batch of one micro-batch of this rank. */
  microSampleIds(step: number, micro: number): number[] {
    if (!Number.isInteger(micro) || micro < 0 || micro >= this.microBatches) {
      throw new Error(`loader: micro-batch ${micro} is outside 0..${this.microBatches - 1}`);
    }
    return this.localSampleIds(step).slice(micro * this.microBatchSize, (micro + 1) * this.microBatchSize);
  }

  /** One micro-batch by position; does not move the cursor. */
  batch(step: number, micro: number): B {
    if (!Number.isInteger(step) || step < 0) throw new Error(`loader: step must be a non-negative integer, got ${step}`);
    this.microSampleIds(step, micro); // checks micro
    return this.read(step, micro);
  }

  /** The next micro-batch; after the last micro-batch of a step the cursor moves to the next step. */
  next(): B & { step: number; micro: number } {
    const step = this.stepValue;
    const micro = this.microValue;
    let b: B;
    if (this.prefetchDepth > 0) {
      const pos = step * this.microBatches + micro;
      if (!this.prefetcher || !this.prefetcher.serves(pos)) {
        this.prefetcher?.close();
        this.prefetcher = new Prefetcher(this.prefetchSource(), pos, this.prefetchDepth);
      }
      b = this.prefetcher.take(pos, (slot) => this.fromSlot(slot));
    } else {
      b = this.batch(step, micro);
    }
    this.microValue++;
    if (this.microValue === this.microBatches) {
      this.microValue = 0;
      this.stepValue++;
    }
    return { ...b, step, micro };
  }

  /** Stops the prefetch worker (if any). The loader still works afterwards, reading inline. */
  close(): void {
    this.prefetcher?.close();
    this.prefetcher = undefined;
  }

  /** Reads micro-batch `micro` of `step` inline. */
  protected abstract read(step: number, micro: number): B;
  /** What the prefetch worker reads (from the loader's current seed). */
  protected abstract prefetchSource(): PrefetchSource;
  /** A micro-batch from one of the worker's slots (copied out: the ring is reused). */
  protected abstract fromSlot(slot: Int32Array): B;

  /** Checks a saved state's geometry and position against this loader's; `what` names what it reads ("batches", "rows"). */
  protected checkState(s: LoaderState, what: string): void {
    if (s.globalBatch !== this.globalBatch || s.seqLen !== this.seqLen) {
      throw new Error(
        `loader state was saved with data.globalBatch=${s.globalBatch}, data.seqLen=${s.seqLen}; this run has ` +
          `${this.globalBatch}, ${this.seqLen}: resume with the same values to read the same ${what}`,
      );
    }
    if (!Number.isInteger(s.step) || s.step < 0 || !Number.isInteger(s.micro) || s.micro < 0 || s.micro >= this.microBatches) {
      throw new Error(`loader state has an invalid position (step ${s.step}, micro ${s.micro}) for ${this.microBatches} micro-batch(es)`);
    }
  }

  /** Moves the cursor to a saved state's position; a worker that read ahead from the old one stops. */
  protected setPosition(s: LoaderState): void {
    this.stepValue = s.step;
    this.microValue = s.micro;
    this.close();
  }
}
