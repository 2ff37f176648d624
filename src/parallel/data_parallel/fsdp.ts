// ZeRO-3 / FSDP: parameters are sharded; each wrapping unit's full parameters exist only around its
// forward and its backward.
//
// A unit is a module chosen by the unit policy (as FSDP2 users call fully_shard per block: by module
// class or by path, see unitsByClass / unitsByPath; the GPT's policy is gptUnits in
// src/models/gpt_parallel.ts) and owns the parameters of its subtree that no nested unit owns; the rest,
// and any parameter two units share (a tied embedding and head), belong to the root unit. Each unit
// is one bucket of the flat buffers (grad_buffer.ts), so gathering a unit is one all-gather of
// every rank's shard into the bucket's full `data`, and freeing it releases the bucket's storage.
//
// [Note: unit lifecycle]
//   pre-forward    gather the unit (waiting for a prefetch), prefetch the next unit in forward order
//   post-forward   free the unit (reshardAfterForward), and hook the gradient of its outputs
//   pre-backward   (that hook) gather the unit again, prefetch the next unit in backward order
//   reduced        once its gradient bucket is launched, the unit is freed again
//   end of step    the optimizer updated the shards: every gathered copy is stale and is freed
// Orders are recorded on the first step; every rank records the same ones, so every rank issues
// the same all-gathers in the same order. The root unit is gathered on first use in a step and
// kept until the step ends. Writes into a gathered bucket go through the bucket tensor, never
// through the parameter, so the version counters autograd checks on saved views do not move.
// Under bf16-mixed what is gathered, freed and regathered is the unit's bfloat16 copy instead of
// its float32 bucket ([Note: bf16 gathers] in fsdp_bf16.ts); the step's forward decides which, and
// the unit's backward regathers the same one.
import { isGradEnabled, Tensor, elementSize, type DType } from '../../tensor/index.js';
import { native } from '../../tensor/native.js';
import type { Module } from '../../nn/module.js';
import { currentPrecision, isPolicyReader, setGatheredSource } from '../../nn/precision.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import { allocStorage, freeStorage, type Bucket } from './grad_buffer.js';
import { gatherInPlace } from './zero_gathers.js';
import { Bf16UnitCopy } from './fsdp_bf16.js';
import { axisStride, computeBytes, crossesHosts, heldParamBytes, type PlanAxis } from '../../distributed/plan_terms.js';

/** Whether a module (by dotted name) is a wrapping unit of its own. */
export type UnitPolicy = (name: string, module: Module) => boolean;

/** A module class, for unitsByClass. */
export type ModuleClass = abstract new (...args: any[]) => Module;

/** A dotted module path: exact ('head'), with '*' for one path segment ('layers.*'), or a RegExp. */
export type PathPattern = string | RegExp;

function pathMatcher(p: PathPattern): (name: string) => boolean {
  if (p instanceof RegExp) return (n) => p.test(n);
  const re = new RegExp(`^${p.split('*').map((s) => s.replace(/[.+?^${}()|[\]\\]/g, '\\$&')).join('[^.]+')}$`);
  return (n) => re.test(n);
}

/**
 * Every module that is an instance of one of `classes` is a unit (e.g. the model's block class),
 * and so is every module whose path matches one of `paths`.
 */
export function unitsByClass(classes: readonly ModuleClass[], opts: { paths?: readonly PathPattern[] } = {}): UnitPolicy {
  const byPath = unitsByPath(opts.paths ?? []);
  return (name, m) => classes.some((c) => m instanceof c) || byPath(name, m);
}

/** Every module whose dotted path matches one of `paths` is a unit ('layers.*', 'head', /^enc\.\d+$/). */
export function unitsByPath(paths: readonly PathPattern[]): UnitPolicy {
  const ms = paths.map(pathMatcher);
  return (name) => ms.some((m) => m(name));
}

/** Without a policy the whole model is one unit: gathered for the whole step (see unitWarning). */
const wholeModelUnit: UnitPolicy = () => false;

/**
 * The warning for a plan with a single unit: its parameters are all gathered for the whole step,
 * so ZeRO-3 saves nothing over ZeRO-2. Names the fix.
 */
export function singleUnitWarning(model: Module): string {
  const kids = model.namedModules().filter(([n]) => n !== '' && !n.includes('.')).map(([n, m]) => `${n} (${m.constructor.name})`);
  return (
    'ZeRO-3: the model is one wrapping unit, so every parameter is gathered for the whole step and zero = 3 holds as much as zero = 2. ' +
    'Split it into units by module class or path, e.g. DataParallel(model, { zero: 3, units: unitsByClass([YourBlock]) }) or units: unitsByPath([\'layers.*\']) ' +
    `(in a parallelize plan: { units }); the model's top-level modules are ${kids.length > 0 ? kids.join(', ') : '(none)'}.`
  );
}

