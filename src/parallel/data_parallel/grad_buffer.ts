// [Note: flat buffers] The one parameter and gradient store under every parallel feature.
//
// Layout. Parameters of one dtype are laid out end to end in reverse registration order (about
// the order backward produces gradients) and cut into buckets: by size (about `bucketBytes`), or
// one bucket per wrapping unit (ZeRO-3 gathers and frees a unit at a time). A parameter is never
// split across buckets. Each bucket is padded to a multiple of the shard count, so it splits into
// equal shards: shard k of a bucket is [k * shardNumel, (k + 1) * shardNumel) of it. Padding is
// zero and stays zero (nothing writes to it).
//
// Storage. Every bucket owns two flat tensors of its padded size, `data` and `grad` (under ZeRO-3
// a third, `frozenData`, holds the unit's frozen parameters: [Note: frozen parameters]); each parameter
// is a shaped view of `data` (its old storage is released) and each `param.grad` is a view of
// `grad`, assigned once, so autograd accumulates into the bucket in place and a gradient is never
// missing. Sharded modes own, per bucket, this rank's shard of the gradient (`shardGrad`) and under
// ZeRO-3 of the parameters (`shardData`), and free the full storages between uses: a freed storage
// has 0 bytes while every view keeps its shape (Tensor.resizeStorage_), and it is re-allocated in
// place, so views handed out earlier (param.grad, tensors autograd saved) see the new bytes.
// DataParallel all-reduces `grad`; ZeRO reduce-scatters it into `shardGrad`; clipping, the gradient
// API and the optimizer read the same memory through GradientSource (../grads.ts).
//
// [Note: frozen parameters] A parameter with requiresGrad = false has values but no gradient, no
// optimizer state and no reduction, so the gradient layout is built from the trainable set only.
// Under ZeRO-3 a frozen parameter must still be sharded and gathered with its unit, so a bucket has
// two regions: the trainable parameters in `data` ([0, numel), matching `grad` element for element,
// so a shard of one is the shard of the other) and the frozen ones in `frozenData`, a flat tensor of
// their own dtype (frozenNumel, padded and sharded the same way; a bfloat16 LoRA base beside float32
// adapters, applyLora's baseDtype), each sharded (`shardData`, `frozenShardData`) and all-gathered
// on its own. The layout still numbers the frozen region after the trainable one (a frozen slot's
// offset - the bucket's - numel is its place in `frozenData`), as the unit's bfloat16 copy under
// bf16-mixed lays them out end to end (fsdp_bf16.ts). A bucket's frozen parameters share one dtype;
// the buffer's dtype is its trainable parameters'. A unit with only frozen parameters is a bucket with numel 0: it is gathered and freed like
// any other but has no gradient and joins no reduction. A unit holding frozen parameters is not
// freed when its gradient bucket launches (its frozen weights may still be needed for the gradient
// of its input, as a LoRA base is beside its adapters; FsdpUnits.onReduced). The other modes keep frozen parameters
// whole outside the buckets (every rank holds them, as it holds the trainable ones), and only
// DataParallel passes frozen parameters here, under ZeRO-3.
import { Tensor, zeros, emptyMapped, noGrad, keep, elementSize, type DType } from '../../tensor/index.js';

export interface ParamSlot {
  readonly name: string;
  readonly param: Tensor;
  readonly shape: readonly number[];
  /** Element offset of the parameter in the layout (all buckets of the buffer end to end). */
  readonly offset: number;
  readonly numel: number;
  readonly bucket: Bucket;
}

