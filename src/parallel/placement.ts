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
// Layouts produce placements (placementsOf); readers only consume them.
import type { Tensor, DType } from '../tensor/index.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { DataParallel } from './data_parallel.js';
import { shardRange, type ParamSlot } from './grad_buffer.js';

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
export function evenSplit(n: number, parts: number, k: number): ElementRange {
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
  const seen = new Set<Tensor>();
  const out: ParamPlacement[] = [];
  for (const [name, param] of named) {
    if (seen.has(param)) continue; // the same tensor under two names (tied in one module): once
    seen.add(param);
    const silent = opts.silent?.has(param) ?? false;
    const slot = slots.get(param);
    const p = slot && opts.dp ? inBucket(name, slot, opts.dp) : replicated(name, param, opts.replicas);
    out.push(silent ? { ...p, writes: NONE } : p);
  }
  return out;
}

/** A parameter held whole on every rank of `replicas`: each writes an even share of it. */
function replicated(name: string, param: Tensor, replicas: ProcessGroup | undefined): ParamPlacement {
  const n = param.numel();
  const all = { offset: 0, numel: n };
  return {
    name, param, shape: param.shape, dtype: param.dtype, held: all, stateHeld: all,
    values: () => param.view(-1),
    writes: replicas && replicas.size > 1 ? evenSplit(n, replicas.size, replicas.rank) : all,
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
    return { ...base, held: all, stateHeld: all, values: () => slot.param.view(-1), writes: g.size > 1 ? evenSplit(slot.numel, g.size, g.rank) : all };
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