export interface UnitPlan {
  /** Per unit, its parameters (the groups handed to the gradient buffer, one bucket each). */
  groups: [string, Tensor][][];
  /** Per group, the unit's module and name ('' is the root unit). */
  units: { name: string; module: Module }[];
}

/** One full-size copy of a unit's parameters: the float32 bucket, or the bfloat16 copy. */
interface Gathered {
  /** The trainable region, and the frozen one after it when `frozen` is undefined (the bfloat16 copy). */
  data: Tensor;
  /** The frozen region in its own storage and dtype (the bucket's frozenData). */
  frozen?: Tensor;
  state: 'free' | 'gathering' | 'ready';
  work?: { wait(): void };
}

interface UnitState {
  name: string;
  module: Module;
  bucket: Bucket;
  isRoot: boolean;
  full: Gathered;
  /** The bfloat16 copy; undefined when a parameter of the unit is read outside the policy. */
  bf16?: Gathered & { copy: Bf16UnitCopy };
  /** Whether this step's forward used the bfloat16 copy (its backward regathers the same). */
  bf16ThisStep?: boolean;
}

export class FsdpUnits {
  private readonly units: UnitState[];
  private readonly root: UnitState | undefined; // no root unit when every parameter lives in a unit
  private readonly unitOfBucket = new Map<Bucket, UnitState>();
  private readonly removers: (() => void)[] = [];
  private forwardOrder: UnitState[] | undefined;
  private backwardOrder: UnitState[] | undefined;
  private recordingForward: UnitState[] = [];
  private recordingBackward: UnitState[] = [];
  private readonly backwardSeen = new Set<UnitState>();
  /** The first failed all-gather's error: see [Note: failed gather]. */
  private failure: { error: unknown } | undefined;
  /** Bytes this rank received from parameter gathers (diagnostics and tests). */
  gatheredBytes = 0;

  /** Chooses the units and the parameter group (bucket) of each, in bucket order. */
  static plan(model: Module, named: [string, Tensor][], policy: UnitPolicy = wholeModelUnit): UnitPlan {
    const nameOf = new Map(named.map(([n, p]) => [p, n]));
    const unitMods = model.namedModules().filter(([n, m]) => n !== '' && policy(n, m));
    const owner = new Map<Tensor, number>(); // param -> index into unitMods, innermost wins
    const shared = new Set<Tensor>();
    unitMods.forEach(([n, m], i) => {
      for (const [, p] of m.namedParameters()) {
        if (!nameOf.has(p)) continue;
        const prev = owner.get(p);
        if (prev === undefined || n.startsWith(`${unitMods[prev]![0]}.`)) owner.set(p, i);
        else if (!unitMods[i]![0].startsWith(`${unitMods[prev]![0]}.`) && !unitMods[prev]![0].startsWith(`${n}.`)) shared.add(p);
      }
    });
    for (const p of shared) owner.delete(p); // used by two units: the root owns it
    const groups: [string, Tensor][][] = [];
    const units: { name: string; module: Module }[] = [];
    // Reverse registration order: about the order backward reaches the units (the root last).
    for (let i = unitMods.length - 1; i >= 0; i--) {
      const g = named.filter(([, p]) => owner.get(p) === i);
      if (g.length === 0) continue;
      groups.push(g);
      units.push({ name: unitMods[i]![0], module: unitMods[i]![1] });
    }
    const rest = named.filter(([, p]) => owner.get(p) === undefined);
    if (rest.length > 0) {
      groups.push(rest);
      units.push({ name: '', module: model });
    }
    return { groups, units };
  }

