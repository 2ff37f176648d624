// Data parallelism, replicated or sharded, over the flat buckets of grad_buffer.ts.
//
//   zero 0  DDP: every rank holds all parameters and the all-reduced gradient.
//   zero 1  as DDP, but each rank updates only its shard of every bucket (the optimizer holds state
//           for that shard only) and the parameter buckets are all-gathered after the step.
//   zero 2  gradients are reduce-scattered: each rank keeps only its gradient shard after backward
//           (the full gradient bucket is freed once reduced, and re-allocated when the next
//           backward reaches it).
//   zero 3  parameters are sharded too (FSDP): see fsdp.ts for gathering and freeing them around
//           each wrapping unit's forward and backward.
// Hybrid sharding (HSDP): with a replicate group, gradients are reduce-scattered in the shard group
// and the shards all-reduced across replicas. Every launch is scheduled by reducer.ts ([Note:
// readiness]), in bucket order, while backward runs.
//
// Split by concern, as FSDP2's _fully_shard/ is: this file is the public wrapper and the gradient
// reduction (launch, accumulate, finish); checks.ts the wrap-time checks and the initial
// broadcast; zero_gathers.ts ZeRO-1/2's parameter all-gathers after the step; fsdp.ts ZeRO-3's
// units; grad_reads.ts the gradient API over the buckets; memory.ts the memory accounting.
//
// [Note: accumulation] With several micro-batches per step, `accumulate` picks when to reduce:
//   'reduceLast'   no collective until the last micro-batch (earlier ones run inside noSync() and
//                  accumulate into the full gradient buckets): least communication. The only
//                  flavour for zero 0/1, whose gradients are not sharded.
//   'reduceEach'   every micro-batch's backward reduces into the gradient shards, and the full
//                  buckets are freed in between: least memory, the default for zero 2/3.
//   'reduceScatterEachAllReduceLast'  (HSDP) reduce-scatter every micro-batch, all-reduce across
//                  replicas only on the last one.
// All give the same numbers: the average is taken by pre-scaling each bucket by 1/(dp size) before
// it is summed. noSync() always means "not the last micro-batch"; what it saves depends on the
// flavour chosen at wrap time, never silently nothing.
import { Tensor, noGrad, tidy, zeros, tensor, emptyMapped, keep } from '../../tensor/index.js';
import type { Module } from '../../nn/module.js';
import type { ProcessGroup, Work } from '../../distributed/process_group.js';
import { GradBuffer, buildGradBuffers, describeLayout, allocStorage, freeStorage, isAllocated, type Bucket, type ParamSlot } from './grad_buffer.js';
import { Reducer } from './reducer.js';
import { FsdpUnits, singleUnitWarning, type UnitPolicy } from './fsdp.js';
import type { GradientSource, GradShard, StepPiece } from '../grads.js';
import { MemoryMeter, type MemoryReport } from './memory.js';
import { checkOptions, verifySameLayout, broadcastState } from './checks.js';
import { ParamGathers } from './zero_gathers.js';
import { fullGradOf, localGradShardOf, normPiecesOf, pieceLayoutOf } from './grad_reads.js';

export type { MemoryReport } from './memory.js';
import { defaultBucketSizeMb, resolveAccumulate, type AccumulateFlavour, type ZeroStage } from '../layout.js';
import { axisStride, crossesHosts, heldParamBytes, trainedParams, type PlanAxis } from '../../distributed/plan_terms.js';

export type { ZeroStage, AccumulateFlavour } from '../layout.js';

