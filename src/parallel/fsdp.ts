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
import { isGradEnabled, Tensor } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import { allocStorage, freeStorage, type Bucket } from './grad_buffer.js';
import { gatherInPlace } from './zero_gathers.js';

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
export const wholeModelUnit: UnitPolicy = () => false;

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

interface UnitState {
  name: string;
  module: Module;
  bucket: Bucket;
  isRoot: boolean;
  state: 'free' | 'gathering' | 'ready';
  work?: { wait(): void };
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
    private readonly opts: { reshardAfterForward: boolean; prefetch: boolean; onMemoryChange: () => void },
  ) {
    if (buckets.length !== plan.units.length) throw new Error(`FSDP: ${plan.units.length} units but ${buckets.length} buckets (one dtype per unit is supported)`);
    this.units = plan.units.map((u, i) => ({ ...u, bucket: buckets[i]!, isRoot: u.module === model, state: 'free' as const }));
    for (const u of this.units) this.unitOfBucket.set(u.bucket, u);
    this.root = this.units.find((u) => u.isRoot);
    for (const u of this.units) {
      if (u.isRoot) continue;
      this.removers.push(u.module.registerForwardPreHook(() => this.preForward(u)));
      this.removers.push(u.module.registerForwardHook((_m, args) => this.postForward(u, args)));
      this.removers.push(u.module.registerBackwardPreHook(() => this.preBackward(u)));
    }
    // The root's parameters are gathered when the model is entered (or when a unit first runs).
    this.removers.push(model.registerForwardPreHook(() => this.ensureRoot()));
  }

  private ensureRoot(): void {
    if (this.root) this.gather(this.root);
  }

  private preForward(u: UnitState): void {
    this.ensureRoot();
    this.gather(u);
    if (isGradEnabled() && !this.forwardOrder) this.recordingForward.push(u);
    if (this.opts.prefetch && this.forwardOrder) this.prefetchAfter(u, this.forwardOrder);
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
    this.backwardSeen.add(u);
    if (!this.backwardOrder) this.recordingBackward.push(u);
    this.gather(u);
    if (this.opts.prefetch && this.backwardOrder) this.prefetchAfter(u, this.backwardOrder);
  }

  private prefetchAfter(u: UnitState, order: UnitState[]): void {
    const i = order.indexOf(u);
    const next = i >= 0 ? order[i + 1] : undefined;
    if (next && next.state === 'free') this.issueGather(next);
  }

  private issueGather(u: UnitState): void {
    const b = u.bucket;
    if (allocStorage(b.data)) this.opts.onMemoryChange();
    u.work = gatherInPlace(this.group, b.data, b.shardNumel, b.shardData!); // [Note: in-place gathers]
    u.state = 'gathering';
  }

  // [Note: failed gather] After a failed all-gather the group is unusable (a timed-out or broken
  // collective), so the units keep the first error: whatever needs parameters later rethrows that
  // same error and issues nothing, and the clean-up paths (free, afterStep, dispose) neither wait
  // on the other in-flight gathers nor free memory they may still write. No later error can then
  // replace the one the user must see.
  private gather(u: UnitState): void {
    if (this.failure) throw this.failure.error;
    if (u.state === 'free') this.issueGather(u);
    if (u.state === 'gathering') {
      const work = u.work!;
      u.work = undefined;
      try {
        work.wait();
      } catch (e) {
        this.failure = { error: e };
        throw e;
      }
      u.state = 'ready';
    }
  }

  private free(u: UnitState): void {
    if (this.failure) return; // see [Note: failed gather]
    if (u.state === 'gathering') this.gather(u); // never free memory a collective is writing
    if (u.state !== 'ready') return;
    freeStorage(u.bucket.data);
    u.state = 'free';
    this.opts.onMemoryChange();
  }

  /** The unit's gradient bucket was launched for reduction: its backward is done. */
  onReduced(bucket: Bucket): void {
    const u = this.unitOfBucket.get(bucket);
    if (u && !u.isRoot) this.free(u);
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
    for (const u of this.units) this.free(u);
  }

  /** Runs fn with every unit gathered, then frees them again (every rank must call it). */
  withFullParameters<T>(fn: () => T): T {
    for (const u of this.units) if (u.state === 'free') this.issueGather(u);
    for (const u of this.units) this.gather(u);
    try {
      return fn();
    } finally {
      for (const u of this.units) if (!u.isRoot) this.free(u);
    }
  }

  dispose(): void {
    try {
      for (const u of this.units) if (u.state === 'gathering' && !this.failure) this.gather(u);
    } finally {
      for (const r of this.removers) r();
    }
    this.removers.length = 0;
  }
}