  constructor(
    model: Module,
    plan: UnitPlan,
    buckets: Bucket[],
    private readonly group: ProcessGroup,
    private readonly opts: {
      reshardAfterForward: boolean;
      prefetch: boolean;
      onMemoryChange: () => void;
      /** Modules a forward enters through instead of the model itself (a pipeline's stages). */
      entries?: readonly Module[];
      /**
       * No gradient reduction tells the units that a backward ended (every parameter is frozen:
       * [Note: frozen parameters] in grad_buffer.ts), so they learn it from the engine themselves.
       */
      ownBackwardEnd?: boolean;
    },
  ) {
    if (buckets.length !== plan.units.length) throw new Error(`FSDP: ${plan.units.length} units but ${buckets.length} buckets (one dtype per unit is supported)`);
    const readers = policyReaderParams(model);
    this.units = plan.units.map((u, i) => {
      const bucket = buckets[i]!;
      const unit: UnitState = { ...u, bucket, isRoot: u.module === model, full: { data: bucket.data, ...(bucket.frozenData ? { frozen: bucket.frozenData } : {}), state: 'free' } };
      // [Note: bf16 gathers]: only float32 units whose every parameter is read through the policy.
      if (bucket.data.dtype === 'float32' && [...bucket.slots, ...bucket.frozenSlots].every((s) => readers.has(s.param))) {
        const copy = new Bf16UnitCopy(bucket);
        unit.bf16 = { data: copy.data, state: 'free', copy };
        for (const s of [...bucket.slots, ...bucket.frozenSlots]) setGatheredSource(s.param, (dtype) => this.gatheredCopy(unit, s.param, dtype));
      }
      return unit;
    });
    for (const u of this.units) this.unitOfBucket.set(u.bucket, u);
    this.root = this.units.find((u) => u.isRoot);
    for (const u of this.units) {
      if (u.isRoot) continue;
      this.removers.push(u.module.registerForwardPreHook(() => this.preForward(u)));
      this.removers.push(u.module.registerForwardHook((_m, args) => this.postForward(u, args)));
      this.removers.push(u.module.registerBackwardPreHook(() => this.preBackward(u)));
    }
    // The root's parameters are gathered when the model is entered (or when a unit first runs). A
    // pipeline never calls the container of its stages: each stage is an entry of its own, and the
    // root holds whatever of them lies outside the units (an embedding, a head).
    for (const m of opts.entries ?? [model]) this.removers.push(m.registerForwardPreHook(() => this.ensureRoot()));
  }

  /** Whether a forward now gathers the unit's bfloat16 copy: under bf16-mixed, when it has one. */
  private bf16Now(u: UnitState): boolean {
    return u.bf16 !== undefined && currentPrecision() === 'bf16-mixed';
  }

  /** The copy a gather of the unit uses now: its forward's in backward, else the precision's. */
  private copyFor(u: UnitState, phase: 'forward' | 'backward'): Gathered {
    const bf16 = phase === 'backward' && u.bf16ThisStep !== undefined ? u.bf16ThisStep : this.bf16Now(u);
    return bf16 ? u.bf16! : u.full;
  }

  /** castParam's source for a parameter of a unit with a bfloat16 copy (see setGatheredSource). */
  private gatheredCopy(u: UnitState, param: Tensor, dtype: DType): Tensor | undefined {
    const c = u.bf16!;
    if (c.state === 'gathering') this.gather(u, c);
    if (c.state !== 'ready') return undefined;
    return c.copy.param(param, dtype);
  }

  private ensureRoot(): void {
    if (!this.root) return;
    const c = this.copyFor(this.root, 'forward');
    this.root.bf16ThisStep = c !== this.root.full;
    this.gather(this.root, c);
  }

  private preForward(u: UnitState): void {
    this.ensureRoot();
    const c = this.copyFor(u, 'forward');
    u.bf16ThisStep = c !== u.full;
    this.gather(u, c);
    if (isGradEnabled() && !this.forwardOrder) this.recordingForward.push(u);
    if (this.opts.prefetch && this.forwardOrder) this.prefetchAfter(u, this.forwardOrder, 'forward');
  }

  private postForward(u: UnitState, args: unknown[]): void {
    if (this.opts.reshardAfterForward) this.free(u);
    if (isGradEnabled()) this.freeAfterBackward(u, args);
  }

  // [Note: post-backward free] A unit's parameters are needed by its backward until the gradient
  // of its inputs is complete: that gradient is the end of every path through the unit. Freeing
  // them then, and not only when the unit's gradient bucket is launched, matters on the first step,
  // whose reductions all wait for the end of backward (readiness is learned then, reducer.ts):
  // every unit stayed gathered through it and the step held the whole model twice over.
  private freeAfterBackward(u: UnitState, args: unknown[]): void {
    const inputs = args.filter((a): a is Tensor => a instanceof Tensor && a.requiresGrad);
    let left = inputs.length;
    for (const t of inputs) {
      t.registerHook(() => {
        if (--left === 0 && this.backwardSeen.has(u)) this.free(u);
        return undefined;
      });
    }
  }

