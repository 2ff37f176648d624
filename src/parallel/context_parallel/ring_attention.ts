// Ring attention: causal attention over sequences split across the C ranks of a context-parallel
// group, without any rank holding the (T, T) scores of a whole sequence.
//
// [Note: load-balanced chunks] A sequence of T tokens is cut into 2C chunks of c = T / 2C; cp rank
// r holds chunks r and 2C-1-r, in that order (2c tokens). Under a causal mask a late chunk sees
// more keys than an early one, so pairing an early chunk with a late one gives every rank the same
// work: at each ring step a rank computes two (c x c) blocks' worth of scores (the first step: two
// diagonal blocks and one full block, the diagonals half masked).
//
// Forward: each rank keeps its queries; the key/value pair (stacked in one tensor) travels around
// the ring, rank r sending to r+1 and receiving from r-1, the next transfer in flight while the
// current block is computed. At ring step s a rank holds the keys of rank (r - s) mod C. A query
// chunk reads a key chunk with a lower global index whole, its own chunk under the causal mask, and
// skips a later one; since a rank's two key chunks are ordered, the keys a query chunk reads are
// always a prefix of the pair (none, the first, or both), so a block is one product. Partial
// results merge by their log-sum-exp (online softmax): out = sum_b exp(lse_b - lse) out_b with
// lse = log sum_b exp(lse_b).
//
// Backward is a ring too: with the saved output and log-sum-exp, each block's probabilities are
// recomputed (exp(scores - lse)); the keys and values travel around again together with the
// gradients of their keys and values, to which each rank adds its queries' share, and after the
// last step the sums travel one hop more, home to the rank that holds those keys.
//
// Grouped-query attention: the g = H / Hkv query heads of one key/value head are stacked along the
// rows, (B, Hkv, g c, hd), so keys and values are never repeated (as the Llama does).
// Scores, softmax statistics and accumulators are float32 (float64 in a float64 model); the key and
// value pair travels in its own dtype (bfloat16 under bf16-mixed).
//
// [Note: ring documents] Packed rows ([Note: documents] in src/nn/documents.ts): a query reads a key
// only within its own document. Every rank holds the whole rows' document ids, so no ids travel:
// each block ANDs its causal rule with qIds == kIds. A block may then hold query rows that read
// none of its keys (their document starts after the block's keys). Masked scores are a finite
// -1e30, not -inf: such a row's block max is -1e30 and its log-sum-exp about -1e30, so its merge
// weight exp(-1e30 - lse) is exactly 0, and in backward exp(score - lse) is exactly 0 too; every
// row has its real value from its own chunk (the diagonal block), and nothing is NaN. A block whose
// keys all lie in documents that end before any of its queries' begins (for every row) is skipped
// outright: the ids are non-decreasing along a row, so that is two numbers per row, decided on the
// CPU in forward and kept for backward.
//
// [Note: ring window] Sliding-window attention (a query at global index i reads keys j with
// i - j < window): a block's mask also masks the keys at or beyond the window (from the chunks'
// global indices; within a document the index difference is the position difference), and a block
// whose nearest key is already outside the window for its first query is skipped outright, like a
// block of earlier documents. Rows left with no key in a block merge with weight 0 as above.
//
// [Note: ring kernel] With [train] kernels = "fused" ([Note: kernel choice]) a block is the fused
// kernel (src/nn/kernels/attention.ts), one call per key chunk of the pair: a chunk is contiguous,
// so its queries sit at key position i + (qChunk - kChunk) c (the window measured in true global
// distances), with the chunks' document ids. The kernel's log-sum-exp merges as above; a row that
// sees no key of the chunk comes back with -inf, raised to the same finite -1e30 so its weight is 0.
// Backward keeps the ring's structure (the same blocks skipped, the same sums travelling): each
// chunk's gradients come from the kernel's backward given the merged output and log-sum-exp, which
// is the block's share of the whole softmax. A key chunk wholly before its queries' documents or
// outside their window is skipped alone (the block's test on that chunk).
import { type Tensor, type DType, arange, cat, defineFunction, empty, ones, stack, tidy, zerosLike } from '../../tensor/index.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import { kernelChoice } from '../../nn/kernels/choice.js';
import { fusedAttention, fusedAttentionBlockBackward, type FusedAttentionOptions } from '../../nn/kernels/attention.js';

