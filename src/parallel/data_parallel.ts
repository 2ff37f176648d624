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
import { Tensor, noGrad, tidy, zeros, tensor, empty, keep } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import type { ProcessGroup, Work } from '../distributed/process_group.js';
import { GradBuffer, buildGradBuffers, gradView, shardRange, allocStorage, freeStorage, isAllocated, type Bucket, type ParamSlot } from './grad_buffer.js';
import { Reducer } from './reducer.js';
import { FsdpUnits, singleUnitWarning, type UnitPolicy } from './fsdp.js';
import type { GradientSource, GradShard, StepPiece } from './grads.js';
import { accumulateProblem, resolveAccumulate, type AccumulateFlavour, type ZeroStage } from './layout.js';

export type { ZeroStage, AccumulateFlavour } from './layout.js';

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
  /** Bucket size in MiB (default 25, as PyTorch DDP); zero 3 uses one bucket per wrapping unit. */
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
  /** Zero 3: free a unit's gathered parameters after its forward (default true; false keeps them until backward). */
  reshardAfterForward?: boolean;
  /** Zero 3: gather the next unit while the current one computes (default true). */
  prefetch?: boolean;
}

export interface SyncRecord {
  /** Bucket indices in launch order, with whether each was launched from inside backward. */
  launches: { bucket: number; inBackward: boolean }[];
}

/** Bytes this rank holds now, by kind (resident storage, not nominal sizes). */
export interface MemoryReport {
  paramBytes: number;
  gradBytes: number;
  optimizerBytes: number;
  /** The most parameter + gradient bytes held at once since the last resetPeak, plus optimizer state. */
  peakBytes: number;
}

interface BucketRun {
  bucket: Bucket;
  work?: Work; // reduction in flight
  recv?: Tensor; // reduce-scatter output before it is added into shardGrad
  gather?: () => void; // waits for the parameter all-gather in flight (zero 1/2, after the step)
  nonFinite: boolean;
}

type Window = 'idle' | 'ready' | 'stepped';

export class DataParallel<M extends Module = Module> implements GradientSource {
  readonly module: M;
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
  private readonly reducer: Reducer;
  private readonly fsdp: FsdpUnits | undefined;
  private readonly removeHooks: (() => void)[] = [];
  private lastMicroBatch = true;
  private window: Window = 'idle';
  private usedThisStep: Set<Tensor> | undefined; // parameters with a gradient on some rank (findUnusedParameters)
  private peak = 0;