export interface DataParallelOptions {
  /** Every data-parallel rank (for HSDP: shard x replicate ranks). */
  group: ProcessGroup;
  /** 0 = plain data parallel; 1, 2, 3 = ZeRO stages (default 0). */
  zero?: ZeroStage;
  /** Ranks that split the model state among themselves (default: group). */
  shardGroup?: ProcessGroup;
  /** HSDP: ranks that hold the same shard (the gradient shard is all-reduced over them). */
  replicateGroup?: ProcessGroup;
  /** When gradients are reduced under accumulation (see [Note: accumulation]). */
  accumulate?: AccumulateFlavour;
  /** Bucket size in MiB (default: defaultBucketSizeMb(zero)); zero 3 uses one bucket per wrapping unit. */
  bucketSizeMb?: number;
  /** Launch each bucket's collective during backward as soon as it is ready (default true). */
  overlap?: boolean;
  /**
   * Parameters that got no gradient in a step are allowed: their gradients stay zero and the
   * optimizer skips them (no decay, no step) unless some rank used them. Without it, such
   * parameters are an error that names them.
   */
  findUnusedParameters?: boolean;
  /**
   * What to do when a gradient holds NaN/Inf before reduction: 'raise' on every rank, 'skip' the
   * step on every rank (finishGradSync returns false and gradients are zeroed), or 'off'.
   */
  nonFinite?: 'off' | 'raise' | 'skip';
  /** Broadcast parameters and buffers from rank 0 at wrap time (default true). */
  broadcastFromRank0?: boolean;
  /**
   * Zero 3: which modules are wrapping units (unitsByClass / unitsByPath in fsdp.ts). Without it the
   * whole model is one unit, gathered for the whole step, and a warning says how to split it.
   */
  units?: UnitPolicy;
  /**
   * Zero 3: the modules a forward enters through when the wrapped module itself is never called (a
   * pipeline's stages under one container): entering any gathers the root unit. Default: the module.
   */
  entries?: readonly Module[];
  /** Zero 3: free a unit's gathered parameters after its forward (default true; false keeps them until backward). */
  reshardAfterForward?: boolean;
  /** Zero 3: gather the next unit while the current one computes (default true). */
  prefetch?: boolean;
  /**
   * What the gradient collectives move (default 'fp32'). 'bf16' casts each float32 bucket for the
   * collective and adds the result back in float32: half the bytes; accumulation stays float32.
   */
  reduceDtype?: 'fp32' | 'bf16';
  /**
   * Parameters another wrapper holds (expert parallelism's experts, reduced over their own group):
   * left out of this wrapper's buckets, its broadcast and its checks.
   */
  exclude?: ReadonlySet<Tensor>;
  /**
   * The factor each rank's gradient bucket is multiplied by before the sum over the group (default
   * 1 / group size: the average). Experts held by ep ranks already hold the sum over their ep
   * group's tokens, so they are scaled by 1 / (every data-parallel rank) instead.
   */
  gradScale?: number;
}

/** Sharded reductions allowed in flight at a launch before the oldest is waited for ([Note: reduction window]). */
const MAX_REDUCTIONS_IN_FLIGHT = 1;

export interface SyncRecord {
  /** Bucket indices in launch order, with whether each was launched from inside backward. */
  launches: { bucket: number; inBackward: boolean }[];
}

interface BucketRun {
  bucket: Bucket;
  work?: Work; // reduction in flight
  recv?: Tensor; // reduce-scatter output before it is added into shardGrad
  wire?: Tensor; // reduceDtype 'bf16': the bucket as sent
  nonFinite: boolean;
}

type Window = 'idle' | 'ready' | 'stepped';

/** Each parameter once (a tensor registered under two names, tied in one module, is placed once). */
function uniqueParams(named: [string, Tensor][]): [string, Tensor][] {
  const seen = new Set<Tensor>();
  return named.filter(([, p]) => !seen.has(p) && (seen.add(p), true));
}

export class DataParallel<M extends Module = Module> implements GradientSource {
  readonly module: M;
  private readonly reduceDtype: 'fp32' | 'bf16';
  readonly group: ProcessGroup;
  readonly shardGroup: ProcessGroup;
  readonly replicateGroup: ProcessGroup | undefined;
  readonly zero: ZeroStage;
  readonly accumulate: AccumulateFlavour;
  readonly buffers: GradBuffer[];
  readonly overlap: boolean;
  readonly findUnusedParameters: boolean;
  readonly nonFinite: 'off' | 'raise' | 'skip';
  /** What the last finishGradSync did (tests and diagnostics read it). */
  lastSync: SyncRecord = { launches: [] };

  private readonly runs: BucketRun[] = [];
  private readonly runOf = new Map<Bucket, BucketRun>();
  private readonly slotOf = new Map<Tensor, ParamSlot>();
  /** Every bucket, those of frozen parameters only included (ZeRO-3 gathers them; runs are the ones reduced). */
  private readonly allBuckets: Bucket[] = [];
  /** ZeRO-3: frozen parameters in their unit's bucket ([Note: frozen parameters] in grad_buffer.ts). */
  private readonly frozenSlotOf = new Map<Tensor, ParamSlot>();
  /** Zero 0/1/2: frozen parameters, whole on every rank outside the buckets. */
  private readonly frozenOutside: Tensor[];
  private readonly reducer: Reducer;
  private readonly fsdp: FsdpUnits | undefined;
  private gathers: ParamGathers | undefined; // zero 1/2: the parameter all-gathers after the step
  private readonly removeHooks: (() => void)[] = [];
  private lastMicroBatch = true;
  private holding = false; // holdReductions() until reduceAccumulated()
  private window: Window = 'idle';
  private usedThisStep: Set<Tensor> | undefined; // parameters with a gradient on some rank (findUnusedParameters)
  private readonly meter = new MemoryMeter(
    () => this.allBuckets.map((bucket) => ({ bucket, recv: this.runOf.get(bucket)?.recv, copy: this.fsdp?.bf16CopyOf(bucket) })),
    () => this.frozenOutside,
  );
  private readonly gradScale: number;
  private readonly exclude: ReadonlySet<Tensor>;
  private readonly inFlight: BucketRun[] = []; // sharded reductions not yet completed, in launch order ([Note: reduction window])