export interface Bucket {
  /** Index in the buffer; collectives over buckets are issued in this order on every rank. */
  readonly index: number;
  /** Element range [offset, offset + numel) in the layout; numel includes padding. */
  readonly offset: number;
  readonly numel: number;
  /** numel / shard count. */
  readonly shardNumel: number;
  readonly slots: ParamSlot[];
  /** ZeRO-3: the size of the frozen parameters' region (padded; 0 for none) ([Note: frozen parameters]). */
  readonly frozenNumel: number;
  /** The frozen parameters (no gradient); a slot's offset - the bucket's - numel is its place in `frozenData`. */
  readonly frozenSlots: ParamSlot[];
  /** The full trainable parameter values (numel; its storage may be freed under ZeRO-3). */
  readonly data: Tensor;
  /** ZeRO-3: the full frozen parameter values in their own dtype (frozenNumel; freed like `data`), when there are any. */
  readonly frozenData?: Tensor;
  /** The full gradient (its storage may be freed under ZeRO-2/3 between backward passes). */
  readonly grad: Tensor;
  /** This rank's reduced gradient shard (sharded gradients only). */
  shardGrad?: Tensor;
  /** This rank's parameter shard (ZeRO-3 only): the shardNumel trainable values the optimizer updates. */
  shardData?: Tensor;
  /** This rank's shard of the frozen region (ZeRO-3, when there is one): frozenNumel / shards values. */
  frozenShardData?: Tensor;
}

export interface GradBufferOptions {
  /** Target bucket size in bytes (a bucket may exceed it to hold one large parameter). */
  bucketBytes?: number;
  /** Pad each bucket to a multiple of this many elements: the shard count (1 = no sharding). */
  padMultiple?: number;
  /**
   * One bucket per group instead of size-based buckets (ZeRO-3 wrapping units), in the order
   * given; every parameter must appear in exactly one group.
   */
  groups?: [string, Tensor][][];
  /**
   * ZeRO-2/3: the full gradient buckets start without storage (allocated, zeroed, when a backward
   * reaches them), instead of being zero-filled here and freed by the caller.
   */
  lazyGrad?: boolean;
  /** ZeRO-3: keep only this rank's shard of the parameter values (see [Note: sharded build]). */
  shard?: ShardBuild;
  /**
   * Initial values of parameters that have no storage yet ([Note: deferred init] in
   * src/nn/module.ts): writes the parameter `name` into `out`, a view of its bucket shaped like it.
   */
  init?: (name: string, out: Tensor) => void;
}

// [Note: sharded build] Under ZeRO-3 no rank needs the full parameters outside a unit's forward
// and backward, so the buffer is built a bucket at a time: the bucket's full values are made
// (copied from the parameters, or initialised where the model deferred its init), handed to
// `beforeShard` (rank 0's broadcast), this rank's shard is cloned into `shardData`, and the full
// storage is freed before the next bucket is made. With deferred init no rank ever holds more
// than one bucket (one wrapping unit) at full size.
export interface ShardBuild {
  /** This rank's shard index. */
  rank: number;
  /** Called with each bucket's full values before its shard is taken (the broadcast from rank 0). */
  beforeShard?: (bucket: Bucket) => void;
}

/** Flat parameter and gradient buckets for the parameters of one dtype. */
export class GradBuffer {
  readonly dtype: DType;
  /** Total elements over all buckets (padding included). */
  readonly numel: number;
  readonly shards: number;
  readonly buckets: Bucket[] = [];
  readonly slots: ParamSlot[] = [];
  readonly frozenSlots: ParamSlot[] = [];

