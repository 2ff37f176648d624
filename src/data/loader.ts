// A rank-aware, deterministic, resumable batch loader for next-token prediction.
//
// [Note: global batch partition]
// Every optimizer step draws `globalBatch` sample start offsets from a generator seeded by
// (seed, step) — the same numbers on every rank, independent of the world size. The global batch is
// then cut into contiguous slices: DP rank r owns samples [r * localBatch, (r + 1) * localBatch),
// and micro-batch m of that rank owns the m-th slice of its part. So the ranks' samples partition
// the global batch (the trainer checks this at start-up with localSampleIds), a run with 1 rank and
// k micro-batches reads exactly the samples of a run with k ranks, and resuming only needs the step
// counter and the seed.
import { type Tensor, tensor } from '../tensor/index.js';
import type { TokenArray } from './tokenizer.js';

export interface LoaderOptions {
  /** The token stream to sample windows from. */
  tokens: TokenArray;
  /** Tokens per sample (T). */
  seqLen: number;
  /** Samples per optimizer step, summed over every DP rank and micro-batch. */
  globalBatch: number;
  /** This process's data-parallel rank (default 0). */
  dpRank?: number;
  /** Number of data-parallel ranks (default 1). */
  dpSize?: number;
  /** Gradient-accumulation micro-batches per step (default 1). */
  microBatches?: number;
  /** Seed of the sample offsets (uint32; default 0). */
  seed?: number;
}

export interface Batch {
  /** (B, T) int64 inputs. */
  x: Tensor;
  /** (B, T) int64 targets: x shifted by one token. */
  y: Tensor;
  /** The optimizer step and micro-batch this batch belongs to. */
  step: number;
  micro: number;
}

/** What a resumed run needs to read the same batches (see [Note: global batch partition]). */
export interface LoaderState {
  /** Position of the next batch. */
  step: number;
  micro: number;
  seed: number;
  /** Recorded to refuse a resume under a different batch geometry. */
  globalBatch: number;
  seqLen: number;
}

/** 32-bit integer hash (a bijection with good avalanche). */
function mix32(z: number): number {
  z = Math.imul(z ^ (z >>> 16), 0x21f0aaad);
  z = Math.imul(z ^ (z >>> 15), 0x735a2d97);
  return (z ^ (z >>> 15)) >>> 0;
}

const GOLDEN = 0x9e3779b9;

/** `count` uniform integers in [0, range) for (seed, step): a splitmix-style counter stream. */
export function sampleStream(seed: number, step: number, count: number, range: number): number[] {
  let state = mix32((mix32(seed) + Math.imul(step, GOLDEN)) | 0);
  const out = new Array<number>(count);
  for (let i = 0; i < count; i++) {
    state = (state + GOLDEN) | 0;
    const hi = mix32(state);
    state = (state + GOLDEN) | 0;
    const lo = mix32(state);
    const u = (hi * 2 ** 21 + (lo >>> 11)) / 2 ** 53; // 53 random bits in [0, 1)
    out[i] = Math.floor(u * range);
  }
  return out;
}

function positiveInt(v: number, name: string): number {
  if (!Number.isInteger(v) || v <= 0) throw new Error(`loader: ${name} must be a positive integer, got ${v}`);
  return v;
}

export class DataLoader {
  readonly tokens: TokenArray;
  readonly seqLen: number;
  readonly globalBatch: number;
  readonly dpRank: number;
  readonly dpSize: number;
  readonly microBatches: number;
  /** Samples this rank reads per step (all micro-batches). */
  readonly localBatch: number;
  /** Samples per micro-batch on this rank (the B of each batch). */
  readonly microBatchSize: number;
  private seedValue: number;
  private stepValue = 0;
  private microValue = 0;