  constructor(module: M, opts: DataParallelOptions) {
    this.module = module;
    this.group = opts.group;
    this.zero = opts.zero ?? 0;
    this.shardGroup = opts.shardGroup ?? opts.group;
    this.replicateGroup = opts.replicateGroup && opts.replicateGroup.size > 1 ? opts.replicateGroup : undefined;
    this.overlap = opts.overlap ?? true;
    this.findUnusedParameters = opts.findUnusedParameters ?? false;
    this.nonFinite = opts.nonFinite ?? 'off';
    this.reduceDtype = opts.reduceDtype ?? 'fp32';
    this.accumulate = resolveAccumulate(this.zero, opts.accumulate);
    checkOptions(this.zero, this.accumulate, this.group, this.shardGroup, this.replicateGroup);

    this.gradScale = opts.gradScale ?? 1 / this.group.size;
    this.exclude = opts.exclude ?? new Set();
    // [Note: frozen parameters] in grad_buffer.ts: the buckets' gradients are the trainable
    // parameters'; under ZeRO-3 the frozen ones are sharded in their unit's bucket too, otherwise
    // they stay whole outside the buckets.
    const all = module.namedParameters().filter(([, p]) => !this.exclude.has(p));
    const named = all.filter(([, p]) => p.requiresGrad);
    // Only frozen parameters (a pipeline stage or the experts of a partly frozen model) is allowed:
    // they are placed, and no gradient is waited for.
    if (all.length === 0) throw new Error('DataParallel: the module has no parameters');
    const placed = this.zero === 3 ? uniqueParams(all) : named;
    const sharded = this.zero >= 1;
    const units = this.zero === 3 ? FsdpUnits.plan(module, placed, opts.units) : undefined;
    if (units && units.units.length === 1 && this.group.rank === 0) {
      process.emitWarning(singleUnitWarning(module), { type: 'FlotillaWarning', code: 'FLOTILLA_SINGLE_UNIT' });
    }
    const layout = {
      bucketBytes: (opts.bucketSizeMb ?? defaultBucketSizeMb(this.zero)) * 2 ** 20,
      padMultiple: sharded ? this.shardGroup.size : this.group.size,
      ...(units ? { groups: units.groups } : {}),
    };
    verifySameLayout(this.group, describeLayout(placed, layout), `zero${this.zero}:${this.accumulate}`);
    const broadcast = (opts.broadcastFromRank0 ?? true) && this.group.size > 1;
    // A model built with deferred init ([Note: deferred init] in src/nn/module.ts) gets its values
    // bucket by bucket here; parameters outside the buckets (frozen ones under zero 0/1/2) are made whole first.
    const deferred = module.deferredInit;
    if (deferred) {
      const inBuckets = new Set(placed.map(([, p]) => p));
      noGrad(() => {
        for (const [n, p] of module.namedParameters()) {
          if (inBuckets.has(p) || isAllocated(p) || p.numel() === 0) continue;
          allocStorage(p);
          deferred.init(n, p);
        }
      });
    }
    this.buffers = buildGradBuffers(placed, {
      ...layout,
      // ZeRO-2/3: full gradient buckets exist only while a backward fills them.
      lazyGrad: this.zero >= 2,
      ...(deferred ? { init: (n: string, out: Tensor) => deferred.init(n, out) } : {}),
      // ZeRO-3: a bucket at a time, broadcast from rank 0 and cut to this rank's shard ([Note: sharded build]).
      ...(this.zero === 3 ? { shard: { rank: this.shardGroup.rank, ...(broadcast ? { beforeShard: (b: Bucket) => this.broadcastBucket(b) } : {}) } } : {}),
    });
    module.deferredInit = undefined;
    for (const buffer of this.buffers) {
      for (const bucket of buffer.buckets) {
        this.allBuckets.push(bucket);
        if (bucket.numel === 0) continue; // a unit of frozen parameters only: nothing to reduce
        const run: BucketRun = { bucket, nonFinite: false };
        this.runs.push(run);
        this.runOf.set(bucket, run);
      }
      for (const slot of buffer.slots) this.slotOf.set(slot.param, slot);
      for (const slot of buffer.frozenSlots) this.frozenSlotOf.set(slot.param, slot);
    }
    this.frozenOutside = uniqueParams(all).filter(([, p]) => !p.requiresGrad && !this.frozenSlotOf.has(p)).map(([, p]) => p);
    // ZeRO-3 broadcast each bucket while it was whole, above.
    if (broadcast) broadcastState(this.group, module, this.zero === 3 ? [] : this.runs.map((r) => r.bucket), new Set([...this.slotOf.keys(), ...this.frozenSlotOf.keys(), ...this.exclude]));

    if (this.zero >= 2) {
      for (const { bucket } of this.runs) bucket.shardGrad = keep(zeros([bucket.shardNumel], { dtype: bucket.grad.dtype }));
    }
    if (this.zero >= 2) {
      const msg = (name: string) =>
        `parameter '${name}': its gradient is sharded under ZeRO-${this.zero} (each rank keeps only its shard), so .grad is not readable; ` +
        `use fullGrad(param) (a collective: every rank calls it) or localGradShard(param) of the data-parallel wrapper`;
      for (const s of this.slotOf.values()) s.param.gradAccessError = msg(s.name);
    }

    this.reducer = new Reducer(this.runs.map((r) => r.bucket), {
      beforeAccumulate: (b) => this.beforeAccumulate(b),
      launch: (b) => this.launch(this.runOf.get(b)!),
      onBackwardEnd: () => this.fsdp?.afterBackward(),
    }, { owner: 'DataParallel', overlap: this.overlap, reduceEachBackward: this.accumulate !== 'reduceLast' });
    this.reducer.syncEnabled = this.reducesNow();

    if (units) {
      this.fsdp = new FsdpUnits(module, units, this.allBuckets, this.shardGroup, {
        reshardAfterForward: opts.reshardAfterForward ?? true,
        prefetch: opts.prefetch ?? true,
        onMemoryChange: () => this.notePeak(),
        ...(opts.entries ? { entries: opts.entries } : {}),
        ...(this.runs.length === 0 ? { ownBackwardEnd: true } : {}),
      });
    } else if (this.zero >= 1 && this.shardGroup.size > 1) {
      this.gathers = new ParamGathers(this.shardGroup);
      this.removeHooks.push(...this.gathers.installWaits(module, this.slotOf));
    }
    this.resetPeak();
  }

