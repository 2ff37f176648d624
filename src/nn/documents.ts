// [Note: documents] Rows that hold several documents (packed examples, a preference pair): the
// loader describes where each document starts (src/data/examples), and inside withDocuments the
// models take positions from it (each document starts at 0) and mask attention to each document's
// own earlier tokens, so an example's logits in a packed row equal its logits alone. It is an
// ambient context like withSequenceShard (sequence_shard.ts): the layouts set it per micro-batch
// around its forward and its backward (recomputes see the same documents), and model code has one
// branch. Outside it a row is one sequence. Under context parallelism the layout is cut into the
// rank's chunks (chunked()), the positions with it, and the ring masks each block from the whole
// rows' ids ([Note: ring documents] in src/parallel/context_parallel/ring_attention.ts).
import { type DType, type Tensor, cat, keep, noGrad, ones, tensor, tidy, zerosLike } from '../tensor/index.js';
import type { ProcessGroup } from '../distributed/process_group.js';

export interface DocumentLayout {
  /** (B, T) int64: each token's index within its document. */
  readonly positions: Tensor;
  /** (B, T) int64: each token's document number within its row, non-decreasing along the row. */
  readonly ids: Tensor;
  /** Under context parallelism: the whole rows' ids (B, T x cp) the ring masks with; ids/positions are this rank's chunks. */
  readonly full?: Tensor;
  /**
   * (B, 1, T, T) bool: query i may read key j (j <= i, same document; with a sliding `window` > 0
   * also i - j < window). Built once per window, kept.
   */
  allowed(window?: number): Tensor;
  /** An additive mask (B x heads, group x T, T) of 0 / -inf in dtype, for the baddbmm attention forms (`window` as allowed's). */
  bias(dtype: DType, heads: number, group: number, window?: number): Tensor;
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

/**
 * The layout of B rows of T tokens from the loader's per-token arrays (B x T each, row-major):
 * `positions` = each token's index within its document, `ids` = its document's number within the
 * row, non-decreasing (a row's trailing pads are one more document). The tensors are made here and
 * the masks on first use; dispose() frees them all.
 */
export function documentLayout(positions: Int32Array, ids: Int32Array, B: number, T: number): DocumentLayout {
  if (positions.length !== B * T || ids.length !== B * T) {
    throw new Error(`documentLayout: ${B} rows of ${T} tokens need ${B * T} positions and ids, got ${positions.length} and ${ids.length}`);
  }
  for (let b = 0; b < B; b++) {
    for (let t = 0, o = b * T; t < T; t++) {
      const i = o + t;
      const starts = t === 0 || ids[i] !== ids[i - 1];
      if (t > 0 && ids[i]! < ids[i - 1]!) throw new Error(`documentLayout: row ${b}: document ids must not decrease along the row (token ${t}: ${ids[i]} after ${ids[i - 1]})`);
      if (positions[i] !== (starts ? 0 : positions[i - 1]! + 1)) {
        throw new Error(`documentLayout: row ${b}, token ${t}: position ${positions[i]} but ${starts ? 'a document starts there (0)' : `the previous token is at ${positions[i - 1]}`}`);
      }
    }
  }
  const make = (a: Int32Array) => keep(tensor(a, { shape: [B, T], dtype: 'int64' }));
  return new PackedRows(make(positions), make(ids));
}

/** Whole rows on one process (or one pipeline stage, one tensor-parallel rank): the masks are built here. */
class PackedRows implements DocumentLayout {
  private readonly allowedMasks = new Map<number, Tensor>();
  private readonly biases = new Map<string, Tensor>();
  private readonly chunks = new Map<ProcessGroup, DocumentLayout>();
  private disposed = false;
  constructor(readonly positions: Tensor, readonly ids: Tensor) {}

  allowed(window = 0): Tensor {
    this.live();
    let m = this.allowedMasks.get(window);
    if (!m) {
      const [, T] = this.ids.shape as [number, number];
      m = noGrad(() => keep(tidy(() => {
        const same = this.ids.unsqueeze(2).eq(this.ids.unsqueeze(1)); // (B, T, T): query i, key j
        // Within a document positions advance with the index, so the window is on i - j.
        const band = window > 0 ? ones([T, T], { dtype: 'bool' }).tril().triu(-(window - 1)) : ones([T, T], { dtype: 'bool' }).tril();
        return same.logicalAnd(band).unsqueeze(1);
      })));
      this.allowedMasks.set(window, m);
    }
    return m;
  }

  bias(dtype: DType, heads: number, group: number, window = 0): Tensor {
    this.live();
    const key = `${dtype}:${heads}:${group}:${window}`;
    let b = this.biases.get(key);
    if (!b) {
      const allowed = this.allowed(window);
      const [B, , T] = allowed.shape as [number, number, number, number];
      // Entry n heads + h of the batched product is row n's head h; its rows are `group` query
      // heads' T queries stacked (the Llama's grouped-query form): the same (T, T) mask each time.
      b = noGrad(() => keep(tidy(() => zerosLike(allowed, { dtype }).maskedFill(allowed.logicalNot(), -Infinity)
        .unsqueeze(2).expand(B, heads, group, T, T).reshape(B * heads, group * T, T))));
      this.biases.set(key, b);
    }
    return b;
  }

  chunked(g: ProcessGroup): DocumentLayout {
    this.live();
    let d = this.chunks.get(g);
    if (!d) {
      d = new ChunkedRows(keep(rankChunks(this.positions, g)), keep(rankChunks(this.ids, g)), this.ids);
      this.chunks.set(g, d);
    }
    return d;
  }

  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    for (const d of this.chunks.values()) d.dispose();
    for (const b of this.biases.values()) b.dispose();
    for (const m of this.allowedMasks.values()) m.dispose();
    this.allowedMasks.clear();
    this.positions.dispose();
    this.ids.dispose();
    this.chunks.clear();
    this.biases.clear();
  }

  private live(): void {
    if (this.disposed) throw new Error('documents: this layout was disposed (the step that owned it has ended)');
  }
}

/**
 * A context-parallel rank's part of the rows: its two chunks' positions and ids, and the whole rows'
 * ids (`full`, owned by the rows it was cut from) for the ring's masks. Attention under context
 * parallelism is the ring's (sequence_shard.ts), so there are no dense masks here.
 */
class ChunkedRows implements DocumentLayout {
  constructor(readonly positions: Tensor, readonly ids: Tensor, readonly full: Tensor) {}
  allowed(): Tensor {
    throw new Error('documents: a context-parallel chunk has no dense mask; its attention is the ring\'s (documents().full)');
  }
  bias(): Tensor {
    return this.allowed();
  }
  chunked(): DocumentLayout {
    throw new Error('documents: these rows are already cut into context-parallel chunks');
  }
  dispose(): void {
    this.positions.dispose();
    this.ids.dispose();
  }
}

/**
 * cp rank r's chunks r and 2 cp - 1 - r of every row of t (B, T), in that order: the cut of
 * [Note: load-balanced chunks] (src/parallel/context_parallel/ring_attention.ts), which the tokens
 * themselves get from the context-parallel layout.
 */
function rankChunks(t: Tensor, g: ProcessGroup): Tensor {
  const C = g.size, T = t.shape[1]!;
  if (T % (2 * C) !== 0) throw new Error(`documents: rows of ${T} tokens do not split into ${2 * C} chunks (2 x parallel.cp)`);
  const c = T / (2 * C), a = g.rank, b = 2 * C - 1 - g.rank;
  return noGrad(() => cat([t.narrow(1, a * c, c), t.narrow(1, b * c, c)], 1));
}