/** The global chunk indices of cp rank r's two halves ([Note: load-balanced chunks]). */
export function chunksOf(rank: number, cp: number): [number, number] {
  return [rank, 2 * cp - 1 - rank];
}

/**
 * The keys a query chunk reads from a key pair (chunks k0 < k1): how many of the pair's chunks
 * (a prefix: 0, 1 or 2) and whether the last of them is the query chunk itself (causal mask).
 */
function blockOf(qChunk: number, kChunks: readonly [number, number]): { n: 0 | 1 | 2; diagonal: boolean } {
  const n = kChunks[1] <= qChunk ? 2 : kChunks[0] <= qChunk ? 1 : 0;
  return { n, diagonal: n > 0 && kChunks[n - 1] === qChunk };
}

/** A tensor sent to the next rank of the ring while the previous rank's arrives. */
function pass(g: ProcessGroup, t: Tensor, tag: number): { arriving: Tensor; wait(): void } {
  const C = g.size, r = g.rank;
  const arriving = empty(t.shape, { dtype: t.dtype });
  const sent = g.send(t, (r + 1) % C, tag);
  const received = g.recv(arriving, (r - 1 + C) % C, tag);
  return { arriving, wait: () => { sent.wait(); received.wait(); } };
}

const KV_TAG = 71, GRAD_TAG = 72;

interface Geometry {
  B: number; H: number; Hkv: number; g: number; T: number; c: number; hd: number; scale: number; acc: DType;
  /** This rank's two query chunks (global indices). */
  mine: [number, number];
  /** Packed rows: every token's document id (B, T x cp, the whole rows), as a tensor and on the host. */
  docs?: { ids: Tensor; host: number[]; T: number };
  /** Sliding window (0 = full causal): [Note: ring window]. */
  window: number;
}

/**
 * Blocks computed and skipped (documents and windows only), for tests and for the curious; `fused`
 * counts the fused kernel's calls when it computes them ([Note: ring kernel]).
 */
export interface RingStats { computed: number; skipped: number; fused?: number }

/** Query half h (B, H, c, hd) as (B, Hkv, g c, hd) in the accumulating dtype. */
function queryHalf(q: Tensor, h: number, geo: Geometry): Tensor {
  const { B, Hkv, g, c, hd, acc } = geo;
  return q.narrow(2, h * c, c).to(acc).reshape(B, Hkv, g * c, hd);
}

/** Not-allowed mask (g c, n c) of a block whose last chunk is the diagonal one. */
function blockMask(n: number, geo: Geometry): Tensor {
  const { c, g } = geo;
  const diag = ones([c, c], { dtype: 'bool' }).tril();
  const allowed = n === 2 ? cat([ones([c, c], { dtype: 'bool' }), diag], 1) : diag;
  return allowed.logicalNot().repeat(g, 1);
}

/** What a masked score is filled with: finite, so that a row with no key in a block merges with weight 0 ([Note: ring documents]). */
const MASKED = -1e30;

/** Scores of a block, (B, Hkv, g c, n c), masked where the causal rule (and the documents) forbid. */
function scores(qh: Tensor, k: Tensor, masked: Tensor | undefined, geo: Geometry): Tensor {
  const s = qh.matmul(k.transpose(-2, -1)).mul(geo.scale);
  return masked ? s.maskedFill(masked, MASKED) : s;
}

/**
 * Not-allowed mask of the block of query chunk `qChunk` over the first n chunks of `kChunks`:
 * (g c, n c) for the causal rule alone, (B, 1, g c, n c) with documents (a key of another document
 * is masked too); undefined when nothing is.
 */
function maskOf(qChunk: number, kChunks: readonly [number, number], n: number, diagonal: boolean, geo: Geometry): Tensor | undefined {
  const diag = diagonal ? blockMask(n, geo) : undefined;
  const outside = windowMask(qChunk, kChunks, n, geo);
  const causal = diag && outside ? diag.logicalOr(outside) : diag ?? outside;
  const ids = geo.docs?.ids;
  if (!ids) return causal;
  const { c, g } = geo;
  const qIds = ids.narrow(1, qChunk * c, c);
  const kIds = n === 1 ? ids.narrow(1, kChunks[0] * c, c) : cat([ids.narrow(1, kChunks[0] * c, c), ids.narrow(1, kChunks[1] * c, c)], 1);
  const other = qIds.unsqueeze(2).eq(kIds.unsqueeze(1)).logicalNot().repeat(1, g, 1).unsqueeze(1); // (B, 1, g c, n c)
  return causal ? other.logicalOr(causal) : other;
}