  /** ZeRO-3's build: rank 0's full values of a bucket, both regions ([Note: sharded build] in grad_buffer.ts). */
  private broadcastBucket(b: Bucket): void {
    const works = [...(b.numel > 0 ? [this.group.broadcast(b.data, 0)] : []), ...(b.frozenData ? [this.group.broadcast(b.frozenData, 0)] : [])];
    for (const w of works) w.wait();
  }

  // ---- forward and micro-batches

  /** Calls the wrapped module (its forward hooks included). */
  forward(...args: Parameters<M extends { forward: (...a: infer A) => unknown } ? (...a: A) => unknown : never>):
    ReturnType<M extends { forward: (...a: never[]) => infer R } ? () => R : never> {
    return (this.module as unknown as { call: (...a: unknown[]) => never }).call(...args);
  }

  /** Marks the coming backward passes as not the last micro-batch (false) or the last (true). */
  requireGradientSync(flag: boolean): void {
    this.lastMicroBatch = flag;
    this.reducer.syncEnabled = this.reducesNow();
  }

  /** Runs fn (forward and backward of a non-final micro-batch); see [Note: accumulation]. */
  noSync<T>(fn: () => T): T {
    const prev = this.lastMicroBatch;
    this.requireGradientSync(false);
    try {
      return fn();
    } finally {
      this.requireGradientSync(prev);
    }
  }

  private reducesNow(): boolean {
    return !this.holding && (this.lastMicroBatch || this.accumulate !== 'reduceLast');
  }

  // ---- reduction (called by the reducer)

  private beforeAccumulate(bucket: Bucket): void {
    const run = this.runOf.get(bucket)!;
    if (run.work) this.complete(run); // the previous micro-batch's reduction reads this bucket
    if (allocStorage(bucket.grad, { zero: true })) this.notePeak();
  }

  private launch(run: BucketRun): void {
    // A bucket no gradient reached on this rank (unused parameters) still joins the collective,
    // with zeros.
    this.beforeAccumulate(run.bucket);
    const g = run.bucket.grad;
    if (this.nonFinite !== 'off' && !run.nonFinite) run.nonFinite = tidy(() => !g.isfinite().all().item());
    const scale = this.averagingScale(run.bucket);
    if (scale !== 1) noGrad(() => g.mul_(scale)); // average = pre-scale, then sum
    // reduceDtype 'bf16': the collective moves a bfloat16 copy; complete() adds it back in float32.
    const wire = this.reduceDtype === 'bf16' && this.group.size > 1 ? (run.wire = keep(noGrad(() => g.to('bfloat16')))) : g;
    if (this.zero <= 1) {
      if (this.group.size > 1) run.work = this.group.allReduce(wire, 'sum');
      return;
    }
    // Room first: the previous bucket's full gradient, staging and shard are freed before this
    // bucket's are allocated ([Note: reduction window]).
    this.retireReductions(MAX_REDUCTIONS_IN_FLIGHT - 1);
    run.recv = keep(emptyMapped([run.bucket.shardNumel], { dtype: wire.dtype })); // freed by complete() ([Note: mapped storage])
    run.work = this.shardGroup.reduceScatter(run.recv, wire, 'sum');
    this.notePeak();
    this.fsdp?.onReduced(run.bucket);
    this.inFlight.push(run);
  }