  constructor(module: M, opts: DataParallelOptions) {
    this.module = module;
    this.group = opts.group;
    this.zero = opts.zero ?? 0;
    this.shardGroup = opts.shardGroup ?? opts.group;
    this.replicateGroup = opts.replicateGroup && opts.replicateGroup.size > 1 ? opts.replicateGroup : undefined;
    this.overlap = opts.overlap ?? true;
    this.findUnusedParameters = opts.findUnusedParameters ?? false;
    this.nonFinite = opts.nonFinite ?? 'off';
    this.accumulate = resolveAccumulate(this.zero, opts.accumulate);
    checkLayout(this.zero, this.accumulate, this.group, this.shardGroup, this.replicateGroup);

    const named = module.namedParameters().filter(([, p]) => p.requiresGrad);
    if (named.length === 0) throw new Error('DataParallel: the module has no trainable parameters');
    const sharded = this.zero >= 1;
    const units = this.zero === 3 ? FsdpUnits.plan(module, named, opts.units) : undefined;
    if (units && units.units.length === 1 && this.group.rank === 0) {
      process.emitWarning(singleUnitWarning(module), { type: 'FlotillaWarning', code: 'FLOTILLA_SINGLE_UNIT' });
    }
    this.buffers = buildGradBuffers(named, {
      bucketBytes: (opts.bucketSizeMb ?? 25) * 2 ** 20,
      padMultiple: sharded ? this.shardGroup.size : this.group.size,
      ...(units ? { groups: units.groups } : {}),
    });
    for (const buffer of this.buffers) {
      for (const bucket of buffer.buckets) {
        const run: BucketRun = { bucket, nonFinite: false };
        this.runs.push(run);
        this.runOf.set(bucket, run);
      }
      for (const slot of buffer.slots) this.slotOf.set(slot.param, slot);
    }
    this.verifyLayout();
    if (opts.broadcastFromRank0 ?? true) this.broadcastState();

    noGrad(() => {
      for (const { bucket } of this.runs) {
        if (this.zero >= 2) {
          bucket.shardGrad = keep(zeros([bucket.shardNumel], { dtype: bucket.grad.dtype }));
          freeStorage(bucket.grad); // allocated again when a backward reaches the bucket
        }
        if (this.zero === 3) {
          const [s] = shardRange(bucket, this.shardGroup.rank);
          bucket.shardData = keep(bucket.data.narrow(0, s, bucket.shardNumel).clone());
          freeStorage(bucket.data); // gathered around each unit's forward and backward
        }
      }
    });
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
      this.fsdp = new FsdpUnits(module, units, this.runs.map((r) => r.bucket), this.shardGroup, {
        reshardAfterForward: opts.reshardAfterForward ?? true,
        prefetch: opts.prefetch ?? true,
        onMemoryChange: () => this.notePeak(),
      });
    } else if (this.zero >= 1) {
      this.installGatherWaits();
    }
    this.resetPeak();
  }

  // ---- wrap-time checks

  /**
   * Every rank must hold the same parameters in the same buckets, or the collectives would mix
   * unrelated gradients (or fail after the timeout). Checked once, by all-gathering a digest.
   */
  private verifyLayout(): void {
    if (this.group.size === 1) return;
    let desc = `zero${this.zero}:${this.accumulate}`;
    for (const b of this.buffers) {
      desc += `|${b.dtype}:${b.numel}`;
      for (const s of b.slots) desc += `;${s.name}[${s.shape.join(',')}]@${s.offset}`;
    }
    let hash = 0x811c9dc5; // FNV-1a, 32 bits: exact in a float64
    for (let i = 0; i < desc.length; i++) hash = Math.imul(hash ^ desc.charCodeAt(i), 0x01000193) >>> 0;
    const mine = tensor([this.slotOf.size, this.buffers.reduce((a, b) => a + b.numel, 0), hash], { dtype: 'float64' });
    const all = Array.from({ length: this.group.size }, () => zeros([3], { dtype: 'float64' }));
    try {
      this.group.allGather(all, mine).wait();
      const ref = all[0]!.toNumbers().join(',');
      const bad = all.flatMap((t, r) => (t.toNumbers().join(',') === ref ? [] : [this.group.ranks[r] ?? r]));
      if (bad.length > 0) {
        throw new Error(
          `DataParallel: rank(s) ${bad.join(', ')} hold different parameters or buckets than rank ${this.group.ranks[0]} ` +
            `(parameter count, sizes, names and the sharding mode are compared). Build the same model on every rank, with the same bucketSizeMb and zero stage.`,
        );
      }
    } finally {
      mine.dispose();
      for (const t of all) t.dispose();
    }
  }

  /** Every rank starts from rank 0's parameters and buffers. */
  private broadcastState(): void {
    if (this.group.size === 1) return;
    const works: Work[] = [];
    for (const { bucket } of this.runs) works.push(this.group.broadcast(bucket.data, 0));
    // Frozen parameters are not in the flat buffers but must match too.
    for (const [, p] of this.module.namedParameters()) if (!this.slotOf.has(p)) works.push(this.group.broadcast(p, 0));
    for (const [, buf] of this.module.namedBuffers()) works.push(this.group.broadcast(buf, 0));
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
    return this.lastMicroBatch || this.accumulate !== 'reduceLast';
  }

  // ---- reduction (called by the reducer)

  private beforeAccumulate(bucket: Bucket): void {
    const run = this.runOf.get(bucket)!;
    if (run.work) this.complete(run, false); // the previous micro-batch's reduction reads this bucket
    if (allocStorage(bucket.grad, { zero: true })) this.notePeak();
  }

  private launch(run: BucketRun): void {
    // A bucket no gradient reached on this rank (unused parameters) still joins the collective,
    // with zeros.
    this.beforeAccumulate(run.bucket);
    const g = run.bucket.grad;
    if (this.nonFinite !== 'off' && !run.nonFinite) run.nonFinite = tidy(() => !g.isfinite().all().item());
    if (this.group.size > 1) noGrad(() => g.mul_(this.averagingScale(run.bucket))); // average = pre-scale, then sum
    if (this.zero <= 1) {
      if (this.group.size > 1) run.work = this.group.allReduce(g, 'sum');
      return;
    }
    if (!run.recv) run.recv = keep(empty([run.bucket.shardNumel], { dtype: g.dtype }));
    run.work = this.shardGroup.reduceScatter(run.recv, g, 'sum');
    this.notePeak();
    this.fsdp?.onReduced(run.bucket);
  }

  /**
   * The factor a bucket is scaled by before it is summed over the group: 1/N, so the sum is the
   * average. (Tests replace it on the prototype to prove that verification catches a wrong one.)
   */
  protected averagingScale(_bucket: Bucket): number {
    return 1 / this.group.size;
  }

  /** Waits for a bucket's reduction and folds it into the gradient shard (sharded modes). */
  private complete(run: BucketRun, last: boolean): void {
    const work = run.work;
    if (!work) return;
    run.work = undefined;
    work.wait();
    if (this.zero <= 1) return;
    const recv = run.recv!;
    // HSDP: under 'reduceEach' every micro-batch's shard is averaged across replicas now; the other
    // flavours all-reduce the accumulated shard once, in finishGradSync.
    if (this.replicateGroup && this.accumulate === 'reduceEach') this.replicateGroup.allReduce(recv, 'sum').wait();
    noGrad(() => run.bucket.shardGrad!.add_(recv));
    freeStorage(run.bucket.grad);
    if (last) {
      recv.dispose();
      run.recv = undefined;
    }
  }

  // ---- callers that run backward passes themselves (pipeline schedules)

  /**
   * Allocates (zeroed) every full gradient bucket that is freed, so gradients may be written into
   * .grad views directly, outside autograd's accumulator (a zero-bubble weight-gradient pass).
   */
  allocateGradients(): void {
    for (const run of this.runs) this.beforeAccumulate(run.bucket);
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
      for (const run of this.runs) this.complete(run, true);
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
          this.complete(run, true);
        } catch {
          // already reported by the wait above (or by the hook's error)
        }
        run.nonFinite = false;
      }
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
    const run = this.runs[Number(piece.key.slice('bucket'.length))];
    if (run) this.gatherParams(run);
  }

  /** After the optimizer step: every bucket not gathered yet is, and ZeRO-3's gathered units are stale. */
  afterStep(): void {
    this.window = 'stepped';
    if (this.zero === 3) {
      this.fsdp!.afterStep();
      return;
    }
    for (let i = this.runs.length - 1; i >= 0; i--) this.gatherParams(this.runs[i]!);
  }

  private gatherParams(run: BucketRun): void {
    if (this.zero === 0 || this.shardGroup.size === 1 || run.gather) return;
    const b = run.bucket;
    const outs = Array.from({ length: this.shardGroup.size }, (_, k) => b.data.narrow(0, k * b.shardNumel, b.shardNumel));
    const mine = outs[this.shardGroup.rank]!.clone();
    const work = this.shardGroup.allGather(outs, mine);
    run.gather = () => {
      try {
        work.wait();
      } finally {
        mine.dispose();
        for (const o of outs) o.dispose();
      }
    };
  }

  /** Waits for every parameter all-gather still in flight (before reading parameters directly). */
  waitParams(): void {
    for (const run of this.runs) this.waitGather(run);
  }

  private waitGather(run: BucketRun): void {
    const wait = run.gather;
    if (!wait) return;
    run.gather = undefined;
    wait();
  }

  /** Each module that owns parameters waits, just before its forward, for the buckets that hold them. */
  private installGatherWaits(): void {
    for (const [, m] of this.module.namedModules()) {
      const own = new Set(m.namedParameters().map(([, p]) => p));
      const runs = [...new Set([...own].flatMap((p) => {
        const s = this.slotOf.get(p);
        return s ? [this.runOf.get(s.bucket)!] : [];
      }))];
      if (runs.length === 0) continue;
      this.removeHooks.push(m.registerForwardPreHook(() => {
        for (const r of runs) this.waitGather(r);
      }));
    }
  }

  // ---- GradientSource: the public gradient API reads the same buckets (see grads.ts)

  parametersWithSlots(): ParamSlot[] {
    return [...this.slotOf.values()];
  }

  private requireWindow(what: string): void {
    if (this.window !== 'ready') {
      const when = this.window === 'stepped' ? 'the optimizer has stepped since' : 'no finishGradSync() has completed since the gradients were zeroed';
      throw new Error(`DataParallel.${what}: gradients are readable between finishGradSync() and the optimizer step; ${when}`);
    }
  }

  /**
   * The parameter's full, reduced gradient, shaped like it. Replicated gradients (zero 0/1) are a
   * view into the bucket; sharded ones are all-gathered (a collective: every rank of the shard
   * group calls it, for the same parameters in the same order) into a new tensor.
   */
  fullGrad(param: Tensor): Tensor {
    const slot = this.requireSlot(param);
    this.requireWindow('fullGrad');
    if (this.zero <= 1) return gradView(slot);
    const b = slot.bucket;
    const full = empty([b.numel], { dtype: b.shardGrad!.dtype });
    const outs = Array.from({ length: this.shardGroup.size }, (_, k) => full.narrow(0, k * b.shardNumel, b.shardNumel));
    try {
      this.shardGroup.allGather(outs, b.shardGrad!).wait();
      return full.narrow(0, slot.offset - b.offset, slot.numel).view(...slot.shape);
    } finally {
      for (const o of outs) o.dispose();
      full.dispose();
    }
  }

  /** The part of the parameter's flattened gradient this rank holds (all of it when replicated). */
  localGradShard(param: Tensor): GradShard {
    const slot = this.requireSlot(param);
    this.requireWindow('localGradShard');
    if (this.zero <= 1) {
      return { tensor: gradView(slot).flatten(), offset: 0, numel: slot.numel, fullNumel: slot.numel };
    }
    const b = slot.bucket;
    const [s, e] = shardRange(b, this.shardGroup.rank);
    const lo = Math.max(s, slot.offset - b.offset);
    const hi = Math.min(e, slot.offset - b.offset + slot.numel);
    const n = Math.max(0, hi - lo);
    return {
      tensor: n > 0 ? b.shardGrad!.narrow(0, lo - s, n) : empty([0], { dtype: b.shardGrad!.dtype }),
      offset: n > 0 ? lo - (slot.offset - b.offset) : 0,
      numel: n,
      fullNumel: slot.numel,
    };
  }

  /** Flat local gradient pieces whose |g|^p sums make up the global norm, and the groups to sum over. */
  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    // Replicated gradients are counted once with no collective; shards are summed over the shard
    // group (replicas across HSDP hold the same shard and are counted once).
    if (this.zero <= 1) return { tensors: this.runs.map((r) => r.bucket.grad), sumOver: [] };
    return { tensors: this.runs.map((r) => r.bucket.shardGrad!), sumOver: this.shardGroup.size > 1 ? [this.shardGroup] : [] };
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
    return this.runs.map(({ bucket: b }) => {
      const [s, e] = this.zero === 0 ? [0, b.numel] : shardRange(b, this.shardGroup.rank);
      const data = this.zero === 3 ? b.shardData! : this.zero === 0 ? b.data : b.data.narrow(0, s, e - s);
      const grad = this.zero >= 2 ? b.shardGrad! : this.zero === 0 ? b.grad : b.grad.narrow(0, s, e - s);
      const segments: StepPiece['segments'] = [];
      for (const slot of b.slots) {
        const lo = Math.max(s, slot.offset - b.offset);
        const hi = Math.min(e, slot.offset - b.offset + slot.numel);
        if (hi > lo) segments.push({ param: slot.param, name: slot.name, start: lo - s, numel: hi - lo, paramOffset: lo - (slot.offset - b.offset) });
      }
      return { key: `bucket${b.index}`, data, grad, segments, owned: this.zero !== 0 };
    });
  }

  /** Parameters the optimizer must skip this step (no gradient on any rank), or undefined for none. */
  usedParameters(): ReadonlySet<Tensor> | undefined {
    return this.usedThisStep;
  }

  private requireSlot(param: Tensor): ParamSlot {
    const slot = this.slotOf.get(param);
    if (!slot) throw new Error('DataParallel: this tensor is not a parameter of the wrapped module');
    return slot;
  }

  // ---- memory accounting

  /** Bytes held now for parameters and gradients (resident storage), and the peak since resetPeak. */
  memory(optimizerBytes = 0): MemoryReport {
    const { params, grads } = this.residentBytes();
    return { paramBytes: params, gradBytes: grads, optimizerBytes, peakBytes: Math.max(this.peak, params + grads) + optimizerBytes };
  }

  /** Starts a new peak measurement (zeroGrad calls it: the peak is per step). */
  resetPeak(): void {
    const { params, grads } = this.residentBytes();
    this.peak = params + grads;
  }

  private notePeak(): void {
    const { params, grads } = this.residentBytes();
    this.peak = Math.max(this.peak, params + grads);
  }

  private residentBytes(): { params: number; grads: number } {
    let params = 0, grads = 0;
    for (const { bucket: b, recv } of this.runs) {
      params += b.data.storageNbytes() + (b.shardData ? b.shardData.storageNbytes() : 0);
      grads += b.grad.storageNbytes() + (b.shardGrad ? b.shardGrad.storageNbytes() : 0) + (recv && isAllocated(recv) ? recv.storageNbytes() : 0);
    }
    return { params, grads };
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

/** One clear error per layout that cannot work, at wrap time. */
function checkLayout(zero: ZeroStage, acc: AccumulateFlavour, group: ProcessGroup, shard: ProcessGroup, replicate: ProcessGroup | undefined): void {
  if (![0, 1, 2, 3].includes(zero)) throw new Error(`DataParallel: zero must be 0, 1, 2 or 3, got ${zero}`);
  const problem = accumulateProblem(zero, acc, replicate !== undefined, false, 'accumulate');
  if (problem) throw new Error(`DataParallel: ${problem}`);
  if (zero === 0 && (shard !== group || replicate)) {
    throw new Error('DataParallel: shardGroup / replicateGroup need zero >= 1 (plain data parallelism replicates over the whole group)');
  }
  const expect = shard.size * (replicate?.size ?? 1);
  if (zero >= 1 && expect !== group.size) {
    throw new Error(`DataParallel: shard group (${shard.size}) x replicate group (${replicate?.size ?? 1}) = ${expect} ranks, but the data-parallel group has ${group.size}`);
  }
}
