// Cross-entropy straight from the hidden state: the head's matmul and the loss in one function, a
// chunk of tokens at a time, so the (tokens x vocab) logits and their gradient never exist whole.
//
// [Note: chunked linear cross-entropy]
// Per row r (z = h_r W^T + b, float32 under bf16-mixed, as the eager loss casts its logits):
//   lse_r  = m_r + log Σ_j exp(z_j - m_r)                  (m_r the row's max)
//   loss_r = lse_r - (1 - ε) z_t - ε mean_j z_j            (ε label smoothing, t the target; 0 if ignored)
// which is PyTorch's (1 - ε) nll + ε smooth_loss / V. The logits are made one tile (rows x vocabulary
// columns, a few MiB: tileShape) at a time. Forward merges each tile's max and Σ exp into the row's
// running ones (an online softmax) and keeps only lse (N floats); backward makes each tile again and forms
//   dz = g (softmax(z) - (1 - ε) onehot(t) - ε / V)  on trained rows, 0 on ignored ones,
// then dHidden[rows] += dz W[cols], dW[cols] += dz^T h[rows], db[cols] += Σ_rows dz. Peak extra memory is
// a few tile-sized temporaries plus the gradients themselves, instead of two (N x V) tensors. A tied
// head (W the embedding's matrix) needs nothing special: the node returns dW and the engine
// accumulates it into the same leaf.
// The vocab-parallel form (each tensor-parallel rank a shard of W's rows) makes each rank's per-row
// logsumexp over its own columns, then all-reduces once, for all rows, what vocabParallelCrossEntropy
// all-reduces for whole logits: the max, the sums of exponentials (rescaled to it), the target logits
// (and, with smoothing, the logit sums). Backward needs no communication: each rank's dHidden is its
// columns' part, summed by the column-parallel input's backward (copyToRegion).
import { type Tensor, defineFunction, full, zeros, tidy } from '../../tensor/index.js';

/** Bytes one tile of logits may take (float32, or float64 in a float64 run). */
export const CHUNK_LOGIT_BYTES = 4 * 2 ** 20;

/**
 * A tile of (rows x columns) logits within CHUNK_LOGIT_BYTES, as square as the shape allows: each
 * tile's backward adds its rows' hidden gradient (rows x d) and its columns' weight gradient
 * (columns x d), so the traffic of those additions, N V d (1 / rows + 1 / columns), is least for
 * rows = columns = sqrt(elements). 4 MiB of float32 is 1024 x 1024; a run of 32k tokens over a 128k
 * vocabulary makes 4096 tiles.
 */
export function tileShape(n: number, vocab: number, elemBytes = 4): { rows: number; cols: number } {
  const elems = Math.max(1, Math.floor(CHUNK_LOGIT_BYTES / elemBytes));
  const side = Math.floor(Math.sqrt(elems));
  const rows = Math.max(1, Math.min(n, vocab >= side ? side : Math.floor(elems / vocab)));
  return { rows, cols: Math.max(1, Math.min(vocab, Math.floor(elems / rows))) };
}

/** Calls of linearCrossEntropy in this process (how a run shows its loss took the fused path). */
export const linearCrossEntropyCalls = { count: 0 };

export interface LinearCrossEntropyOptions {
  bias?: Tensor;
  ignoreIndex?: number;
  labelSmoothing?: number;
  /** Rows and vocabulary columns per tile (default tileShape(N, V)). */
  chunk?: number;
  vocabChunk?: number;
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
    ignore, eps: opts.labelSmoothing ?? 0, chunk: opts.chunk, vocabChunk: opts.vocabChunk, group: opts.vocabShard,
  } satisfies Settings);
  return { loss, count };
}

interface Settings { ignore: number; eps: number; chunk?: number; vocabChunk?: number; group?: VocabShard }

/** float64 stays float64; anything else computes its logits in float32. */
function mathDtype(t: Tensor): 'float32' | 'float64' {
  return t.dtype === 'float64' ? 'float64' : 'float32';
}

/** One tile's logits (rows, columns) in the math dtype. */
function tileLogits(h: Tensor, w: Tensor, b: Tensor | undefined): Tensor {
  let z = h.matmul(w.t());
  if (b) z = z.add(b);
  const d = mathDtype(h);
  return z.dtype === d ? z : z.to(d);
}

/** The tiles of (N x V local) logits: rows [r, r + n) x columns [c, c + m). */
function tiles(N: number, Vl: number, s: Settings, dtype: 'float32' | 'float64'): { r: number; n: number; c: number; m: number; firstCol: boolean }[] {
  const shape = tileShape(N, Vl, dtype === 'float64' ? 8 : 4);
  const R = s.chunk ?? shape.rows, C = s.vocabChunk ?? (s.chunk ? Math.max(1, Math.min(Vl, Math.floor(shape.rows * shape.cols / R))) : shape.cols);
  const out: { r: number; n: number; c: number; m: number; firstCol: boolean }[] = [];
  for (let r = 0; r < N; r += R) for (let c = 0; c < Vl; c += C) out.push({ r, n: Math.min(R, N - r), c, m: Math.min(C, Vl - c), firstCol: c === 0 });
  return out;
}