  constructor(o: LoaderOptions) {
    this.tokens = o.tokens;
    this.seqLen = positiveInt(o.seqLen, 'seqLen');
    this.globalBatch = positiveInt(o.globalBatch, 'globalBatch');
    this.dpSize = positiveInt(o.dpSize ?? 1, 'dpSize');
    this.microBatches = positiveInt(o.microBatches ?? 1, 'microBatches');
    this.dpRank = o.dpRank ?? 0;
    if (!Number.isInteger(this.dpRank) || this.dpRank < 0 || this.dpRank >= this.dpSize) {
      throw new Error(`loader: dpRank ${this.dpRank} is outside 0..${this.dpSize - 1} (dpSize ${this.dpSize})`);
    }
    const parts = this.dpSize * this.microBatches;
    if (this.globalBatch % parts !== 0) {
      const lower = Math.floor(this.globalBatch / parts) * parts;
      const upper = lower + parts;
      throw new Error(
        `data.globalBatch=${this.globalBatch} does not split over ${this.dpSize} data-parallel rank(s) x ` +
          `${this.microBatches} micro-batch(es) = ${parts} equal parts; set data.globalBatch to a multiple of ${parts} ` +
          `(e.g. ${lower > 0 ? `${lower} or ` : ''}${upper}) or change data.microBatches`,
      );
    }
    this.localBatch = this.globalBatch / this.dpSize;
    this.microBatchSize = this.localBatch / this.microBatches;
    if (this.tokens.length < this.seqLen + 1) {
      throw new Error(
        `loader: ${this.tokens.length} tokens cannot hold one sample of data.seqLen=${this.seqLen} (+1 target token); ` +
          'use a longer text or a shorter data.seqLen',
      );
    }
    this.seedValue = checkSeed(o.seed ?? 0);
  }

  get seed(): number {
    return this.seedValue;
  }
  /** Step of the next batch next() returns. */
  get step(): number {
    return this.stepValue;
  }
  /** Micro-batch of the next batch next() returns. */
  get micro(): number {
    return this.microValue;
  }

  /** Start offsets of the whole global batch of `step` (identical on every rank). */
  sampleOffsets(step: number): number[] {
    return sampleStream(this.seedValue, step, this.globalBatch, this.tokens.length - this.seqLen);
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

  /** The (x, y) of one micro-batch, by position; does not move the cursor. */
  batch(step: number, micro: number): { x: Tensor; y: Tensor } {
    if (!Number.isInteger(step) || step < 0) throw new Error(`loader: step must be a non-negative integer, got ${step}`);
    const offsets = this.sampleOffsets(step);
    const ids = this.microSampleIds(step, micro);
    const T = this.seqLen;
    const B = ids.length;
    const xs = new Int32Array(B * T);
    const ys = new Int32Array(B * T);
    ids.forEach((id, b) => {
      const start = offsets[id]!;
      for (let t = 0; t < T; t++) {
        xs[b * T + t] = this.tokens[start + t]!;
        ys[b * T + t] = this.tokens[start + t + 1]!;
      }
    });
    return { x: tensor(xs, { shape: [B, T], dtype: 'int64' }), y: tensor(ys, { shape: [B, T], dtype: 'int64' }) };
  }

  /** The next micro-batch; after the last micro-batch of a step the cursor moves to the next step. */
  next(): Batch {
    const step = this.stepValue;
    const micro = this.microValue;
    const { x, y } = this.batch(step, micro);
    this.microValue++;
    if (this.microValue === this.microBatches) {
      this.microValue = 0;
      this.stepValue++;
    }
    return { x, y, step, micro };
  }

  stateDict(): LoaderState {
    return { step: this.stepValue, micro: this.microValue, seed: this.seedValue, globalBatch: this.globalBatch, seqLen: this.seqLen };
  }

  /** Restores the cursor and seed; the batch geometry must match the run that saved the state. */
  loadStateDict(s: LoaderState): void {
    if (s.globalBatch !== this.globalBatch || s.seqLen !== this.seqLen) {
      throw new Error(
        `loader state was saved with data.globalBatch=${s.globalBatch}, data.seqLen=${s.seqLen}; this run has ` +
          `${this.globalBatch}, ${this.seqLen}: resume with the same values to read the same batches`,
      );
    }
    if (!Number.isInteger(s.step) || s.step < 0 || !Number.isInteger(s.micro) || s.micro < 0 || s.micro >= this.microBatches) {
      throw new Error(`loader state has an invalid position (step ${s.step}, micro ${s.micro}) for ${this.microBatches} micro-batch(es)`);
    }
    this.seedValue = checkSeed(s.seed);
    this.stepValue = s.step;
    this.microValue = s.micro;
  }
}

function checkSeed(seed: number): number {
  if (!Number.isInteger(seed) || seed < 0 || seed > 0xffffffff) throw new Error(`loader: seed must be an integer in 0..2^32-1, got ${seed}`);
  return seed;
}