/**
 * Keys of the block at or beyond the window of its queries, (g c, n c) bool ([Note: ring window]);
 * undefined when every key is within every query's window (or there is no window).
 */
function windowMask(qChunk: number, kChunks: readonly [number, number], n: number, geo: Geometry): Tensor | undefined {
  const { c, g, window } = geo;
  if (window <= 0 || qChunk * c + c - 1 - kChunks[0] * c < window) return undefined;
  const chunk = (k: number) => arange(k * c, k * c + c, 1, { dtype: 'int64' });
  const q = chunk(qChunk).view(c, 1);
  const k = (n === 1 ? chunk(kChunks[0]) : cat([chunk(kChunks[0]), chunk(kChunks[1])], 0)).view(1, n * c);
  return q.sub(k).ge(window).repeat(g, 1);
}

/**
 * Whether no query of chunk qChunk reads any of the first n key chunks, in any row: the last of
 * those keys is in an earlier document than the chunk's first query ([Note: ring documents]), or
 * beyond its window ([Note: ring window]).
 */
function skippable(qChunk: number, kChunks: readonly [number, number], n: number, geo: Geometry): boolean {
  const lastKey = (kChunks[n - 1]! + 1) * geo.c - 1, firstQuery = qChunk * geo.c;
  if (geo.window > 0 && firstQuery - lastKey >= geo.window) return true;
  const d = geo.docs;
  if (!d) return false;
  for (let b = 0; b < geo.B; b++) if (d.host[b * d.T + lastKey]! >= d.host[b * d.T + firstQuery]!) return false;
  return true;
}

/**
 * The key chunks of a block the fused kernel computes ([Note: ring kernel]): the indices in the pair
 * of the first n chunks that are not skippable alone.
 */
function kernelChunks(qChunk: number, kChunks: readonly [number, number], n: number, geo: Geometry): number[] {
  return [0, 1].slice(0, n).filter((j) => !skippable(qChunk, [kChunks[j]!, kChunks[j]!], 1, geo));
}

/** The kernel's arguments for query chunk qChunk over key chunk kChunk (call inside a tidy scope: the ids are views). */
function kernelOptions(qChunk: number, kChunk: number, geo: Geometry): FusedAttentionOptions {
  const { c } = geo;
  const ids = geo.docs?.ids;
  return {
    scale: geo.scale, offset: (qChunk - kChunk) * c, window: geo.window,
    qDocs: ids?.narrow(1, qChunk * c, c), kDocs: ids?.narrow(1, kChunk * c, c),
  };
}

/** The global chunks of the key/value pair a rank holds at ring step `step`: those of rank (rank - step) mod cp. */
function keyChunksAt(step: number, geo: Geometry, cp: number, rank: number): [number, number] {
  return chunksOf((rank - step + cp) % cp, cp);
}