const fused = defineFunction<[Tensor, Tensor, Tensor | undefined, Tensor, Settings]>({
  forward(ctx, hidden, weight, bias, targets, s) {
    const N = hidden.shape[0]!, Vl = weight.shape[0]!;
    const V = Vl * (s.group?.parts ?? 1);
    const lo = (s.group?.index ?? 0) * Vl;
    const dt = mathDtype(hidden);
    const total = tidy(() => {
      // Per row over this rank's columns, tile by tile: the running max m and Σ exp(z - m) (merged
      // as an online softmax does), the target's logit where it falls here, and Σ z for smoothing.
      const m = full([N], -Infinity, { dtype: dt }), se = zeros([N], { dtype: dt }), zt = zeros([N], { dtype: dt }), zs = zeros([N], { dtype: dt });
      for (const { r, n, c, m: cols, firstCol } of tiles(N, Vl, s, dt)) {
        tidy(() => {
          const z = tileLogits(hidden.narrow(0, r, n), weight.narrow(0, c, cols), bias?.narrow(0, c, cols));
          const mr = m.narrow(0, r, n), ser = se.narrow(0, r, n);
          const mt = z.amax(-1);
          const mNew = firstCol ? mt : mr.maximum(mt);
          const st = z.sub(mNew.unsqueeze(1)).exp().sum(-1);
          ser.copy_(firstCol ? st : ser.mul(mr.sub(mNew).exp()).add(st));
          mr.copy_(mNew);
          const t = targets.narrow(0, r, n).sub(lo + c);
          const here = t.ge(0).logicalAnd(t.lt(cols));
          zt.narrow(0, r, n).add_(z.gather(1, t.clamp(0, cols - 1).unsqueeze(1)).squeeze(1).mul(here.to(dt)));
          if (s.eps !== 0) zs.narrow(0, r, n).add_(z.sum(-1));
        });
      }
      // Over the vocabulary's shards: one all-reduce each of the row max, the rescaled sums, the target logits and the logit sums.
      let lse: Tensor;
      if (s.group) {
        const local = se.log().add(m);
        const M = local.clone();
        s.group.allReduce(M, 'max');
        const S = local.sub(M).exp().contiguous();
        s.group.allReduce(S, 'sum');
        s.group.allReduce(zt, 'sum');
        if (s.eps !== 0) s.group.allReduce(zs, 'sum');
        lse = S.log().add(M);
      } else {
        lse = se.log().add(m);
      }
      let row = lse.sub(zt, 1 - s.eps);
      if (s.eps !== 0) row = row.sub(zs, s.eps / V);
      ctx.saveForBackward(hidden, weight, targets, lse, ...(bias ? [bias] : []));
      return row.mul(targets.ne(s.ignore).to(dt)).sum(); // moves to the forward's scope (keep() would outlive the step's)
    });
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
    const dt = mathDtype(hidden);
    // g and the ignored rows folded into one per-row scale
    const scale = targets.ne(s.ignore).to(dt).mul(g.to(dt));
    // The target's and smoothing's terms of dz are (1 - ε) onehot(t) and ε / V on every column: their
    // parts of the gradients are made once here (a gather, an index add, column sums), so each tile
    // only makes softmax(z) times the row's scale.
    const tl = targets.sub(lo);
    const mine = tl.ge(0).logicalAnd(tl.lt(Vl)).to(dt).mul(scale).mul(1 - s.eps); // (N): rows whose target this rank holds
    const tIdx = tl.clamp(0, Vl - 1);
    const asDt = (x: Tensor) => (x.dtype === dt ? x : x.to(dt));
    const hDt = asDt(hidden);
    const dH = needH ? asDt(weight.indexSelect(0, tIdx)).mul(mine.unsqueeze(1)).neg() : undefined;
    let dW = needW ? zeros(weight.shape, { dtype: dt }).indexAdd(0, tIdx, hDt.mul(mine.unsqueeze(1)).neg()) : undefined;
    let dB = needB && bias ? zeros(bias.shape, { dtype: dt }).indexAdd(0, tIdx, mine.neg()) : undefined;
    if (s.eps !== 0) {
      const e = scale.mul(s.eps / V); // (N)
      if (dH) dH.sub_(e.unsqueeze(1).mul(asDt(weight.sum(0)).unsqueeze(0)));
      if (dW) dW = dW.sub(e.unsqueeze(0).matmul(hDt).expand(Vl, hidden.shape[1]!));
      if (dB) dB = dB.sub(e.sum());
    }
    const scaleCol = scale.unsqueeze(1);
    for (const { r, n, c, m: cols } of tiles(N, Vl, s, dt)) {
      tidy(() => {
        const h = hidden.narrow(0, r, n), w = weight.narrow(0, c, cols);
        const z = tileLogits(h, w, bias?.narrow(0, c, cols));
        // softmax from the whole vocabulary's logsumexp, times the row's scale
        const dz = z.sub_(lse.narrow(0, r, n).unsqueeze(1)).exp().mul(scaleCol.narrow(0, r, n));
        const dzc = dz.dtype === hidden.dtype ? dz : dz.to(hidden.dtype);
        if (dH) dH.narrow(0, r, n).add_(dzc.matmul(w));
        if (dW) dW.narrow(0, c, cols).add_(dzc.t().matmul(h));
        if (dB) dB.narrow(0, c, cols).add_(dz.sum(0));
      });
    }
    return [dH, dW, dB, undefined, undefined];
  },
}, 'LinearCrossEntropy');
