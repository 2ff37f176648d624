// [Note: gradient API] One public way to read gradients under every parallel mode: a parameter's
// full gradient (a collective when it is sharded), its local shard with offsets, and the global
// norm. Every mode implements GradientSource over the flat buffer of data_parallel/grad_buffer.ts; nobody keeps
// a private gradient store.
import { Tensor, noGrad, tidy, tensor } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import type { ProcessGroup } from '../distributed/process_group.js';

export interface GradShard {
  /** This rank's piece of the flattened gradient. */
  tensor: Tensor;
  /** Where the piece starts in the flattened full gradient. */
  offset: number;
  numel: number;
  fullNumel: number;
  /**
   * Under tensor parallelism, which slice of the whole parameter the flattened "full" gradient
   * above is: this rank's part `index` of `parts` along `dim` (per chunk when the parameter fuses
   * `chunks` outputs). Absent when the parameter is whole on every tensor-parallel rank.
   */
  tp?: { dim: number; index: number; parts: number; chunks: number };
}

/**
 * A contiguous range of elements the optimizer updates on this rank: a flat slice of parameter
 * values and the matching gradient slice, covering pieces of one or more parameters. A sharded
 * optimizer is the same optimizer handed smaller pieces.
 */
export interface StepPiece {
  /** Stable name of the range (optimizer state is kept per piece and saved per parameter). */
  key: string;
  data: Tensor;
  grad: Tensor;
  /** The parameters the range covers: `numel` elements at `start` in the piece are elements `paramOffset`.. of the flattened parameter. */
  segments: { param: Tensor; name: string; start: number; numel: number; paramOffset: number }[];
  /** True when the piece is this rank's shard of a parameter bucket (state covers only it). */
  owned: boolean;
}

export interface GradientSource {
  /** The parameter's whole gradient, shaped like it (gathers when sharded). */
  fullGrad(param: Tensor): Tensor;
  /** The part of the parameter's flattened gradient that this rank holds. */
  localGradShard(param: Tensor): GradShard;
  /**
   * Flat local gradient pieces such that summing |g|^p over them, then over every group in
   * sumOver, counts each gradient element of the model exactly once.
   */
  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] };
  /**
   * When the pieces are not all summed over the same groups (expert parallelism: experts also over
   * ep), each set with its own; gradNorm then reads this instead of normPieces.
   */
  normGroups?(): { tensors: Tensor[]; sumOver: ProcessGroup[] }[];
  /** With normGroups: which of them a parameter's gradient belongs to (a wrapper regrouping per parameter asks). */
  normGroupOf?(param: Tensor): number;
  /**
   * The gradient tensors clipping scales, when they are more than normPieces' tensors: a copy
   * that is left out of the norm so it counts once (the last pipeline stage's copy of a tied
   * embedding) must still be scaled. Default: normPieces().tensors.
   */
  clipTargets?(): Tensor[];
  /** The flat ranges this rank's optimizer updates (default: each parameter and its .grad). */
  stepPieces?(): StepPiece[];
  /** The same ranges outside the gradient window (for naming and sizing optimizer state). */
  pieceLayout?(): StepPiece[];
  /** Parameters that received a gradient on some rank this step; the optimizer skips the others. Undefined: all. */
  usedParameters?(): ReadonlySet<Tensor> | undefined;
  /** Called by the optimizer after it updated one piece (a sharded mode may start gathering it). */
  pieceStepped?(piece: StepPiece): void;
  /** Called by the optimizer after it updated the pieces (sharded modes gather the new parameters). */
  afterStep?(): void;
  /** Zeroes the gradients this source holds (the optimizer's zeroGrad delegates here). */
  zeroGrad?(): void;
}

/** Gradients of a plain single-process module (param.grad). */
export class LocalGrads implements GradientSource {
  constructor(private readonly module: Module) {}
  fullGrad(param: Tensor): Tensor {
    const g = param.grad;
    if (!g) throw new Error('parameter has no gradient yet (run backward first)');
    return g;
  }
  localGradShard(param: Tensor): GradShard {
    const g = this.fullGrad(param).flatten();
    return { tensor: g, offset: 0, numel: g.numel(), fullNumel: g.numel() };
  }
  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    const tensors: Tensor[] = [];
    for (const p of this.module.parameters()) {
      const g = p.grad;
      if (g) tensors.push(g);
    }
    return { tensors, sumOver: [] };
  }
}

/**
 * The norm of the whole model's gradient: sum |g|^p over local pieces, all-reduce SUM over every
 * group that splits the gradient, then ^(1/p); p = Infinity uses MAX. Every rank returns the same
 * value (NaN/Inf included), so decisions taken on it agree everywhere.
 *
 * [Note: norm precision] |g|^p is summed in float64: each piece is converted to float64 a chunk at
 * a time before the reduction (libtorch's float32 norm of a long flat buffer loses ~1e-4 relative
 * at millions of elements), and the per-chunk sums are added as float64 numbers. A NaN anywhere
 * travels as a separate flag beside the value, because a MAX all-reduce may drop a NaN operand
 * (comparisons with NaN are false): the result is NaN on every rank whenever any rank saw one.
 */
export function gradNorm(src: GradientSource, p = 2): number {
  // tidy: pieces a source makes for the call (LocalGrads' .grad handles) are freed; buffer views stay.
  return tidy(() => normOf(piecesOf(src), p));
}