  constructor(params: [string, Tensor][], opts: GradBufferOptions = {}) {
    const plan = planLayout(params, opts);
    const dtype = (this.dtype = plan.dtype);
    const pad = (this.shards = plan.pad);
    noGrad(() => {
      for (const { members, frozen, offset, numel, frozenNumel, frozenDtype } of plan.buckets) {
        // Storage that is freed and allocated again around every use lives on mapped pages
        // ([Note: mapped storage] in native/tensor.cc): given back to the OS when freed, it leaves
        // no bucket-sized holes in the malloc heap. lazyGrad's bytes are never touched here.
        const flat = (n: number, d: DType) => keep(opts.shard ? emptyMapped([n], { dtype: d }).zero_() : zeros([n], { dtype: d }));
        const bucket: Bucket = {
          index: this.buckets.length,
          offset,
          numel,
          shardNumel: numel / pad,
          slots: [],
          frozenNumel,
          frozenSlots: [],
          data: flat(numel, dtype),
          ...(frozenNumel > 0 ? { frozenData: flat(frozenNumel, frozenDtype) } : {}),
          grad: keep(opts.lazyGrad ? emptyMapped([numel], { dtype }) : zeros([numel], { dtype })),
        };
        const place = (name: string, p: Tensor, into: Tensor, at: number): void => {
          const n = p.numel();
          const dataView = into.narrow(0, at, n).view(...p.shape);
          if (isAllocated(p) || n === 0) {
            dataView.copy_(p);
          } else {
            if (!opts.init) throw new Error(`GradBuffer: parameter ${name} has no storage (built with deferred init) and no initialiser was given`);
            opts.init(name, dataView);
            allocStorage(p); // set_ takes only tensors with storage; these bytes are never touched
          }
          // The parameter object stays the same leaf (optimizers and hooks keep their references);
          // only its storage moves into the bucket.
          p.set_(dataView);
          dataView.dispose();
        };
        let at = 0;
        for (const [name, p] of members) {
          const shape = p.shape;
          const n = p.numel();
          place(name, p, bucket.data, at);
          const gradView = bucket.grad.narrow(0, at, n).view(...shape);
          p.grad = gradView;
          gradView.dispose();
          const slot: ParamSlot = { name, param: p, shape, offset: offset + at, numel: n, bucket };
          bucket.slots.push(slot);
          this.slots.push(slot);
          at += n;
        }
        // [Note: frozen parameters] values only, in their own region (numbered after the trainable one).
        at = 0;
        for (const [name, p] of frozen) {
          place(name, p, bucket.frozenData!, at);
          const slot: ParamSlot = { name, param: p, shape: p.shape, offset: offset + numel + at, numel: p.numel(), bucket };
          bucket.frozenSlots.push(slot);
          this.frozenSlots.push(slot);
          at += p.numel();
        }
        if (opts.lazyGrad) freeStorage(bucket.grad); // allocated (zeroed) when a backward reaches the bucket
        if (opts.shard) {
          // [Note: sharded build]
          opts.shard.beforeShard?.(bucket);
          const [lo] = shardRange(bucket, opts.shard.rank);
          const own = bucket.data.narrow(0, lo, bucket.shardNumel);
          bucket.shardData = keep(own.clone());
          own.dispose();
          freeStorage(bucket.data);
          if (bucket.frozenData) {
            const fs = frozenNumel / pad;
            const ownFrozen = bucket.frozenData.narrow(0, opts.shard.rank * fs, fs);
            bucket.frozenShardData = keep(ownFrozen.clone());
            ownFrozen.dispose();
            freeStorage(bucket.frozenData);
          }
        }
        this.buckets.push(bucket);
      }
    });
    this.numel = plan.numel;
  }

  /** Zeroes every allocated full gradient and every gradient shard (views stay assigned). */
  zeroGrad(): void {
    noGrad(() => {
      for (const b of this.buckets) {
        if (isAllocated(b.grad)) b.grad.zero_();
        b.shardGrad?.zero_();
      }
    });
  }

  dispose(): void {
    for (const b of this.buckets) {
      b.grad.dispose();
      b.data.dispose();
      b.frozenData?.dispose();
      b.shardGrad?.dispose();
      b.shardData?.dispose();
      b.frozenShardData?.dispose();
    }
  }
}

/** A view of a parameter's full gradient in its bucket, shaped like the parameter. */
export function gradView(slot: ParamSlot): Tensor {
  return slot.bucket.grad.narrow(0, slot.offset - slot.bucket.offset, slot.numel).view(...slot.shape);
}

