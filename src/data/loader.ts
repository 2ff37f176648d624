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
//
// [Note: sources and blending]
// What a sample reads is a window of seqLen + 1 tokens of a TokenCorpus (src/data/corpus_files.ts:
// in-memory arrays or token files read by byte range). With several weighted sources, sample g of the
// run (g = step * globalBatch + i) reads source k where the Weyl point frac(g * phi + seedShift)
// falls in k's share of [0, 1): a low-discrepancy sequence, so after N samples every source has had
// its weight's share to within O(log N / N), decided by g alone. The window within the source comes
// from the same (seed, step) stream as with one source. So blending keeps the partition property
// and the loader's whole state stays (step, micro).
import { type Tensor, tensor } from '../tensor/index.js';
import type { TokenArray } from './tokenizer.js';
import { TokenCorpus } from './corpus_files.js';
import type { PrefetchSource } from './prefetch.js';
import { BatchCursor, type GeometryOptions } from './batch_cursor.js';
import { Sampler, type LoaderSource, type Sample, type SamplerSpec } from './sampler.js';
import type { DocumentLayout } from '../nn/documents.js';
import type { MicroBatch, SequenceTable } from '../parallel/parallel_model.js';

export { sampleStream, uniformStream, blendedSource, Sampler, type LoaderSource, type Sample, type SamplerSpec } from './sampler.js';

export interface LoaderOptions extends GeometryOptions {
  /** The token stream to sample windows from (or `sources`). */
  tokens?: TokenArray;
  /** Weighted corpora to sample from (instead of `tokens`). */
  sources?: LoaderSource[];
  /**
   * Batches a worker thread prepares ahead of next() (0: none, next() reads inline). The worker
   * reads the same windows; only when they are read changes.
   */
  prefetch?: number;
  /** Seed of the sample offsets (uint32; default 0). */
  seed?: number;
}

export interface Batch {
  /** (B, T) int64 inputs. */
  x: Tensor;
  /** (B, T) int64 targets: x shifted by one token (examples: IGNORE_INDEX where no loss is taken). */
  y: Tensor;
  /** Examples: the documents of rows that hold several (src/data/example_loader.ts). */
  docs?: DocumentLayout;
  /** Preference examples: the micro-batch's pairs. */
  seqs?: SequenceTable;
  /** The optimizer step and micro-batch this batch belongs to. */
  step: number;
  micro: number;
}

/** What an example loader adds to its state: a resume must read the same rows. */
export interface ExampleState {
  /** The training units' identity (the prepared datasets' keys and the units taken). */
  datasetKey: string;
  pack: boolean;
  overflow: 'truncate' | 'drop';
  epochs: number;
}

/** The surface the trainer uses: DataLoader (text) and ExampleLoader (chat, completion, preference). */
export interface TrainLoader {
  readonly microBatchSize: number;
  next(): Batch;
  batch(step: number, micro: number): MicroBatch;
  localSampleIds(step: number): number[];
  microSampleIds(step: number, micro: number): number[];
  stateDict(): LoaderState;
  loadStateDict(s: LoaderState): void;
  close(): void;
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
  /** An example loader's rows (absent for text). */
  examples?: ExampleState;
}

export { positiveInt } from './batch_cursor.js';

export class DataLoader extends BatchCursor<{ x: Tensor; y: Tensor }> implements TrainLoader {
  readonly sources: LoaderSource[];
  private seedValue: number;
  private readonly sampler: Sampler;