  // [Note: reduction window] A sharded bucket's reduction holds the full gradient bucket, the
  // collective's staging and the received shard until complete() adds the shard in and frees them.
  // Completed only in finishGradSync, every bucket's full gradient and staging stayed alive to the
  // end of backward, and ZeRO-2 peaked above plain data parallelism. So a launch first completes
  // the reductions in flight down to MAX_REDUCTIONS_IN_FLIGHT - 1, oldest first: the previous
  // bucket's buffers are freed before this one's are allocated, whatever the timing; the backend
  // runs them in launch order, so the wait gives up little overlap. Completing is never
  // opportunistic (when a collective happens to be done): under HSDP, complete() issues the
  // replicate group's all-reduce, and a rank that issued it earlier than its peers, then blocked
  // on it while they waited in the shard group's next gather, closed a cycle of waits across the
  // two groups. Completions at fixed points of the program are in the same order on every rank.
  private retireReductions(keepAtMost: number): void {
    while (this.inFlight.length > keepAtMost) this.complete(this.inFlight.shift()!);
  }

  /**
   * The factor a bucket is scaled by before it is summed over the group: 1/N, so the sum is the
   * average. (Tests replace it on the prototype to prove that verification catches a wrong one.)
   */
  protected averagingScale(_bucket: Bucket): number {
    return this.gradScale;
  }

  /** Waits for a bucket's reduction and folds it into the gradient shard (sharded modes), freeing the full bucket. */
  private complete(run: BucketRun): void {
    const work = run.work;
    if (!work) return;
    run.work = undefined;
    work.wait();
    const wire = run.wire;
    run.wire = undefined;
    if (this.zero <= 1) {
      if (wire) {
        noGrad(() => run.bucket.grad.copy_(wire));
        wire.dispose();
      }
      return;
    }
    wire?.dispose();
    const recv = run.recv!;
    // HSDP: under 'reduceEach' every micro-batch's shard is averaged across replicas now; the other
    // flavours all-reduce the accumulated shard once, in finishGradSync.
    if (this.replicateGroup && this.accumulate === 'reduceEach') this.replicateGroup.allReduce(recv, 'sum').wait();
    noGrad(() => run.bucket.shardGrad!.add_(recv));
    freeStorage(run.bucket.grad);
    recv.dispose();
    run.recv = undefined;
  }

  // ---- callers that run backward passes themselves (pipeline schedules)

  /**
   * Allocates (zeroed) every full gradient bucket that is freed, so gradients may be written into
   * .grad views directly, outside autograd's accumulator (a zero-bubble weight-gradient pass).
   */
  allocateGradients(): void {
    for (const run of this.runs) this.beforeAccumulate(run.bucket);
  }

  /**
   * Until reduceAccumulated(), backward passes only accumulate into the full buckets, whatever the
   * flavour: for a pipeline schedule, whose passes interleave and whose weight pass and tied
   * sums write into the buckets after autograd's. Implies requireGradientSync(false).
   */
  holdReductions(): void {
    this.holding = true;
    this.requireGradientSync(false);
  }

  /** Tells the reducer that `param` received a gradient written by hand this step (see allocateGradients). */
  markGradient(param: Tensor): void {
    this.reducer.markUsed(this.requireSlot(param));
  }

  /**
   * Reduces what the backward passes run with gradient sync off accumulated, all buckets in index
   * order, like the end of one synchronised backward; then call finishGradSync(). This is how a
   * pipeline, whose schedule interleaves many backward passes, reduces once per step.
   */
  reduceAccumulated(): void {
    this.holding = false;
    this.requireGradientSync(true);
    this.reducer.launchAll();
  }