function piecesOf(src: GradientSource): { tensors: Tensor[]; sumOver: ProcessGroup[] }[] {
  return src.normGroups ? src.normGroups() : [src.normPieces()];
}

/** Elements converted to float64 at a time (8 MiB of float64). */
const NORM_CHUNK = 1 << 20;

function normOf(groups: { tensors: Tensor[]; sumOver: ProcessGroup[] }[], p: number): number {
  if (!(p > 0)) throw new Error(`gradNorm: norm type p must be > 0 (or Infinity), got ${p}`);
  const inf = p === Infinity;
  let total = 0, nan = false;
  // Each set of pieces is summed over its own groups, then the sets are combined (every rank the same).
  for (const g of groups) {
    const part = groupNorm(g, p);
    if (Number.isNaN(part)) nan = true;
    else total = inf ? Math.max(total, part) : total + part;
  }
  if (nan) return NaN;
  return inf ? total : total ** (1 / p);
}

/** sum |g|^p (max for p = Infinity) over the pieces and their groups; NaN when any rank saw one. */
function groupNorm({ tensors, sumOver }: { tensors: Tensor[]; sumOver: ProcessGroup[] }, p: number): number {
  const inf = p === Infinity;
  let local = 0;
  noGrad(() => {
    for (const t of tensors) {
      const n = t.numel();
      if (n === 0) continue;
      const flat = t.reshape(-1);
      for (let off = 0; off < n; off += NORM_CHUNK) {
        tidy(() => {
          const piece = flat.narrow(0, off, Math.min(NORM_CHUNK, n - off));
          let v: number;
          if (p === 2) {
            // Squared in place in the float64 copy: one chunk-sized temporary, not three (24 MiB of
            // freed blocks the tensor cache kept for every step of a 25M model).
            let sq: Tensor;
            if (piece.dtype === 'float64') sq = piece.mul(piece);
            else {
              sq = piece.to('float64');
              sq.mul_(sq);
            }
            v = sq.sum().item();
          } else {
            const c = piece.to('float64').abs();
            if (inf) v = c.max().item();
            else if (p === 1) v = c.sum().item();
            else v = c.pow(p).sum().item();
          }
          local = inf ? (Number.isNaN(v) || Number.isNaN(local) ? NaN : Math.max(local, v)) : local + v;
        });
      }
    }
  });
  const nan = Number.isNaN(local);
  const acc = tensor([nan ? 0 : local, nan ? 1 : 0], { dtype: 'float64' });
  for (const g of sumOver) g.allReduce(acc, inf ? 'max' : 'sum').wait();
  const [total, nanFlag] = acc.toNumbers() as [number, number];
  return nanFlag > 0 ? NaN : total;
}

export interface ClipResult {
  /** The global norm before clipping. */
  norm: number;
  /** The factor gradients were multiplied by (1 when within maxNorm). */
  scale: number;
}

/**
 * The global norm and clipping's factor for maxNorm (torch.nn.utils.clip_grad_norm_'s coefficient:
 * coef = maxNorm / (norm + 1e-6), capped at 1), the gradients left as they are: an optimizer step
 * that multiplies them as it reads them takes the factor ([Note: folded clip] in native/optim.cc).
 *
 * Non-finite norm (NaN or Inf; every rank computed the same one, see [Note: norm precision]): with
 * errorIfNonfinite, every rank throws; otherwise the result says { norm: NaN or Inf, scale: 1 }, and
 * the caller is expected to skip the optimizer step, which every rank then decides alike. This
 * differs from PyTorch 1.13, which multiplies the gradients by the non-finite coefficient (turning
 * them all into NaN).
 */
export function clipFactor(src: GradientSource, maxNorm: number, opts: { p?: number; errorIfNonfinite?: boolean } = {}): ClipResult {
  return tidy(() => factorOf(piecesOf(src), maxNorm, opts));
}

function factorOf(pieces: { tensors: Tensor[]; sumOver: ProcessGroup[] }[], maxNorm: number,
  opts: { p?: number; errorIfNonfinite?: boolean }): ClipResult {
  if (!(maxNorm > 0)) throw new Error(`clipGradNorm: maxNorm must be > 0, got ${maxNorm}`);
  const norm = normOf(pieces, opts.p ?? 2);
  if (!Number.isFinite(norm)) {
    if (opts.errorIfNonfinite) throw new Error(`clipGradNorm: the total gradient norm is ${norm}; gradients hold NaN or Inf`);
    return { norm, scale: 1 };
  }
  const coef = maxNorm / (norm + 1e-6);
  return { norm, scale: Math.min(coef, 1) };
}

/**
 * Scales every gradient so the global norm is at most maxNorm: clipFactor's factor, multiplied into
 * every gradient tensor (left unchanged when the norm is within maxNorm or not finite).
 */
export function clipGradNorm(src: GradientSource, maxNorm: number, opts: { p?: number; errorIfNonfinite?: boolean } = {}): ClipResult {
  return tidy(() => {
    const pieces = piecesOf(src);
    const r = factorOf(pieces, maxNorm, opts);
    if (r.scale >= 1) return r;
    const targets = src.clipTargets ? src.clipTargets() : pieces.flatMap((g) => g.tensors);
    noGrad(() => {
      for (const t of targets) t.mul_(r.scale);
    });
    return r;
  });
}