  constructor(o: LoaderOptions) {
    super(o, o.prefetch ?? 0);
    if ((o.tokens === undefined) === (o.sources === undefined)) throw new Error('loader: give either tokens or sources');
    this.sources = o.sources ?? [{ corpus: TokenCorpus.fromArray(o.tokens!), weight: 1 }];
    if (this.sources.length === 0) throw new Error('loader: sources is empty; give at least one source');
    for (const s of this.sources) {
      if (!(Number.isFinite(s.weight) && s.weight > 0)) throw new Error(`loader: the weight of ${s.corpus.name} must be a positive number, got ${s.weight}`);
    }
    for (const s of this.sources) {
      if (s.corpus.starts(this.seqLen + 1) === 0) {
        throw new Error(
          `loader: ${s.corpus.length} tokens${this.sources.length > 1 || o.sources ? ` of ${s.corpus.name}` : ''} cannot hold one sample of data.seqLen=${this.seqLen} (+1 target token); ` +
            'use a longer text or a shorter data.seqLen',
        );
      }
    }
    this.seedValue = checkSeed(o.seed ?? 0);
    const geo = { seqLen: this.seqLen, globalBatch: this.globalBatch, dpRank: this.dpRank, dpSize: this.dpSize, microBatches: this.microBatches };
    this.sampler = new Sampler(this.sources, geo);
  }

  /** The tokens of a single in-memory source (the original constructor's `tokens`). */
  get tokens(): TokenArray | undefined {
    const specs = this.sources.length === 1 ? this.sources[0]!.corpus.specs : [];
    const s = specs.length === 1 ? specs[0]! : undefined;
    return s?.kind === 'memory' && s.lo === 0 && s.hi === s.tokens.length ? s.tokens : undefined;
  }

  /** Plain data a worker thread can rebuild this loader's sampler from. */
  samplerSpec(): SamplerSpec {
    return {
      sources: this.sources.map((s) => ({ specs: s.corpus.specs, name: s.corpus.name, vocabSize: s.corpus.vocabSize, weight: s.weight })),
      ...this.sampler.geo,
    };
  }

  get seed(): number {
    return this.seedValue;
  }
  /** Window starts of the whole global batch of `step` (identical on every rank; with one in-memory source, token offsets). */
  sampleOffsets(step: number): number[] {
    return this.sampler.samples(this.seedValue, step).map((s) => s.window);
  }

  /** Source and window of every sample of the global batch of `step`. */
  samples(step: number): Sample[] {
    return this.sampler.samples(this.seedValue, step);
  }

  protected read(step: number, micro: number): { x: Tensor; y: Tensor } {
    const T = this.seqLen;
    const B = this.microBatchSize;
    const xs = new Int32Array(B * T);
    const ys = new Int32Array(B * T);
    this.sampler.fill(this.seedValue, step, micro, xs, ys);
    return this.toTensors(xs, ys);
  }

  protected prefetchSource(): PrefetchSource {
    return { kind: 'windows', spec: this.samplerSpec(), seed: this.seedValue };
  }

  protected fromSlot(slot: Int32Array): { x: Tensor; y: Tensor } {
    // The native side takes ordinary buffers only: copy out of the shared ring.
    const bt = this.microBatchSize * this.seqLen;
    return this.toTensors(slot.slice(0, bt), slot.slice(bt, 2 * bt));
  }

  private toTensors(xs: Int32Array, ys: Int32Array): { x: Tensor; y: Tensor } {
    const shape = [this.microBatchSize, this.seqLen];
    return { x: tensor(xs, { shape, dtype: 'int64' }), y: tensor(ys, { shape, dtype: 'int64' }) };
  }

  stateDict(): LoaderState {
    return { step: this.stepValue, micro: this.microValue, seed: this.seedValue, globalBatch: this.globalBatch, seqLen: this.seqLen };
  }

  /** Restores the cursor and seed; the batch geometry must match the run that saved the state. */
  loadStateDict(s: LoaderState): void {
    if (s.examples) {
      throw new Error(`loader state was saved by a run on examples (data.format other than "text", data.pack = ${s.examples.pack}); this run reads text: resume with the data.format and data.source of that run`);
    }
    this.checkState(s, 'batches');
    this.seedValue = checkSeed(s.seed);
    this.setPosition(s);
  }
}

export function checkSeed(seed: number): number {
  if (!Number.isInteger(seed) || seed < 0 || seed > 0xffffffff) throw new Error(`loader: seed must be an integer in 0..2^32-1, got ${seed}`);
  return seed;
}