  /**
   * Waits for every bucket's reduction; call after the final micro-batch's backward, before the
   * optimizer. Returns false when the step must be skipped (nonFinite: 'skip' saw NaN/Inf on some rank).
   */
  finishGradSync(): boolean {
    if (!this.lastMicroBatch) {
      throw new Error('DataParallel: finishGradSync() called while gradient sync is off (inside noSync / requireGradientSync(false))');
    }
    if (this.runs.length === 0) {
      // Frozen parameters only: no gradient to wait for or reduce.
      this.window = 'ready';
      return true;
    }
    try {
      this.reducer.settle();
      if (this.reducer.failure) {
        throw new Error(`DataParallel: this step's backward failed (${this.reducer.failure}); its gradients were not reduced. Zero the gradients and run the step again.`);
      }
      if (this.reducer.syncedBackwardCount === 0) {
        throw new Error(
          'DataParallel: no gradient arrived since the last finishGradSync(): run the final micro-batch\'s backward() ' +
            'with sync on (outside noSync / after requireGradientSync(true)) before calling finishGradSync().',
        );
      }
      const used = this.reducer.usedSlots();
      const unused = [...this.slotOf.values()].filter((s) => !used.has(s));
      if (unused.length > 0 && !this.findUnusedParameters) {
        throw new Error(
          `DataParallel: parameters received no gradient in this backward: ${unused.map((s) => s.name).join(', ')}. ` +
            `Pass { findUnusedParameters: true } to reduce their zero gradients, or remove them from the model.`,
        );
      }
      for (const run of this.runs) this.complete(run);
      if (this.zero >= 2 && this.replicateGroup && this.accumulate !== 'reduceEach') {
        const works = this.runs.map((r) => this.replicateGroup!.allReduce(r.bucket.shardGrad!, 'sum'));
        for (const w of works) w.wait();
      }
      const ok = this.nonFinite === 'off' ? true : this.agreeOnFiniteness();
      this.usedThisStep = this.findUnusedParameters ? this.agreeOnUse(used) : undefined;
      this.lastSync = { launches: this.reducer.launches };
      this.window = ok ? 'ready' : 'idle';
      return ok;
    } finally {
      // Whatever happened, no reduction is left in flight and the next step starts clean.
      for (const run of this.runs) {
        try {
          this.complete(run);
        } catch {
          // already reported by the wait above (or by the hook's error)
        }
        run.nonFinite = false;
      }
      this.inFlight.length = 0;
      this.reducer.finish();
    }
  }

  /** Every rank learns which ranks saw NaN/Inf, so all take the same decision. */
  private agreeOnFiniteness(): boolean {
    const local = this.runs.some((r) => r.nonFinite) ? 1 : 0;
    const flags = zeros([this.group.size], { dtype: 'float32' });
    try {
      if (local) noGrad(() => flags.narrow(0, this.group.rank, 1).fill_(1));
      this.group.allReduce(flags, 'sum').wait();
      const bad = flags.toNumbers().flatMap((f, r) => (f > 0 ? [this.group.ranks[r] ?? r] : []));
      if (bad.length === 0) return true;
      if (this.nonFinite === 'raise') {
        throw new Error(`DataParallel: non-finite gradients (NaN/Inf) before reduction on rank(s) ${bad.join(', ')}; the step is aborted on every rank`);
      }
      this.zeroGrad();
      return false;
    } finally {
      flags.dispose();
    }
  }

  /** The parameters that received a gradient on any rank this step (one small all-reduce). */
  private agreeOnUse(used: ReadonlySet<ParamSlot>): Set<Tensor> {
    const slots = [...this.slotOf.values()];
    const flags = tensor(slots.map((s) => (used.has(s) ? 1 : 0)), { dtype: 'float32' });
    try {
      if (this.group.size > 1) this.group.allReduce(flags, 'max').wait();
      const f = flags.toNumbers();
      return new Set(slots.filter((_, i) => f[i]! > 0).map((s) => s.param));
    } finally {
      flags.dispose();
    }
  }

  /** Zeroes every gradient in place (full buckets that are allocated, and gradient shards). */
  zeroGrad(): void {
    for (const b of this.buffers) b.zeroGrad();
    this.window = 'idle';
    this.usedThisStep = undefined;
    this.resetPeak();
  }

  // ---- ZeRO-1/2: parameters are replicated, but each rank updates only its shard

  /**
   * The optimizer finished a piece (stepPieces hands them in forward order under zero 1/2): that
   * bucket's updated shards are all-gathered at once, overlapping the optimizer's other pieces and
   * then the next forward, whose modules each wait for just their own buckets.
   */
  pieceStepped(piece: StepPiece): void {
    if (this.zero !== 1 && this.zero !== 2) return;
    const index = Number(piece.key.slice('bucket'.length));
    const run = this.runs.find((r) => r.bucket.index === index);
    if (run) this.gathers?.gather(run.bucket);
  }

  /** After the optimizer step: every bucket not gathered yet is, and ZeRO-3's gathered units are stale. */
  afterStep(): void {
    this.window = 'stepped';
    if (this.zero === 3) {
      this.fsdp!.afterStep();
      return;
    }
    for (let i = this.runs.length - 1; i >= 0; i--) this.gathers?.gather(this.runs[i]!.bucket);
  }