  private preBackward(u: UnitState): void {
    if (this.backwardSeen.has(u)) return;
    if (this.opts.ownBackwardEnd && this.backwardSeen.size === 0) native.queueBackwardCallback(() => this.afterBackward());
    this.backwardSeen.add(u);
    if (!this.backwardOrder) this.recordingBackward.push(u);
    this.gather(u, this.copyFor(u, 'backward'));
    if (this.opts.prefetch && this.backwardOrder) this.prefetchAfter(u, this.backwardOrder, 'backward');
  }

  private prefetchAfter(u: UnitState, order: UnitState[], phase: 'forward' | 'backward'): void {
    const i = order.indexOf(u);
    const next = i >= 0 ? order[i + 1] : undefined;
    if (!next) return;
    const c = this.copyFor(next, phase);
    if (c.state === 'free') this.issueGather(next, c);
  }

  private issueGather(u: UnitState, c: Gathered): void {
    const b = u.bucket;
    const a = allocStorage(c.data), f = c.frozen ? allocStorage(c.frozen) : false;
    if (a || f) this.opts.onMemoryChange();
    // This rank's shards go in cast to the copy's dtype ([Note: bf16 gathers]); the trainable and
    // the frozen regions are gathered each from its own shard into its place ([Note: frozen
    // parameters]): the frozen one in its own dtype into the bucket's frozenData, or, for the
    // bfloat16 copy, after the trainable region (a bfloat16 base is gathered as it is stored).
    const works: { wait(): void }[] = [];
    const fs = b.frozenNumel / this.group.size;
    if (b.numel > 0) works.push(gatherRegion(this.group, c.data, 0, b.shardNumel, b.shardData!, 0)); // [Note: in-place gathers]
    if (fs > 0) works.push(gatherRegion(this.group, c.frozen ?? c.data, c.frozen ? 0 : b.numel, fs, b.frozenShardData!, 0));
    c.work = { wait: () => works.forEach((w) => w.wait()) };
    c.state = 'gathering';
    this.gatheredBytes += (b.numel - b.shardNumel) * elementSize(c.data.dtype) + (b.frozenNumel - fs) * elementSize((c.frozen ?? c.data).dtype);
  }

  // [Note: failed gather] After a failed all-gather the group is unusable (a timed-out or broken
  // collective), so the units keep the first error: whatever needs parameters later rethrows that
  // same error and issues nothing, and the clean-up paths (free, afterStep, dispose) neither wait
  // on the other in-flight gathers nor free memory they may still write. No later error can then
  // replace the one the user must see.
  private gather(u: UnitState, c: Gathered): void {
    if (this.failure) throw this.failure.error;
    if (c.state === 'free') this.issueGather(u, c);
    if (c.state === 'gathering') {
      const work = c.work!;
      c.work = undefined;
      try {
        work.wait();
      } catch (e) {
        this.failure = { error: e };
        throw e;
      }
      c.state = 'ready';
    }
  }

  /** Frees both copies of the unit. */
  private free(u: UnitState): void {
    if (this.failure) return; // see [Note: failed gather]
    for (const c of u.bf16 ? [u.full, u.bf16] : [u.full]) {
      if (c.state === 'gathering') this.gather(u, c); // never free memory a collective is writing
      if (c.state !== 'ready') continue;
      freeStorage(c.data);
      if (c.frozen) freeStorage(c.frozen);
      c.state = 'free';
      this.opts.onMemoryChange();
    }
  }

  /** The bucket's bfloat16 copy, if its unit has one (memory accounting). */
  bf16CopyOf(bucket: Bucket): Tensor | undefined {
    return this.unitOfBucket.get(bucket)?.bf16?.data;
  }

  /**
   * The unit's gradient bucket was launched for reduction: its backward is done, unless it holds
   * frozen parameters. Their part of backward (the gradient of the unit's input through a frozen
   * weight, e.g. a LoRA base beside its adapters) can still be to come after every trainable
   * gradient of the unit is ready, so such a unit is freed once the gradient of its inputs is
   * complete ([Note: post-backward free]) or at the end of backward.
   */
  onReduced(bucket: Bucket): void {
    const u = this.unitOfBucket.get(bucket);
    if (u && !u.isRoot && bucket.frozenNumel === 0) this.free(u);
  }

  /** End of a backward pass: nothing but the root stays gathered. */
  afterBackward(): void {
    if (!this.forwardOrder && this.recordingForward.length > 0) this.forwardOrder = this.recordingForward;
    if (!this.backwardOrder && this.recordingBackward.length > 0) this.backwardOrder = this.recordingBackward;
    this.backwardSeen.clear();
    for (const u of this.units) if (!u.isRoot) this.free(u);
  }

