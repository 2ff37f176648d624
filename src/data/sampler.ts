// The tensor-free half of the loader (src/data/loader.ts): which windows each (step, micro) reads,
// and their tokens. The prefetch worker uses it without loading the native addon.
// See [Note: global batch partition] and [Note: sources and blending] in loader.ts.
import { TokenCorpus, type SegmentSpec } from './corpus_files.js';

/** One weighted source of samples. */
export interface LoaderSource {
  corpus: TokenCorpus;
  /** Relative share of the samples (> 0; normalised over the sources). */
  weight: number;
}

/** 32-bit integer hash (a bijection with good avalanche). */
function mix32(z: number): number {
  z = Math.imul(z ^ (z >>> 16), 0x21f0aaad);
  z = Math.imul(z ^ (z >>> 15), 0x735a2d97);
  return (z ^ (z >>> 15)) >>> 0;
}

const GOLDEN = 0x9e3779b9;

/** `count` uniform numbers in [0, 1) for (seed, step): a splitmix-style counter stream. */
export function uniformStream(seed: number, step: number, count: number): number[] {
  let state = mix32((mix32(seed) + Math.imul(step, GOLDEN)) | 0);
  const out = new Array<number>(count);
  for (let i = 0; i < count; i++) {
    state = (state + GOLDEN) | 0;
    const hi = mix32(state);
    state = (state + GOLDEN) | 0;
    const lo = mix32(state);
    out[i] = (hi * 2 ** 21 + (lo >>> 11)) / 2 ** 53; // 53 random bits in [0, 1)
  }
  return out;
}

/** `count` uniform integers in [0, range) for (seed, step). */
export function sampleStream(seed: number, step: number, count: number, range: number): number[] {
  return uniformStream(seed, step, count).map((u) => Math.floor(u * range));
}

const PHI = (Math.sqrt(5) - 1) / 2;

/** The source of global sample g under normalised cumulative weights (see [Note: sources and blending]). */
export function blendedSource(g: number, cumWeights: readonly number[], seed: number): number {
  const shift = mix32(seed ^ 0x5bd1e995) / 2 ** 32;
  const x = (g * PHI + shift) % 1;
  for (let k = 0; k < cumWeights.length - 1; k++) if (x < cumWeights[k]!) return k;
  return cumWeights.length - 1;
}

/** A sample of the global batch: which source, which window. */
export interface Sample {
  source: number;
  window: number;
}

/** What a worker needs to compute the same batches as a DataLoader (plain data only). */
export interface SamplerSpec {
  sources: { specs: SegmentSpec[]; name: string; vocabSize: number; weight: number }[];
  seqLen: number;
  globalBatch: number;
  dpRank: number;
  dpSize: number;
  microBatches: number;
}

/**
 * The tensor-free part of the loader: which windows a (step, micro) reads and the tokens of them.
 * DataLoader and the prefetch worker (src/data/prefetch_worker.ts) both use it.
 */
export class Sampler {
  readonly localBatch: number;
  readonly microBatchSize: number;
  private readonly cum: number[];
  private readonly win: Int32Array;

  constructor(readonly sources: LoaderSource[], readonly geo: Omit<SamplerSpec, 'sources'>) {
    const total = sources.reduce((a, s) => a + s.weight, 0);
    let acc = 0;
    this.cum = sources.map((s) => (acc += s.weight / total));
    this.localBatch = geo.globalBatch / geo.dpSize;
    this.microBatchSize = this.localBatch / geo.microBatches;
    this.win = new Int32Array(geo.seqLen + 1);
  }

  /** The whole global batch of `step` (identical on every rank). */
  samples(seed: number, step: number): Sample[] {
    const n = this.geo.seqLen + 1;
    const u = uniformStream(seed, step, this.geo.globalBatch);
    if (this.sources.length === 1) {
      const range = this.sources[0]!.corpus.starts(n);
      return u.map((x) => ({ source: 0, window: Math.floor(x * range) }));
    }
    return u.map((x, i) => {
      const k = blendedSource(step * this.geo.globalBatch + i, this.cum, seed);
      return { source: k, window: Math.floor(x * this.sources[k]!.corpus.starts(n)) };
    });
  }

  /** Fills xs, ys (B * T each) with micro-batch `micro` of this rank at `step`. */
  fill(seed: number, step: number, micro: number, xs: Int32Array, ys: Int32Array): void {
    const all = this.samples(seed, step);
    const T = this.geo.seqLen;
    const first = this.geo.dpRank * this.localBatch + micro * this.microBatchSize;
    for (let b = 0; b < this.microBatchSize; b++) {
      const s = all[first + b]!;
      this.sources[s.source]!.corpus.window(s.window, T + 1, this.win, 0);
      xs.set(this.win.subarray(0, T), b * T);
      ys.set(this.win.subarray(1, T + 1), b * T);
    }
  }
}