const ringAttentionFn = defineFunction<[Tensor, Tensor, Tensor, ProcessGroup, number, Tensor | undefined, RingStats | undefined, number, boolean]>({
  forward(ctx, q, k, v, group, scale, docIds, stats, window, fused) {
    const [B, H, T, hd] = q.shape as [number, number, number, number];
    const Hkv = k.shape[1]!, C = group.size, r = group.rank, c = T / 2;
    const acc: DType = q.dtype === 'float64' ? 'float64' : 'float32';
    const geo: Geometry = {
      B, H, Hkv, g: H / Hkv, T, c, hd, scale, acc, mine: chunksOf(r, C),
      docs: docIds ? { ids: docIds, host: docIds.toNumbers(), T: docIds.shape[1]! } : undefined, window,
    };
    // Which blocks run, decided here and kept for backward: skip[s][h].
    const skip: boolean[][] = [];
    // Per query half: the merged output (B, Hkv, g c, hd) and log-sum-exp (B, Hkv, g c, 1).
    const out: (Tensor | undefined)[] = [undefined, undefined];
    const lse: (Tensor | undefined)[] = [undefined, undefined];
    let pair = stack([k, v]); // (2, B, Hkv, T, hd): one message a step
    for (let s = 0; s < C; s++) {
      const next = s < C - 1 ? pass(group, pair, KV_TAG) : undefined; // in flight during this step's blocks
      const kc = keyChunksAt(s, geo, C, r);
      skip.push([false, false]);
      for (let h = 0; h < 2; h++) {
        const { n, diagonal } = blockOf(geo.mine[h]!, kc);
        if (n === 0) continue; // every key is later than every query: skipped
        if (skippable(geo.mine[h]!, kc, n, geo)) {
          skip[s]![h] = true;
          if (stats) stats.skipped++;
          continue;
        }
        if (stats) stats.computed++;
        // Online softmax: a part and the merge so far reweighted to their merged log-sum-exp.
        const merge = (o: Tensor, ls: Tensor) => {
          if (!out[h]) return { o, ls };
          const top = ls.maximum(lse[h]!);
          const a = lse[h]!.sub(top).exp(), b = ls.sub(top).exp();
          const sum = a.add(b);
          return { o: out[h]!.mul(a.div(sum)).add(o.mul(b.div(sum))), ls: top.add(sum.log()) };
        };
        const parts = fused
          ? kernelChunks(geo.mine[h]!, kc, n, geo).map((j) => () => {
            if (stats) stats.fused = (stats.fused ?? 0) + 1;
            const [o, ls] = fusedAttention(q.narrow(2, h * c, c).to(acc), pair.select(0, 0).narrow(2, j * c, c).to(acc),
              pair.select(0, 1).narrow(2, j * c, c).to(acc), { ...kernelOptions(geo.mine[h]!, kc[j]!, geo), withLse: true });
            return merge(o.reshape(B, Hkv, geo.g * c, hd), ls.clamp(MASKED).reshape(B, Hkv, geo.g * c, 1));
          })
          : [() => {
            const qh = queryHalf(q, h, geo);
            const kb = pair.select(0, 0).narrow(2, 0, n * c).to(acc), vb = pair.select(0, 1).narrow(2, 0, n * c).to(acc);
            const sc = scores(qh, kb, maskOf(geo.mine[h]!, kc, n, diagonal, geo), geo);
            const m = sc.amax(-1, true);
            const p = sc.sub(m).exp();
            const l = p.sum(-1, true);
            return merge(p.matmul(vb).div(l), m.add(l.log()));
          }];
        for (const part of parts) {
          const merged = tidy(part);
          out[h]?.dispose();
          lse[h]?.dispose();
          out[h] = merged.o;
          lse[h] = merged.ls;
        }
      }
      if (next) {
        next.wait();
        pair.dispose();
        pair = next.arriving;
      }
    }
    pair.dispose();
    // Every query reads at least its own position, so both halves have an output.
    const y = tidy(() => cat(out.map((o) => o!.view(B, H, c, hd)), 2).to(q.dtype));
    // The ids are saved too: the recomputed masks need them whoever else frees the layout.
    ctx.saveForBackward(q, k, v, out[0]!, out[1]!, lse[0]!, lse[1]!, ...(docIds ? [docIds] : []));
    ctx.state.geo = geo;
    ctx.state.group = group;
    ctx.state.skip = skip;
    ctx.state.fused = fused;
    for (const t of [...out, ...lse]) t!.dispose();
    return y;
  },
  backward(ctx, dy) {
    const [q, k, v, o0, o1, l0, l1, ids] = ctx.savedTensors as Tensor[];
    const saved = ctx.state.geo as Geometry;
    const geo: Geometry = saved.docs ? { ...saved, docs: { ...saved.docs, ids: ids! } } : saved;
    const group = ctx.state.group as ProcessGroup;
    const skip = ctx.state.skip as boolean[][];
    const fused = ctx.state.fused as boolean;
    const { B, H, Hkv, c, hd, g, acc, scale } = geo;
    const C = group.size, r = group.rank;
    const outs = [o0!, o1!], lses = [l0!, l1!];
    // Per query half: its output gradient, D = rowsum(dO * O) and the query gradient so far.
    const dO = [0, 1].map((h) => dy.narrow(2, h * c, c).to(acc).reshape(B, Hkv, g * c, hd));
    const D = dO.map((d, h) => d.mul(outs[h]!).sum(-1, true));
    const dq = dO.map((d) => zerosLike(d));
    let pair = stack([k!, v!]);
    let dPair = zerosLike(pair, { dtype: acc }); // the gradients of the pair's keys and values
    for (let s = 0; s < C; s++) {
      const next = s < C - 1 ? pass(group, pair, KV_TAG) : undefined;
      const kc = keyChunksAt(s, geo, C, r);
      for (let h = 0; h < 2; h++) {
        const { n, diagonal } = blockOf(geo.mine[h]!, kc);
        if (n === 0 || skip[s]![h]) continue;
        if (fused) {
          // The kernel's backward per key chunk, against the merged rows ([Note: ring kernel]).
          for (const j of kernelChunks(geo.mine[h]!, kc, n, geo)) {
            tidy(() => {
              const rows = (t: Tensor) => t.reshape(B, H, c, hd);
              const [dqj, dkj, dvj] = fusedAttentionBlockBackward(q!.narrow(2, h * c, c).to(acc),
                pair.select(0, 0).narrow(2, j * c, c).to(acc), pair.select(0, 1).narrow(2, j * c, c).to(acc),
                rows(outs[h]!), lses[h]!.reshape(B, H, c), rows(dO[h]!), kernelOptions(geo.mine[h]!, kc[j]!, geo));
              dq[h]!.add_(dqj.reshape(B, Hkv, g * c, hd));
              dPair.select(0, 0).narrow(2, j * c, c).add_(dkj);
              dPair.select(0, 1).narrow(2, j * c, c).add_(dvj);
            });
          }
          continue;
        }
        tidy(() => {
          const qh = queryHalf(q!, h, geo);
          const kb = pair.select(0, 0).narrow(2, 0, n * c).to(acc), vb = pair.select(0, 1).narrow(2, 0, n * c).to(acc);
          const p = scores(qh, kb, maskOf(geo.mine[h]!, kc, n, diagonal, geo), geo).sub(lses[h]!).exp(); // (B, Hkv, g c, n c)
          dPair.select(0, 1).narrow(2, 0, n * c).add_(p.transpose(-2, -1).matmul(dO[h]!));
          const ds = p.mul(dO[h]!.matmul(vb.transpose(-2, -1)).sub(D[h]!));
          dq[h]!.add_(ds.matmul(kb).mul(scale));
          dPair.select(0, 0).narrow(2, 0, n * c).add_(ds.transpose(-2, -1).matmul(qh).mul(scale));
        });
      }
      // The sums travel with their keys; after the last step, one hop more takes them home.
      const back = pass(group, dPair, GRAD_TAG);
      back.wait();
      dPair.dispose();
      dPair = back.arriving;
      if (next) {
        next.wait();
        pair.dispose();
        pair = next.arriving;
      }
    }
    const dk = dPair.select(0, 0).to(k!.dtype), dv = dPair.select(0, 1).to(v!.dtype);
    const dqAll = cat(dq.map((t) => t.view(B, H, c, hd)), 2).to(q!.dtype);
    return [dqAll, dk, dv, undefined, undefined, undefined, undefined, undefined, undefined];
  },
}, 'RingAttention');

