// Cross-entropy straight from the hidden state: the head's matmul and the loss in one function, a
// chunk of tokens at a time, so the (tokens x vocab) logits and their gradient never exist whole.
//
// [Note: chunked linear cross-entropy]
// Per row r (z = h_r W^T + b, float32 under bf16-mixed, as the eager loss casts its logits):
//   lse_r  = m_r + log Σ_j exp(z_j - m_r)                  (m_r the row's max)
//   loss_r = lse_r - (1 - ε) z_t - ε mean_j z_j            (ε label smoothing, t the target; 0 if ignored)
// which is PyTorch's (1 - ε) nll + ε smooth_loss / V. Forward keeps only lse (N floats); backward
// recomputes each chunk's logits and forms
//   dz = g (softmax(z) - (1 - ε) onehot(t) - ε / V)  on trained rows, 0 on ignored ones,
// then dHidden[chunk] = dz W and dW += dz^T h, db += Σ_rows dz. Peak extra memory is a few
// chunk-sized (rows x V) temporaries instead of two (N x V) tensors. A tied head (W the embedding's
// matrix) needs nothing special: the node returns dW and the engine accumulates it into the same leaf.
// The vocab-parallel form (each tensor-parallel rank a shard of W's rows) all-reduces the row's max,
// Σ exp and picked logits per chunk, as vocabParallelCrossEntropy does for whole logits.
import { type Tensor, defineFunction, arange, cat, zeros, tidy, keep } from '../../tensor/index.js';

/** Bytes one chunk's float32 logits may take: a few MiB keeps a chunk's temporaries in cache-sized pieces and its GEMMs wide. */
export const CHUNK_LOGIT_BYTES = 4 * 2 ** 20;

/** Rows per chunk: as many as fit CHUNK_LOGIT_BYTES of float32 (or float64) logits over `vocab` columns, at least 1. */
export function chunkRows(n: number, vocab: number, elemBytes = 4): number {
  return Math.max(1, Math.min(n, Math.floor(CHUNK_LOGIT_BYTES / (vocab * elemBytes))));
}

/** Calls of linearCrossEntropy in this process (how a run shows its loss took the fused path). */
export const linearCrossEntropyCalls = { count: 0 };

export interface LinearCrossEntropyOptions {
  bias?: Tensor;
  ignoreIndex?: number;
  labelSmoothing?: number;
  /** Rows per chunk (default chunkRows(N, V)). */
  chunk?: number;
  /** Set when `weight` (and bias) is this rank's shard of the vocabulary's rows. */
  vocabShard?: VocabShard;
}

/**
 * A vocabulary-sharded head: shard `index` of `parts` holds rows [index V/parts, (index+1) V/parts),
 * and allReduce combines a contiguous per-row tensor over the shards in place (tensor parallelism
 * passes its counted all-reduce, src/parallel/tensor_parallel/comm.ts).
 */
export interface VocabShard {
  index: number;
  parts: number;
  allReduce(t: Tensor, op: 'sum' | 'max'): void;
}

/**
 * Σ over trained rows of cross-entropy(hidden W^T + b, targets): hidden (N, d), weight (V, d) or
 * its vocabulary shard, targets (N) int64 with ignored entries = ignoreIndex. Returns the summed
 * loss (a differentiable scalar in hidden's float dtype, float32 for bfloat16) and the trained rows
 * (the count a token criterion divides by).
 */
export function linearCrossEntropy(hidden: Tensor, weight: Tensor, targets: Tensor, opts: LinearCrossEntropyOptions = {}): { loss: Tensor; count: number } {
  if (hidden.ndim !== 2 || weight.ndim !== 2 || hidden.shape[1] !== weight.shape[1]) {
    throw new Error(`linearCrossEntropy: hidden (N, d) and weight (V, d) expected, got [${hidden.shape}] and [${weight.shape}]`);
  }
  if (targets.ndim !== 1 || targets.shape[0] !== hidden.shape[0]) throw new Error(`linearCrossEntropy: targets (N) expected for hidden [${hidden.shape}], got [${targets.shape}]`);
  const ignore = opts.ignoreIndex ?? -100;
  linearCrossEntropyCalls.count++;
  const count = tidy(() => targets.ne(ignore).sum().item());
  const loss = fused(hidden, weight, opts.bias, targets, {
    ignore, eps: opts.labelSmoothing ?? 0, chunk: opts.chunk, group: opts.vocabShard,
  } satisfies Settings);
  return { loss, count };
}

interface Settings { ignore: number; eps: number; chunk?: number; group?: VocabShard }

/** float64 stays float64; anything else computes its logits in float32. */
function mathDtype(t: Tensor): 'float32' | 'float64' {
  return t.dtype === 'float64' ? 'float64' : 'float32';
}

/** One chunk's logits (rows, V local) in the math dtype. */
function chunkLogits(h: Tensor, w: Tensor, b: Tensor | undefined): Tensor {
  let z = h.matmul(w.t());
  if (b) z = z.add(b);
  const d = mathDtype(h);
  return z.dtype === d ? z : z.to(d);
}