  /** The optimizer changed the shards: every gathered copy is stale. */
  afterStep(): void {
    this.backwardSeen.clear();
    for (const u of this.units) {
      this.free(u);
      u.bf16ThisStep = undefined;
    }
  }

  /** Runs fn with every unit's float32 parameters gathered, then frees them again (every rank must call it). */
  withFullParameters<T>(fn: () => T): T {
    for (const u of this.units) if (u.full.state === 'free') this.issueGather(u, u.full);
    for (const u of this.units) this.gather(u, u.full);
    try {
      return fn();
    } finally {
      for (const u of this.units) if (!u.isRoot) this.free(u);
    }
  }

  dispose(): void {
    try {
      for (const u of this.units) {
        for (const c of u.bf16 ? [u.full, u.bf16] : [u.full]) if (c.state === 'gathering' && !this.failure) this.gather(u, c);
      }
    } finally {
      for (const r of this.removers) r();
      for (const u of this.units) {
        if (!u.bf16) continue;
        for (const s of [...u.bucket.slots, ...u.bucket.frozenSlots]) setGatheredSource(s.param, undefined);
        if (!this.failure) u.bf16.copy.dispose(); // after a failed gather a collective may still write it
      }
    }
    this.removers.length = 0;
  }
}

/** Gathers one region of a unit's flat copy: every rank's `shardNumel` elements at `at`, this rank's taken from `own` at `ownAt`. */
function gatherRegion(group: ProcessGroup, data: Tensor, at: number, shardNumel: number, own: Tensor, ownAt: number): { wait(): void } {
  const region = data.narrow(0, at, shardNumel * group.size);
  const mine = own.narrow(0, ownAt, shardNumel);
  try {
    return gatherInPlace(group, region, shardNumel, mine);
  } finally {
    region.dispose();
    mine.dispose();
  }
}

/**
 * The parameters every module that holds them reads through the precision policy
 * (readsParametersThroughPolicy): a parameter registered by any other module, even as a second
 * owner (a tied weight), is left out.
 */
function policyReaderParams(model: Module): Set<Tensor> {
  const ok = new Set<Tensor>();
  const not = new Set<Tensor>();
  for (const [, m] of model.namedModules()) {
    for (const [n, p] of m.namedParameters()) {
      if (n.includes('.')) continue; // a child's: judged with the child
      (isPolicyReader(m) ? ok : not).add(p);
    }
  }
  for (const p of not) ok.delete(p);
  return ok;
}

/**
 * What ZeRO-3 changes on a rank, for the planner ([Note: plan terms] in
 * src/distributed/plan_terms.ts): the parameters are a 1 / (dpShard x cp) shard, and around each
 * unit's forward and backward its full parameters exist too (the unit being computed and the one
 * prefetched: two of the largest, three with frozen parameters, in bfloat16 under bf16-mixed,
 * [Note: unit lifecycle]); each unit is all-gathered in forward and again in backward (once when
 * reshardAfterForward is off), every micro-batch.
 */
export const zero3PlanAxis = {
  name: 'ZeRO-3',
  fields: ['reshardAfterForward'] as const,
  apply(b, ctx) {
    const l = ctx.layout;
    if (l.zero !== 3) return;
    const shard = l.dpShard * l.cp;
    const P = b.paramsHeld;
    // Bytes of the rank's parameters as held, and as gathered: bfloat16 under bf16-mixed, else as
    // stored (a LoRA base in its own dtype, [Note: LoRA plan]).
    const held = heldParamBytes(ctx.model, P, b.frozenParams);
    const gathered = computeBytes(l) === 2 ? 2 : P > 0 ? held / P : 4;
    b.memory.parameters -= held - held / shard;
    // A unit holding frozen parameters is freed only once the gradient of its input is complete
    // (onReduced, [Note: post-backward free]), by when backward has gathered the next unit and
    // prefetched the one after: three of the largest then, not two.
    const units = b.frozenParams > 0 ? 3 : 2;
    if (shard > 1) b.memory.zero3Gathers += units * gathered * Math.min(ctx.model.largestUnitParams, P);
    if (shard === 1) return;
    const passes = ctx.reshardAfterForward ? 2 : 1;
    const cross = crossesHosts(axisStride(l, 'dpShard'), shard, ctx.ranksPerHost);
    // One gather per wrapping unit (each block, and the root's parameters outside them).
    b.comm.push({ what: 'ZeRO-3 unit all-gathers', op: 'allGather', group: shard, bytes: gathered * P, times: passes * l.microBatches, calls: b.blocks + 1, zero3Unit: true, overlaps: 'backward', crossHost: cross });
  },
} satisfies PlanAxis;