/**
 * Causal attention of this rank's 2c tokens of each sequence over the whole sequence, split over
 * `group` as [Note: load-balanced chunks] says: q (B, H, 2c, hd), k and v (B, Hkv, 2c, hd) ->
 * (B, H, 2c, hd). On a group of one it is plain causal attention, computed blockwise. With
 * `docIds`, the whole rows' document ids (B, 2c x cp), a query reads only its own document's keys
 * ([Note: ring documents]); `stats` counts the blocks computed and skipped. A sliding `window` > 0
 * limits a query at global index i to keys j with i - j < window ([Note: ring window]). Blocks run
 * the fused kernel when the kernel choice is "fused" ([Note: ring kernel]).
 */
export function ringAttention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, scale: number, docIds?: Tensor, stats?: RingStats, window = 0): Tensor {
  const [B, H, T] = q.shape as [number, number, number, number];
  if (T % 2 !== 0) throw new Error(`ringAttention: a rank holds two equal chunks of each sequence, got ${T} tokens`);
  if (H % k.shape[1]! !== 0) throw new Error(`ringAttention: ${H} query heads do not group over ${k.shape[1]} key/value heads`);
  if (docIds && (docIds.ndim !== 2 || docIds.shape[0] !== B || docIds.shape[1] !== T * group.size)) {
    throw new Error(`ringAttention: document ids of shape [${docIds.shape}] are not the whole rows [${B}, ${T * group.size}] (${T} tokens on each of ${group.size} ranks)`);
  }
  if (!Number.isInteger(window) || window < 0) throw new Error(`ringAttention: window must be a whole number >= 0, got ${window}`);
  return ringAttentionFn(q, k, v, group, scale, docIds, stats, window, kernelChoice() === 'fused');
}