/** Per row of the chunk: what the whole vocabulary's rows need from this rank's columns, summed over the group. */
function rowTerms(z: Tensor, t: Tensor, lo: number, s: Settings, needSum: boolean): { m: Tensor; lse: Tensor; zt: Tensor; zsum?: Tensor } {
  const Vl = z.shape[1]!;
  const m = z.amax(-1, true).contiguous();
  if (s.group) s.group.allReduce(m, 'max');
  const e = z.sub(m).exp().sum(-1).contiguous();
  if (s.group) s.group.allReduce(e, 'sum');
  const lse = e.log().add(m.squeeze(1));
  const mine = t.ge(lo).logicalAnd(t.lt(lo + Vl));
  const zt = z.gather(1, t.sub(lo).clamp(0, Vl - 1).unsqueeze(1)).squeeze(1).mul(mine.to(z.dtype)).contiguous();
  if (s.group) s.group.allReduce(zt, 'sum');
  let zsum: Tensor | undefined;
  if (needSum) {
    zsum = z.sum(-1).contiguous();
    if (s.group) s.group.allReduce(zsum, 'sum');
  }
  return { m, lse, zt, ...(zsum ? { zsum } : {}) };
}

const fused = defineFunction<[Tensor, Tensor, Tensor | undefined, Tensor, Settings]>({
  forward(ctx, hidden, weight, bias, targets, s) {
    const N = hidden.shape[0]!, Vl = weight.shape[0]!;
    const V = Vl * (s.group?.parts ?? 1);
    const lo = (s.group?.index ?? 0) * Vl;
    const c = s.chunk ?? chunkRows(N, Vl, mathDtype(hidden) === 'float64' ? 8 : 4);
    const total = tidy(() => {
      const parts: Tensor[] = [], lses: Tensor[] = [];
      for (let r = 0; r < N; r += c) {
        const n = Math.min(c, N - r);
        tidy(() => {
          const t = targets.narrow(0, r, n);
          const z = chunkLogits(hidden.narrow(0, r, n), weight, bias);
          const { lse, zt, zsum } = rowTerms(z, t, lo, s, s.eps !== 0);
          let row = lse.sub(zt, 1 - s.eps);
          if (zsum) row = row.sub(zsum, s.eps / V);
          parts.push(keep(row.mul(t.ne(s.ignore).to(row.dtype)).sum()));
          lses.push(keep(lse));
        });
      }
      const lse = lses.length === 1 ? lses[0]! : cat(lses);
      ctx.saveForBackward(hidden, weight, targets, lse, ...(bias ? [bias] : []));
      return keep(parts.length === 1 ? parts[0]! : cat(parts.map((p) => p.reshape(1))).sum());
    });
    ctx.state.chunk = c;
    ctx.state.s = s;
    return total;
  },
  backward(ctx, g) {
    const [hidden, weight, targets, lse, bias] = ctx.savedTensors as [Tensor, Tensor, Tensor, Tensor, Tensor | undefined];
    const s = ctx.state.s as Settings;
    const [needH, needW, needB] = ctx.needsInputGrad as [boolean, boolean, boolean];
    const N = hidden.shape[0]!, Vl = weight.shape[0]!;
    const V = Vl * (s.group?.parts ?? 1);
    const lo = (s.group?.index ?? 0) * Vl;
    const c = ctx.state.chunk as number;
    const gs = g.to(mathDtype(hidden));
    const cols = arange(lo, lo + Vl, 1, { dtype: 'int64' });
    const dHs: Tensor[] = [];
    let dW = needW ? zeros(weight.shape, { dtype: mathDtype(hidden) }) : undefined;
    let dB = needB && bias ? zeros(bias.shape, { dtype: mathDtype(hidden) }) : undefined;
    for (let r = 0; r < N; r += c) {
      const n = Math.min(c, N - r);
      tidy(() => {
        const t = targets.narrow(0, r, n);
        const h = hidden.narrow(0, r, n);
        const z = chunkLogits(h, weight, bias);
        // softmax from the saved whole-vocabulary logsumexp, minus the target and smoothing terms
        let dz = z.sub(lse.narrow(0, r, n).unsqueeze(1)).exp();
        dz = dz.sub(cols.unsqueeze(0).eq(t.unsqueeze(1)).to(dz.dtype), 1 - s.eps);
        if (s.eps !== 0) dz = dz.sub(s.eps / V);
        dz = dz.mul(t.ne(s.ignore).to(dz.dtype).unsqueeze(1).mul(gs));
        const dzc = dz.dtype === hidden.dtype ? dz : dz.to(hidden.dtype);
        if (needH) dHs.push(keep(dzc.matmul(weight)));
        if (dW) dW.add_(dzc.t().matmul(h));
        if (dB) dB.add_(dz.sum(0));
      });
    }
    const dH = needH ? (dHs.length === 1 ? dHs[0]! : cat(dHs)) : undefined;
    return [dH, dW, dB, undefined, undefined];
  },
}, 'LinearCrossEntropy');
