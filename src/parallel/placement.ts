// [Note: placement] Where each parameter lives, described once for every reader: checkpoints (what
// a rank writes and what it must read back), and later resharding and tensor parallelism.
//
// A parameter's full tensor is described by its whole-model name, shape and dtype. This rank holds
// one contiguous range of its flattened elements (all of them when replicated; the intersection with
// this rank's bucket shard under ZeRO-3), and its optimizer state covers one range too (the shard
// under ZeRO-1/2/3, everything under plain data parallelism). `writes` is the part this rank saves:
// over the whole world every element of every parameter is written by exactly one rank, so
// replicas (data-parallel copies, HSDP replicas, a tied embedding's second pipeline copy) split the
// work or stay silent instead of writing the same bytes twice.
//
// Frozen parameters (requiresGrad = false) are placed like the rest: in their unit's bucket under
// ZeRO-3, else whole on every data-parallel rank, which write even shares.
//
// Under tensor parallelism a rank holds a slice of the whole parameter (rows, columns, or a part of
// each fused chunk): `shape` is still the whole parameter's, the ranges above are in the local
// slice's flattened order, and `tp` maps them to runs of the whole flattened parameter
// (wholeRuns). Replicated parameters are written by tensor-parallel rank 0 only.
//
// Layouts produce placements where they are applied (ParallelModel.placements(): placementsOf over
// the layout's own data-parallel wrapper, then slicedOverTp with the placements its tensor-parallel
// plan made); readers only consume them.
import type { Tensor, DType } from '../tensor/index.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { DataParallel } from './data_parallel/data_parallel.js';
import { shardRange, type ParamSlot } from './data_parallel/grad_buffer.js';
import type { TpPlacement } from './tensor_parallel/styles.js';

/** A range [offset, offset + numel) of a flattened parameter. */
export interface ElementRange {
  offset: number;
  numel: number;
}

export interface ParamPlacement {
  /** Whole-model name (the same under every layout). */
  name: string;
  /** The local parameter tensor (a pipeline rank holds only its stages'). */
  param: Tensor;
  shape: readonly number[];
  dtype: DType;
  /** The elements of the flattened parameter this rank holds values for. */
  held: ElementRange;
  /** A flat view of the held values (readable and writable in place). */
  values(): Tensor;
  /** The elements this rank's optimizer keeps state for. */
  stateHeld: ElementRange;
  /** The elements this rank writes to a checkpoint (numel 0: none); inside held and stateHeld. */
  writes: ElementRange;
  /** Under tensor parallelism: this rank's slice of the whole parameter (ranges above are in its local order). */
  tp?: TpSlice;
}

/** Slice `index` of `parts` along `dim` of a parameter whose dim fuses `chunks` equal outputs (a slice of each). */
export interface TpSlice {
  dim: number;
  chunks: number;
  parts: number;
  index: number;
}

/** A run of consecutive elements: `numel` at `local` in the local slice are at `whole` in the whole parameter. */
export interface Run {
  local: number;
  whole: number;
  numel: number;
}

/**
 * The runs of the whole flattened parameter that a range of the local (tensor-parallel) slice
 * covers, in order, adjacent runs merged. Without a slice the range is itself.
 */
export function wholeRuns(p: Pick<ParamPlacement, 'shape' | 'tp'>, r: ElementRange): Run[] {
  if (r.numel === 0) return [];
  if (!p.tp || p.tp.parts === 1) return [{ local: r.offset, whole: r.offset, numel: r.numel }];
  const { dim, chunks, parts, index } = p.tp;
  const D = p.shape[dim]!;
  const inner = p.shape.slice(dim + 1).reduce((a, b) => a * b, 1);
  const S = D / chunks, P = S / parts;
  const len = P * inner; // one run: a (outer index, chunk) pair's part
  const out: Run[] = [];
  const end = r.offset + r.numel;
  for (let q = Math.floor(r.offset / len); q * len < end; q++) {
    const a = Math.floor(q / chunks), k = q % chunks;
    const localStart = q * len;
    const wholeStart = a * D * inner + k * S * inner + index * P * inner;
    const lo = Math.max(r.offset, localStart), hi = Math.min(end, localStart + len);
    const run = { local: lo, whole: wholeStart + (lo - localStart), numel: hi - lo };
    const last = out[out.length - 1];
    if (last && last.local + last.numel === run.local && last.whole + last.numel === run.whole) last.numel += run.numel;
    else out.push(run);
  }
  return out;
}

export interface PlacementOptions {
  /**
   * The data-parallel wrapper whose flat buckets hold (some of) the parameters. Parameters it does
   * not hold are replicated over `replicas`.
   */
  dp?: DataParallel;
  /** The group holding identical copies of parameters outside a wrapper (default: none). */
  replicas?: ProcessGroup;
  /** Local copies another rank (or another local tensor) writes: a tied embedding's second copy. */
  silent?: ReadonlySet<Tensor>;
}

/** Splits n elements into `parts` near-equal contiguous ranges; returns range k. */
function evenRange(n: number, parts: number, k: number): ElementRange {
  const base = Math.floor(n / parts);
  const extra = n % parts;
  const offset = k * base + Math.min(k, extra);
  return { offset, numel: base + (k < extra ? 1 : 0) };
}

const NONE: ElementRange = { offset: 0, numel: 0 };