/** The element range [start, end) of bucket shard k, relative to the bucket. */
export function shardRange(bucket: Bucket, k: number): [number, number] {
  return [k * bucket.shardNumel, (k + 1) * bucket.shardNumel];
}

/** Whether a flat bucket tensor currently has its bytes (false after freeStorage). */
export function isAllocated(t: Tensor): boolean {
  return t.storageNbytes() > 0;
}

/** Frees the bytes under a flat bucket tensor; every view keeps its shape. */
export function freeStorage(t: Tensor): void {
  if (isAllocated(t)) t.resizeStorage_(0);
}

/** Gives a freed flat bucket tensor its bytes back (zeroed when asked); a no-op when allocated. */
export function allocStorage(t: Tensor, opts: { zero?: boolean } = {}): boolean {
  if (isAllocated(t)) return false;
  t.resizeStorage_(t.numel() * elementSize(t.dtype));
  if (opts.zero) noGrad(() => t.variableData().zero_().dispose());
  return true;
}

function roundUp(n: number, m: number): number {
  return Math.ceil(n / m) * m;
}

// Fill buckets in reverse registration order, never splitting a parameter.
function planBySize(params: [string, Tensor][], bucketElems: number): [string, Tensor][][] {
  const plans: [string, Tensor][][] = [];
  let cur: [string, Tensor][] = [];
  let curNumel = 0;
  for (const e of [...params].reverse()) {
    const n = e[1].numel();
    if (cur.length > 0 && curNumel + n > bucketElems) {
      plans.push(cur);
      cur = [];
      curNumel = 0;
    }
    cur.push(e);
    curNumel += n;
  }
  if (cur.length > 0) plans.push(cur);
  return plans;
}

function planGroups(params: [string, Tensor][], groups: [string, Tensor][][]): [string, Tensor][][] {
  const wanted = new Set(params.map(([, p]) => p));
  const seen = new Set<Tensor>();
  for (const g of groups) {
    for (const [n, p] of g) {
      if (!wanted.has(p)) throw new Error(`GradBuffer: group member ${n} is not one of the buffer's parameters`);
      if (seen.has(p)) throw new Error(`GradBuffer: parameter ${n} appears in two groups`);
      seen.add(p);
    }
  }
  const missing = params.filter(([, p]) => !seen.has(p)).map(([n]) => n);
  if (missing.length > 0) throw new Error(`GradBuffer: parameters in no group: ${missing.join(', ')}`);
  return groups.filter((g) => g.length > 0);
}

interface LayoutPlan {
  dtype: DType;
  pad: number;
  numel: number;
  buckets: { members: [string, Tensor][]; frozen: [string, Tensor][]; offset: number; numel: number; frozenNumel: number; frozenDtype: DType }[];
}

// Where every parameter goes, without allocating anything (the constructor and describeLayout share it).
function planLayout(params: [string, Tensor][], opts: GradBufferOptions): LayoutPlan {
  if (params.length === 0) throw new Error('GradBuffer: no parameters');
  // The buffer's dtype is its trainable parameters' ([Note: frozen parameters]: frozen ones keep their own).
  const dtype = (params.find(([, p]) => p.requiresGrad) ?? params[0]!)[1].dtype;
  for (const [n, p] of params) {
    if (p.requiresGrad && p.dtype !== dtype) throw new Error(`GradBuffer: parameter ${n} is ${p.dtype}, buffer is ${dtype}; group parameters by dtype`);
    if (!p.isLeaf) throw new Error(`GradBuffer: parameter ${n} is not a leaf tensor`);
  }
  const pad = opts.padMultiple ?? 1;
  const plans = opts.groups ? planGroups(params, opts.groups) : planBySize(params, Math.max(1, Math.floor((opts.bucketBytes ?? 25 * 2 ** 20) / elementSize(dtype))));
  let offset = 0;
  const buckets = plans.map((all) => {
    // [Note: frozen parameters] the gradient layout is the trainable members'.
    const members = all.filter(([, p]) => p.requiresGrad);
    const frozen = all.filter(([, p]) => !p.requiresGrad);
    const used = members.reduce((a, [, p]) => a + p.numel(), 0);
    const numel = members.length === 0 ? 0 : Math.max(pad, roundUp(used, pad));
    const frozenNumel = roundUp(frozen.reduce((a, [, p]) => a + p.numel(), 0), pad);
    const frozenDtype = frozen[0]?.[1].dtype ?? dtype;
    const odd = frozen.find(([, p]) => p.dtype !== frozenDtype);
    if (odd) throw new Error(`GradBuffer: frozen parameter ${odd[0]} is ${odd[1].dtype} and ${frozen[0]![0]} of the same unit is ${frozenDtype}; store a unit's frozen parameters in one dtype`);
    const b = { members, frozen, offset, numel, frozenNumel, frozenDtype };
    offset += numel;
    return b;
  });
  return { dtype, pad, numel: offset, buckets };
}

