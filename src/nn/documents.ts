// [Note: documents] Rows that hold several documents (packed examples, a preference pair): the
// loader describes where each document starts (src/data/examples), and inside withDocuments the
// models take positions from it (each document starts at 0) and mask attention to each document's
// own earlier tokens, so an example's logits in a packed row equal its logits alone. It is an
// ambient context like withSequenceShard (sequence_shard.ts): the layouts set it per micro-batch
// around its forward and its backward (recomputes see the same documents), and model code has one
// branch. Outside it a row is one sequence.
import type { DType, Tensor } from '../tensor/index.js';
import type { ProcessGroup } from '../distributed/process_group.js';

export interface DocumentLayout {
  /** (B, T) int64: each token's index within its document. */
  readonly positions: Tensor;
  /** (B, T) int64: each token's document number within its row, non-decreasing along the row. */
  readonly ids: Tensor;
  /** Under context parallelism: the whole rows' ids (B, T x cp) the ring masks with; ids/positions are this rank's chunks. */
  readonly full?: Tensor;
  /** (B, 1, T, T) bool: query i may read key j (j <= i, same document). Built once, kept. */
  allowed(): Tensor;
  /** An additive mask (B x heads, group x T, T) of 0 / -inf in dtype, for the baddbmm attention forms. */
  bias(dtype: DType, heads: number, group: number): Tensor;
  /** This rank's context-parallel chunks of positions and ids, with `full` the whole rows' ids. */
  chunked(group: ProcessGroup): DocumentLayout;
  dispose(): void;
}

let current: DocumentLayout | undefined;

/** Runs fn with the models' positions and attention masks taken from `d` (none: rows are single sequences). */
export function withDocuments<T>(d: DocumentLayout | undefined, fn: () => T): T {
  const prev = current;
  current = d;
  try {
    return fn();
  } finally {
    current = prev;
  }
}

/** The documents in effect, if any. */
export function documents(): DocumentLayout | undefined {
  return current;
}
