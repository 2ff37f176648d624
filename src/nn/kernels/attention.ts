// Fused causal attention: the addon's blocked kernel ([Note: fused attention] in native/attention.cc)
// with autograd through a function node. Memory is linear in the sequence: backward keeps q, k, v,
// the output and the log-sum-exp rows, and recomputes the probabilities block by block.
import { defineFunction, Tensor, type FunctionCtx } from '../../tensor/index.js';
import { native } from '../../tensor/native.js';

export interface FusedAttentionOptions {
  /** Multiplies q.k (default 1 / sqrt(D)). */
  scale?: number;
  /** Query i sits at key position i + offset (default Tk - Tq: the queries are the last keys' positions). */
  offset?: number;
  /** Sliding window W > 0: query i sees keys j with 0 <= i + offset - j < W (0: none). */
  window?: number;
  /** Document ids (B, Tq) and (B, Tk), int32 or int64: a query sees only keys of its own document. */
  qDocs?: Tensor;
  kDocs?: Tensor;
  /** Also return the log-sum-exp (B, Hq, Tq) of the scaled scores (-inf for a row that sees no key). */
  withLse?: boolean;
}

interface Settings {
  scale: number;
  offset: number;
  window: number;
  qDocs: Tensor | undefined;
  kDocs: Tensor | undefined;
}

/** dq, dk, dv from the saved inputs, the output and log-sum-exp rows they are relative to, and dOut. */
function attentionGradients(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dOut: Tensor, s: Settings): [Tensor, Tensor, Tensor] {
  const [dq, dk, dv] = native.attentionBackward(q.handle, k.handle, v.handle, out.handle, lse.handle, dOut.handle,
    s.scale, s.offset, s.window, s.qDocs?.handle, s.kDocs?.handle);
  return [new Tensor(dq), new Tensor(dk), new Tensor(dv)];
}

function settingsOf(q: Tensor, k: Tensor, opts: FusedAttentionOptions): Settings {
  return {
    scale: opts.scale ?? 1 / Math.sqrt(q.shape[3]!),
    offset: opts.offset ?? k.shape[2]! - q.shape[2]!,
    window: opts.window ?? 0,
    qDocs: opts.qDocs,
    kDocs: opts.kDocs,
  };
}

const attention = defineFunction<[Tensor, Tensor, Tensor, Settings]>({
  forward(ctx: FunctionCtx, q, k, v, s) {
    const [out, lse] = native.attentionForward(q.handle, k.handle, v.handle, s.scale, s.offset, s.window, s.qDocs?.handle, s.kDocs?.handle);
    const o = new Tensor(out), l = new Tensor(lse);
    ctx.saveForBackward(q, k, v, o, l);
    ctx.state.s = s;
    ctx.markNonDifferentiable(l);
    return [o, l];
  },
  backward(ctx, gOut) {
    const [q, k, v, o, l] = ctx.savedTensors as [Tensor, Tensor, Tensor, Tensor, Tensor];
    return [...attentionGradients(q, k, v, o, l, gOut!, ctx.state.s as Settings), undefined];
  },
}, 'FusedAttention');

/**
 * Causal attention of q (B, Hq, Tq, D) over k, v (B, Hkv, Tk, D), Hq a multiple of Hkv (query head h
 * reads kv head h / (Hq / Hkv)): out (B, Hq, Tq, D), and with `withLse` [out, lse].
 */
export function fusedAttention(q: Tensor, k: Tensor, v: Tensor, opts: FusedAttentionOptions & { withLse: true }): [Tensor, Tensor];
export function fusedAttention(q: Tensor, k: Tensor, v: Tensor, opts?: FusedAttentionOptions): Tensor;
export function fusedAttention(q: Tensor, k: Tensor, v: Tensor, opts: FusedAttentionOptions = {}): Tensor | [Tensor, Tensor] {
  const [out, lse] = attention(q, k, v, settingsOf(q, k, opts)) as [Tensor, Tensor];
  if (opts.withLse) return [out, lse];
  lse.dispose();
  return out;
}

/**
 * The kernel's backward alone, for a caller that merges several blocks' softmaxes itself (the ring
 * of context parallelism): the gradients of q, k, v of one block given the merged output and
 * log-sum-exp (B, Hq, Tq) of the rows and their output gradient, so the block's probabilities are
 * its share of the merged softmax.
 */
export function fusedAttentionBlockBackward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dOut: Tensor, opts: FusedAttentionOptions = {}): [Tensor, Tensor, Tensor] {
  return attentionGradients(q, k, v, out, lse, dOut, settingsOf(q, k, opts));
}