/** Placements of this rank's parameters (named by whole-model name), for the layout described by opts. */
export function placementsOf(named: readonly [string, Tensor][], opts: PlacementOptions = {}): ParamPlacement[] {
  const slots = new Map<Tensor, ParamSlot>();
  for (const s of opts.dp?.parametersWithSlots() ?? []) slots.set(s.param, s);
  // Frozen parameters: in their unit's bucket under ZeRO-3, else whole on every data-parallel rank
  // ([Note: frozen parameters] in data_parallel/grad_buffer.ts).
  const frozenSlots = new Map<Tensor, ParamSlot>();
  for (const s of opts.dp?.frozenParameterSlots() ?? []) frozenSlots.set(s.param, s);
  const seen = new Set<Tensor>();
  const out: ParamPlacement[] = [];
  for (const [name, param] of named) {
    if (seen.has(param)) continue; // the same tensor under two names (tied in one module): once
    seen.add(param);
    const silent = opts.silent?.has(param) ?? false;
    const slot = slots.get(param);
    const frozen = frozenSlots.get(param);
    const replicas = opts.replicas ?? (!param.requiresGrad ? opts.dp?.group : undefined);
    const p = slot && opts.dp ? inBucket(name, slot, opts.dp) : frozen && opts.dp ? frozenInBucket(name, frozen, opts.dp) : replicated(name, param, replicas);
    out.push(silent ? { ...p, writes: NONE } : p);
  }
  return out;
}

/**
 * The same placements under tensor parallelism, given where each parameter lies over the tp group
 * (TensorParallelApplied.placements): a sharded one gets its whole shape and its slice, a
 * replicated one is written by tp rank 0 only.
 */
export function slicedOverTp(placements: readonly ParamPlacement[], tp: ReadonlyMap<Tensor, TpPlacement>): ParamPlacement[] {
  return placements.map((p) => {
    const t = tp.get(p.param);
    if (t?.kind === 'shard' && t.group.size > 1) {
      // The whole parameter's shape; the ranges stay in the local slice's order.
      const shape = [...p.shape];
      shape[t.dim] = shape[t.dim]! * t.group.size;
      return { ...p, shape, tp: { dim: t.dim, chunks: t.chunks, parts: t.group.size, index: t.group.rank } };
    }
    return t?.kind === 'replicate' && t.group.rank > 0 ? { ...p, writes: NONE } : p;
  });
}

/** A parameter held whole on every rank of `replicas`: each writes an even share of it. */
function replicated(name: string, param: Tensor, replicas: ProcessGroup | undefined): ParamPlacement {
  const n = param.numel();
  const all = { offset: 0, numel: n };
  return {
    name, param, shape: param.shape, dtype: param.dtype, held: all, stateHeld: all,
    values: () => param.view(-1),
    writes: replicas && replicas.size > 1 ? evenRange(n, replicas.size, replicas.rank) : all,
  };
}

/** A frozen parameter in the frozen region of a ZeRO-3 bucket: this rank holds its part of the region's shard. */
function frozenInBucket(name: string, slot: ParamSlot, dp: DataParallel): ParamPlacement {
  const b = slot.bucket;
  const fs = b.frozenNumel / dp.shardGroup.size; // the frozen region's shard
  const at = slot.offset - b.offset - b.numel; // the parameter's start inside the frozen region
  const s = dp.shardGroup.rank * fs;
  const lo = Math.max(s, at), hi = Math.min(s + fs, at + slot.numel);
  const shard = hi > lo ? { offset: lo - at, numel: hi - lo } : NONE;
  const writes = !dp.replicateGroup || dp.replicateGroup.rank === 0 ? shard : NONE;
  return {
    name, param: slot.param, shape: slot.shape, dtype: slot.param.dtype, held: shard, stateHeld: shard, writes,
    values: () => b.frozenShardData!.narrow(0, shard.numel > 0 ? lo - s : 0, shard.numel),
  };
}

/** A parameter in a flat bucket of a DataParallel wrapper, under any ZeRO stage. */
function inBucket(name: string, slot: ParamSlot, dp: DataParallel): ParamPlacement {
  const b = slot.bucket;
  const at = slot.offset - b.offset; // the parameter's start inside its bucket
  const all = { offset: 0, numel: slot.numel };
  const base = { name, param: slot.param, shape: slot.shape, dtype: slot.param.dtype };
  if (dp.zero === 0) {
    // Replicated over the whole data-parallel group: ranks write even shares.
    const g = dp.group;
    return { ...base, held: all, stateHeld: all, values: () => slot.param.view(-1), writes: g.size > 1 ? evenRange(slot.numel, g.size, g.rank) : all };
  }
  const [s, e] = shardRange(b, dp.shardGroup.rank);
  const lo = Math.max(s, at);
  const hi = Math.min(e, at + slot.numel);
  const shard = hi > lo ? { offset: lo - at, numel: hi - lo } : NONE;
  // HSDP replicas hold the same shard: the first replica writes it.
  const writer = !dp.replicateGroup || dp.replicateGroup.rank === 0;
  const writes = writer ? shard : NONE;
  if (dp.zero === 3) {
    // Only the shard is resident: values are the shard's slice of shardData.
    return { ...base, held: shard, stateHeld: shard, writes, values: () => b.shardData!.narrow(0, shard.numel > 0 ? lo - s : 0, shard.numel) };
  }
  return { ...base, held: all, stateHeld: shard, writes, values: () => slot.param.view(-1) };
}
