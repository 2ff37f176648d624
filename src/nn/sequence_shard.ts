// [Note: sequence shard] How a model written for whole sequences runs on a part of each sequence
// (context parallelism, src/parallel/context_parallel/) without knowing about ranks: inside
// withSequenceShard, the models ask this file for their tokens' positions (the learned position
// embedding's rows, the rotary angles), for causal attention over the whole sequence, which the
// shard computes with the other ranks' keys and values, and for the whole sequences of a per-token
// tensor when a decision is taken over all the tokens of a batch (MoE routing, src/nn/moe.ts). Outside it, positions are 0 .. T-1 and
// attention is the model's own. As withCrossEntropy does for the loss, the parallel layer swaps the
// implementation for the duration of a step, and the model code has one branch.
import { type Tensor, arange } from '../tensor/index.js';
import { documents } from './documents.js';

export interface SequenceShard {
  /** The global positions (T,) int64 of the T tokens this rank holds of each sequence. */
  positions(T: number): Tensor;
  /**
   * Causal attention of this rank's queries over the whole sequence's keys and values:
   * q (B, H, T, hd), k and v (B, Hkv, T, hd) with H a multiple of Hkv (query head h reads key/value
   * head h / (H / Hkv)), scores scaled by `scale`. With a sliding `window` > 0 a query at global
   * index i reads keys j with i - j < window only. Returns (B, H, T, hd) in q's dtype.
   */
  attention(q: Tensor, k: Tensor, v: Tensor, scale: number, window?: number): Tensor;
  /**
   * Every rank's part of t (B, T, ...) gathered into whole sequences (B, T x ranks, ...), tokens in
   * their global order: for decisions taken over all the tokens of a batch (an MoE layer's routing,
   * its capacity and its balance statistics). A collective without gradient.
   */
  wholeSequences(t: Tensor): Tensor;
}

let current: SequenceShard | undefined;

/** Runs fn with every model's positions and attention taken from `shard` (see the note above). */
export function withSequenceShard<T>(shard: SequenceShard, fn: () => T): T {
  const prev = current;
  current = shard;
  try {
    return fn();
  } finally {
    current = prev;
  }
}

/** The shard in effect, if any. */
export function sequenceShard(): SequenceShard | undefined {
  return current;
}

/**
 * Positions of the T tokens a model sees: (B, T) int64 within each document when rows hold several
 * ([Note: documents] in documents.ts; under a shard, this rank's chunks of them), else (T,): the
 * shard's global positions, or 0 .. T-1.
 */
export function tokenPositions(T: number): Tensor {
  const docs = documents();
  if (docs) return docs.positions;
  return current ? current.positions(T) : arange(0, T);
}
