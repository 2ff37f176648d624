// [Note: kv cache] Generation keeps each attention layer's keys and values so the prompt is run once
// (prefill) and every new token costs one position (decode). Buffers are allocated once per layer
// at the longest length the run can reach, (B, nKv, maxLen, hs), and written in place; a layer
// reads a view of the filled part, so a step allocates nothing that grows with the context.
//
// Several prompts of different lengths share one batch left-padded: row b starts with pad[b]
// padding tokens that no query may attend to, and its positions count from its first real token,
// so every row computes what it would alone (the same positions, the same keys).
import { type Tensor, arange, empty, keep, tensor } from '../tensor/index.js';

export class KVCache {
  /** Tokens held per row (padding included). */
  length = 0;
  private readonly keys: (Tensor | undefined)[];
  private readonly values: (Tensor | undefined)[];
  private readonly padIds: Tensor; // (B, 1) int64
  private readonly padded: boolean;
  /** documentIds() of the current step (every layer asks for the same), until advance(). */
  private stepDocs?: { T: number; q: Tensor; k: Tensor };

  constructor(readonly layers: number, readonly batch: number, readonly maxLen: number, readonly pad: readonly number[] = Array<number>(batch).fill(0)) {
    if (pad.length !== batch) throw new Error(`KVCache: ${pad.length} pad counts for a batch of ${batch}`);
    this.keys = Array<Tensor | undefined>(layers).fill(undefined);
    this.values = Array<Tensor | undefined>(layers).fill(undefined);
    this.padded = pad.some((p) => p > 0);
    this.padIds = keep(tensor(Float64Array.from(pad), { shape: [batch, 1], dtype: 'int64' }));
  }

  /**
   * Positions of the next T tokens, int64: each row counts from its first real token (padding at 0),
   * (B, T); without padding every row's are the same, (T), which broadcasts over the batch.
   */
  positions(T: number): Tensor {
    const p = arange(this.length, this.length + T, 1, { dtype: 'int64' });
    return this.padded ? p.view(1, T).sub(this.padIds).clamp(0) : p;
  }

  /** Whether rows start at different positions (left-padded prompts of different lengths). */
  get isPadded(): boolean {
    return this.padded;
  }

  /**
   * Whether the next T queries may see each key, (B, 1, T, length + T) bool (undefined: all): causal, and never a
   * padding key, except a padding query's own (its row would otherwise be all -inf, and the NaN of
   * its softmax would reach real rows through 0 x NaN in the next layer's products). With a sliding
   * `window` > 0, a query at index i sees keys j with i - j < window only (left padding shifts a
   * row's positions and indices alike, so the difference is the positions').
   */
  allowed(T: number, window = 0): Tensor | undefined {
    const Tk = this.length + T;
    const windowed = window > 0 && Tk > window;
    // One new token with no padding sees every key: no mask at all (the common decoding step).
    if (T === 1 && !this.padded && !windowed) return undefined;
    const key = arange(0, Tk, 1, { dtype: 'int64' }).view(1, Tk);
    const query = arange(this.length, Tk, 1, { dtype: 'int64' }).view(T, 1);
    const causal = (windowed ? key.le(query).logicalAnd(key.gt(query.sub(window))) : key.le(query)).view(1, 1, T, Tk);
    const self = key.eq(query).view(1, 1, T, Tk);
    const real = key.ge(this.padIds).view(this.batch, 1, 1, Tk); // (B, Tk): not padding
    return causal.logicalAnd(real.logicalOr(self));
  }

  /**
   * The mask of allowed() as document ids for the fused kernel ([Note: kernel choice]), int64: real
   * tokens are document 0 and padding token j its own document -(j + 1), so a padding query sees
   * only itself and a real one no padding. Queries (B, T) and keys (B, length + T); undefined
   * without padding (causal and the window are the kernel's own arguments). Built once per step
   * (the first layer to ask) and held by the cache until advance().
   */
  documentIds(T: number): { q: Tensor; k: Tensor } | undefined {
    if (!this.padded) return undefined;
    if (this.stepDocs?.T !== T) {
      this.dropStepDocs();
      const Tk = this.length + T;
      const key = arange(0, Tk, 1, { dtype: 'int64' }).view(1, Tk);
      const k = keep(key.add(1).mul(key.lt(this.padIds).to('int64')).neg()); // (B, Tk)
      this.stepDocs = { T, q: keep(k.narrow(1, this.length, T)), k };
    }
    return { q: this.stepDocs.q, k: this.stepDocs.k };
  }

  private dropStepDocs(): void {
    this.stepDocs?.q.dispose();
    this.stepDocs?.k.dispose();
    this.stepDocs = undefined;
  }

  /**
   * Stores a layer's keys and values of the new tokens, (B, nKv, T, hs), after those held; returns
   * views of all of them, (B, nKv, length + T, hs). Call advance(T) once every layer has appended.
   */
  append(layer: number, k: Tensor, v: Tensor): [Tensor, Tensor] {
    const [B, h, T, hs] = k.shape as [number, number, number, number];
    if (this.length + T > this.maxLen) throw new Error(`KVCache: ${this.length + T} tokens exceed the cache's ${this.maxLen}`);
    if (this.keys[layer] === undefined) {
      this.keys[layer] = keep(empty([B, h, this.maxLen, hs], { dtype: k.dtype }));
      this.values[layer] = keep(empty([B, h, this.maxLen, hs], { dtype: v.dtype }));
    }
    const K = this.keys[layer]!, V = this.values[layer]!;
    K.narrow(2, this.length, T).copy_(k);
    V.narrow(2, this.length, T).copy_(v);
    return [K.narrow(2, 0, this.length + T), V.narrow(2, 0, this.length + T)];
  }

  advance(T: number): void {
    this.length += T;
    this.dropStepDocs();
  }

  dispose(): void {
    for (const t of [...this.keys, ...this.values]) t?.dispose();
    this.padIds.dispose();
    this.dropStepDocs();
  }
}