  /** Waits for every parameter all-gather still in flight (before reading parameters directly). */
  waitParams(): void {
    this.gathers?.waitAll();
  }

  // ---- GradientSource: the public gradient API reads the same buckets (see ../grads.ts)

  parametersWithSlots(): ParamSlot[] {
    return [...this.slotOf.values()];
  }

  /** ZeRO-3: the frozen parameters in the buckets, where each lies (placements read them; they have no gradient). */
  frozenParameterSlots(): ParamSlot[] {
    return [...this.frozenSlotOf.values()];
  }

  private requireWindow(what: string): void {
    if (this.window !== 'ready') {
      const when = this.window === 'stepped' ? 'the optimizer has stepped since' : 'no finishGradSync() has completed since the gradients were zeroed';
      throw new Error(`DataParallel.${what}: gradients are readable between finishGradSync() and the optimizer step; ${when}`);
    }
  }

  /** The parameter's full, reduced gradient (a collective when sharded; see grad_reads.ts). */
  fullGrad(param: Tensor): Tensor {
    const slot = this.requireSlot(param);
    this.requireWindow('fullGrad');
    return fullGradOf(this.zero, this.shardGroup, slot);
  }

  /** The part of the parameter's flattened gradient this rank holds (all of it when replicated). */
  localGradShard(param: Tensor): GradShard {
    const slot = this.requireSlot(param);
    this.requireWindow('localGradShard');
    return localGradShardOf(this.zero, this.shardGroup, slot);
  }

  /** Flat local gradient pieces whose |g|^p sums make up the global norm, and the groups to sum over. */
  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    return normPiecesOf(this.zero, this.shardGroup, this.runs.map((r) => r.bucket));
  }

  /**
   * What this rank's optimizer updates: per bucket, the (parameter, gradient) range it owns; in
   * forward order (the last bucket holds the first layers) so parameter gathers go out in the order
   * the next forward needs them.
   */
  stepPieces(): StepPiece[] {
    this.requireWindow('stepPieces');
    return this.pieceLayout().reverse();
  }

  /** The same ranges at any time (optimizer state dicts name and size their entries by them). */
  pieceLayout(): StepPiece[] {
    return pieceLayoutOf(this.zero, this.shardGroup, this.runs.map((r) => r.bucket));
  }

  /** Parameters the optimizer must skip this step (no gradient on any rank), or undefined for none. */
  usedParameters(): ReadonlySet<Tensor> | undefined {
    return this.usedThisStep;
  }

  private requireSlot(param: Tensor): ParamSlot {
    const slot = this.slotOf.get(param);
    if (slot) return slot;
    const frozen = this.frozenSlotOf.get(param)?.name ?? (this.frozenOutside.includes(param) ? this.module.namedParameters().find(([, p]) => p === param)?.[0] : undefined);
    if (frozen !== undefined) throw new Error(`DataParallel: parameter '${frozen}' is frozen (requiresGrad = false) and has no gradient; read gradients of trainable parameters only`);
    throw new Error('DataParallel: this tensor is not a parameter of the wrapped module');
  }

  // ---- memory accounting (memory.ts)

  /** Bytes held now for parameters and gradients (resident storage), and the peak since resetPeak. */
  memory(optimizerBytes = 0): MemoryReport {
    return this.meter.report(optimizerBytes);
  }

  /** Starts a new peak measurement (zeroGrad calls it: the peak is per step). */
  resetPeak(): void {
    this.meter.reset();
  }

  private notePeak(): void {
    this.meter.note();
  }

  /** ZeRO-3: bytes this rank has received from parameter all-gathers so far (0 otherwise). */
  get parameterGatherBytes(): number {
    return this.fsdp?.gatheredBytes ?? 0;
  }

  // ---- whole-model state

  /**
   * Runs fn with every parameter materialised and current (zero 3 gathers them; zero 1/2 wait for
   * the gathers of the last step), then frees what was gathered. Every rank must call it.
   */
  withFullParameters<T>(fn: () => T): T {
    this.waitParams();
    if (!this.fsdp) return fn();
    return this.fsdp.withFullParameters(fn);
  }

  /**
   * Removes the hooks and releases the bucket handles. Parameters stay views of their bucket
   * (its storage lives as long as they do); under zero 3 call withFullParameters first if the
   * module is used afterwards.
   */
  dispose(): void {
    this.waitParams();
    for (const r of this.removeHooks) r();
    this.removeHooks.length = 0;
    this.reducer.dispose();
    this.fsdp?.dispose();
    for (const s of this.slotOf.values()) s.param.gradAccessError = undefined;
    for (const r of this.runs) r.recv?.dispose();
    for (const b of this.buffers) b.dispose();
  }
}

