// [Note: sequence shard] How a model written for whole sequences runs on a part of each sequence
// (context parallelism, src/parallel/context_parallel/) without knowing about ranks: inside
// withSequenceShard, the models ask this file for their tokens' positions (the learned position
// embedding's rows, the rotary angles) and for causal attention over the whole sequence, which the
// shard computes with the other ranks' keys and values. Outside it, positions are 0 .. T-1 and
// attention is the model's own. As withCrossEntropy does for the loss, the parallel layer swaps the
// implementation for the duration of a step, and the model code has one branch.
import { type Tensor, arange } from '../tensor/index.js';

export interface SequenceShard {
  /** The global positions (T,) int64 of the T tokens this rank holds of each sequence. */
  positions(T: number): Tensor;
  /**
   * Causal attention of this rank's queries over the whole sequence's keys and values:
   * q (B, H, T, hd), k and v (B, Hkv, T, hd) with H a multiple of Hkv (query head h reads key/value
   * head h / (H / Hkv)), scores scaled by `scale`. Returns (B, H, T, hd) in q's dtype.
   */
  attention(q: Tensor, k: Tensor, v: Tensor, scale: number): Tensor;
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

/** Positions (T,) int64 of the T tokens a model sees: 0 .. T-1, or the shard's global positions. */
export function tokenPositions(T: number): Tensor {
  return current ? current.positions(T) : arange(0, T);
}