/** What the layout check compares across ranks: per buffer its dtype, size and every slot's name, shape and offset. */
export interface LayoutDescription {
  readonly dtype: DType;
  readonly numel: number;
  /** Each slot with its dtype: a frozen region's may differ from the buffer's ([Note: frozen parameters]). */
  readonly slots: readonly { readonly name: string; readonly shape: readonly number[]; readonly offset: number; readonly dtype: DType }[];
}

/** The layouts buildGradBuffers(params, opts) would make, with nothing allocated or moved. */
export function describeLayout(params: [string, Tensor][], opts: GradBufferOptions = {}): LayoutDescription[] {
  return splitByDtype(params, opts).map(([ps, o]) => {
    const plan = planLayout(ps, o);
    const slots = plan.buckets.flatMap((b) => {
      let at = b.offset;
      const place = ([name, p]: [string, Tensor]) => {
        const slot = { name, shape: p.shape, offset: at, dtype: p.dtype };
        at += p.numel();
        return slot;
      };
      const trained = b.members.map(place);
      at = b.offset + b.numel;
      return [...trained, ...b.frozen.map(place)];
    });
    return { dtype: plan.dtype, numel: plan.numel, slots };
  });
}

/** Splits named parameters by dtype into one GradBuffer each (registration order kept). */
export function buildGradBuffers(params: [string, Tensor][], opts: GradBufferOptions = {}): GradBuffer[] {
  return splitByDtype(params, opts).map(([ps, o]) => new GradBuffer(ps, o));
}

// Trainable parameters go to the buffer of their dtype. A frozen one (ZeRO-3's groups only) goes
// with its group's trainable parameters, or, in a group of frozen ones only, with the first
// trainable parameter's buffer: every unit stays one bucket of one buffer, in group order, whatever
// dtype its frozen region has ([Note: frozen parameters]).
function splitByDtype(params: [string, Tensor][], opts: GradBufferOptions): [[string, Tensor][], GradBufferOptions][] {
  const byDtype = new Map<DType, [string, Tensor][]>();
  const first = (params.find(([, p]) => p.requiresGrad) ?? params[0])?.[1].dtype;
  const groupDtype = new Map<Tensor, DType>();
  for (const g of opts.groups ?? []) {
    const d = g.find(([, p]) => p.requiresGrad)?.[1].dtype ?? first;
    if (d !== undefined) for (const [, p] of g) if (!p.requiresGrad) groupDtype.set(p, d);
  }
  for (const e of params) {
    const d = e[1].requiresGrad ? e[1].dtype : groupDtype.get(e[1]) ?? e[1].dtype;
    if (!byDtype.has(d)) byDtype.set(d, []);
    byDtype.get(d)!.push(e);
  }
  return [...byDtype.values()].map((ps) => {
    const groups = opts.groups?.map((g) => g.filter(([, p]) => ps.some(([, q]) => q === p)));
    return [ps, { ...opts, ...(groups ? { groups } : {}) }];
  });
}