/**
 * What data parallelism and ZeRO-1/2 hold and send on a rank, for the planner ([Note: plan terms]
 * in src/distributed/plan_terms.ts): parameters whole; gradients whole (zero 0/1) or a shard plus
 * two full buckets, the one backward fills and the one in reduction (zero 2); AdamW's two float32
 * moments for the parameters this rank updates (a 1 / (dpShard x cp) shard under ZeRO). The
 * gradient buckets are all-reduced (zero 0), or reduce-scattered over the shard group and
 * all-reduced over replicas, and the updated shards all-gathered (zero 1/2); the reduction overlaps
 * backward when parallel.overlap is on. ZeRO-3 adds its own terms (zero3PlanAxis in fsdp.ts).
 */
export const dataParallelPlanAxis = {
  name: 'data parallel / ZeRO',
  fields: ['dp', 'zero', 'dpShard', 'dpReplicate', 'accumulate', 'bucketSizeMb', 'overlap', 'reduceDtype', 'microBatches'] as const,
  apply(b, ctx) {
    const l = ctx.layout;
    // The cp ranks of a data-parallel rank reduce and shard with it ([Note: context parallelism]).
    const shard = l.zero === 0 ? 1 : l.dpShard * l.cp;
    const group = l.dp * l.cp;
    // Gradients, optimizer state and reductions are the trained parameters' ([Note: LoRA plan]:
    // a LoRA run's adapters; every parameter otherwise).
    const P = trainedParams(b);
    const elem = ctx.reduceDtype === 'bf16' ? 2 : 4;
    const unit = b.params > 0 ? Math.min(ctx.model.largestUnitParams, b.params) * (P / b.params) : 0; // a unit's trained share
    const bucket = l.zero === 3 ? 4 * unit : Math.min(ctx.bucketBytes, 4 * P); // under ZeRO-3 a bucket is a unit
    b.paramsHeld = b.params;
    b.gradsHeld = l.zero >= 2 ? P / shard : P;
    b.optimizerHeld = P / shard;
    b.memory.parameters += heldParamBytes(ctx.model, b.params, b.frozenParams);
    // ZeRO-2 holds full gradients only for the bucket backward fills and the one in reduction
    // ([Note: reduction window]), and that one's received shard.
    b.memory.gradients += l.zero >= 2 ? 4 * P / shard + Math.min(2 * bucket, 4 * P) : 4 * P;
    b.memory.optimizer += 8 * P / shard;
    if (group === 1) return;
    const stride = axisStride(l, 'dp');
    const cross = crossesHosts(stride, group, ctx.ranksPerHost);
    const each = resolveAccumulate(l.zero, ctx.accumulate, { pipeline: l.pp > 1 }) === 'reduceEach' ? l.microBatches : 1;
    const overlaps = ctx.overlap ? 'backward' : 'none';
    const buckets = Math.max(1, Math.ceil((elem * P) / bucket));
    if (l.zero === 0) {
      b.comm.push({ what: 'gradient all-reduce', op: 'allReduce', group, bytes: elem * P, times: each, calls: buckets, overlaps, crossHost: cross });
      return;
    }
    const sg = shard, rg = group / shard;
    const shardCross = crossesHosts(stride, sg, ctx.ranksPerHost);
    // Per bucket; under ZeRO-3 a bucket is a unit (each block, and the root).
    const pieces = l.zero === 3 ? { calls: b.blocks + 1, zero3Unit: true } : { calls: buckets };
    // ZeRO-2 finishes each bucket's reduce-scatter before launching the next ([Note: reduction window]).
    b.comm.push({ what: 'gradient reduce-scatter', op: 'reduceScatter', group: sg, bytes: elem * P, times: each, ...pieces, overlaps, ...(l.zero === 2 ? { inStep: 'zero2' as const } : {}), crossHost: shardCross });
    // HSDP: each bucket's shard is all-reduced across replicas, every micro-batch as it arrives under
    // reduceEach, else once after the last backward (finishGradSync); the step waits for them.
    if (rg > 1) b.comm.push({ what: 'gradient all-reduce across replicas', op: 'allReduce', group: rg, bytes: elem * P / sg, times: each, calls: pieces.calls, overlaps: 'none', crossHost: crossesHosts(axisStride(l, 'dpReplicate'), rg, ctx.ranksPerHost) });
    b.memory.commBuffers += bucket / sg; // the reduce-scatter's received shard of the bucket in flight
    if (l.zero < 3) b.comm.push({ what: 'updated parameter all-gather', op: 'allGather', group: sg, bytes: 4 * P, times: 1, overlaps: 'forward', crossHost: shardCross });
  },
} satisfies PlanAxis;
