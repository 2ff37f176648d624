// Data parallelism with overlapped, bucketed gradient reduction over the flat gradient buffer.
//
// [Note: readiness] A parameter's accumulate-grad hook fires once per backward() that reaches it:
// the autograd engine sums all uses of a leaf in one graph (a tied embedding's two uses included)
// before its accumulator runs (pinned down by [Note: hook counts] in test/engine_hooks.test.ts).
// We do not rely on that: on the first synchronised step we only count the calls per parameter
// (and reduce every bucket after backward); from then on a parameter is ready when it has fired as
// often as it did then, and a bucket whose parameters are all ready is launched at once, while
// backward continues. Buckets launch strictly in index order, so every rank issues the same
// collectives in the same order. A gradient that arrives for a bucket already in flight (e.g. a
// second backward() in one synced step without noSync) is an error naming the parameter, never a
// silent reduction of stale data.
//
// [Note: accumulation] On non-final micro-batches (noSync / requireGradientSync(false)) the hooks
// do nothing and no collective is issued; gradients just accumulate in the buffer. The final
// micro-batch reduces the accumulated sum, pre-scaled by 1/world so the result is the average.
import { Tensor, noGrad, tidy, zeros, tensor } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import type { ProcessGroup, Work } from '../distributed/process_group.js';
import { GradBuffer, buildGradBuffers, gradView, type Bucket, type ParamSlot } from './grad_buffer.js';
import type { GradientSource, GradShard } from './grads.js';

export interface DataParallelOptions {
  /** The data-parallel group (all ranks that hold a replica). */
  group: ProcessGroup;
  /** Bucket size in MiB (default 25, as PyTorch DDP). */
  bucketSizeMb?: number;
  /** Launch each bucket's all-reduce during backward as soon as it is ready (default true). */
  overlap?: boolean;
  /**
   * Parameters that got no gradient in a backward are allowed: their (zero) gradients are reduced
   * with the rest. Without it, such parameters are an error that names them.
   */
  findUnusedParameters?: boolean;
  /**
   * What to do when a gradient holds NaN/Inf before reduction: 'raise' on every rank, 'skip' the
   * step on every rank (finishGradSync returns false and gradients are zeroed), or 'off'.
   */
  nonFinite?: 'off' | 'raise' | 'skip';
  /** Broadcast parameters and buffers from rank 0 at wrap time (default true). */
  broadcastFromRank0?: boolean;
}

type BucketState = 'pending' | 'inflight' | 'done';

interface BucketRun {
  bucket: Bucket;
  buffer: GradBuffer;
  state: BucketState;
  ready: number; // parameters of this bucket that are ready this backward
  expectedReady: number; // parameters that must become ready (used ones)
  deferred: boolean; // holds a parameter unused when counts were learned: reduced in finishGradSync only
  work?: Work;
  launchedInBackward: boolean;
  nonFinite: boolean;
}

export interface SyncRecord {
  /** Bucket indices in launch order, with whether each was launched from inside backward. */
  launches: { bucket: number; inBackward: boolean }[];
}

export class DataParallel<M extends Module = Module> implements GradientSource {
  readonly module: M;
  readonly group: ProcessGroup;
  readonly buffers: GradBuffer[];
  readonly overlap: boolean;
  readonly findUnusedParameters: boolean;
  readonly nonFinite: 'off' | 'raise' | 'skip';
  /** What the last finishGradSync did (tests and diagnostics read it). */
  lastSync: SyncRecord = { launches: [] };

  private readonly runs: BucketRun[] = [];
  private readonly slotOf = new Map<Tensor, ParamSlot>();
  private readonly runOf = new Map<Bucket, BucketRun>();
  private readonly calls = new Map<ParamSlot, number>();
  private expected: Map<ParamSlot, number> | undefined; // learned on the first synced backward
  private nextLaunch = 0;
  private syncEnabled = true;
  private inBackwardHooks = false;
  private readonly removeHooks: (() => void)[] = [];
  private launches: { bucket: number; inBackward: boolean }[] = [];
  private failure: string | undefined; // an error raised from a hook during this step's backward

  constructor(module: M, opts: DataParallelOptions) {
    this.module = module;
    this.group = opts.group;
    this.overlap = opts.overlap ?? true;
    this.findUnusedParameters = opts.findUnusedParameters ?? false;
    this.nonFinite = opts.nonFinite ?? 'off';
    const named = module.namedParameters().filter(([, p]) => p.requiresGrad);
    if (named.length === 0) throw new Error('DataParallel: the module has no trainable parameters');
    this.buffers = buildGradBuffers(named, {
      bucketBytes: (opts.bucketSizeMb ?? 25) * 2 ** 20,
      padMultiple: this.group.size,
    });
    for (const buffer of this.buffers) {
      for (const bucket of buffer.buckets) {
        const run: BucketRun = { bucket, buffer, state: 'pending', ready: 0, expectedReady: 0, deferred: false, launchedInBackward: false, nonFinite: false };
        this.runs.push(run);
        this.runOf.set(bucket, run);
      }
      for (const slot of buffer.slots) {
        this.slotOf.set(slot.param, slot);
        this.removeHooks.push(slot.param.registerAccumulateGradHook(() => this.onGradAccumulated(slot)));
      }
    }
    this.verifyLayout();
    if (opts.broadcastFromRank0 ?? true) this.broadcastState();
  }

  /**
   * Every rank must hold the same parameters in the same buckets, or the all-reduces would mix
   * unrelated gradients (or fail after the timeout). Checked once, by all-gathering a digest.
   */
  private verifyLayout(): void {
    if (this.group.size === 1) return;
    let desc = '';
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
            `(parameter count, sizes and names are compared). Build the same model on every rank, with the same bucketSizeMb.`,
        );
      }
    } finally {
      mine.dispose();
      for (const t of all) t.dispose();
    }
  }

  /** Calls the wrapped module's forward. */
  forward(...args: Parameters<M extends { forward: (...a: infer A) => unknown } ? (...a: A) => unknown : never>):
    ReturnType<M extends { forward: (...a: never[]) => infer R } ? () => R : never> {
    return (this.module as unknown as { forward: (...a: unknown[]) => never }).forward(...args);
  }

  /** Every rank starts from rank 0's parameters and buffers. */
  private broadcastState(): void {
    if (this.group.size === 1) return;
    const works: Work[] = [];
    for (const b of this.buffers) works.push(this.group.broadcast(b.data, 0));
    // Frozen parameters are not in the flat buffers but must match too.
    for (const [, p] of this.module.namedParameters()) if (!this.slotOf.has(p)) works.push(this.group.broadcast(p, 0));
    for (const [, buf] of this.module.namedBuffers()) works.push(this.group.broadcast(buf, 0));
    for (const w of works) w.wait();
  }

  /** Turns gradient synchronisation on or off (off on non-final micro-batches). */
  requireGradientSync(flag: boolean): void {
    this.syncEnabled = flag;
  }

  /** Runs fn (forward and backward of a non-final micro-batch) without any collective. */
  noSync<T>(fn: () => T): T {
    const prev = this.syncEnabled;
    this.syncEnabled = false;
    try {
      return fn();
    } finally {
      this.syncEnabled = prev;
    }
  }

  /** Zeroes the whole gradient buffer in place. */
  zeroGrad(): void {
    for (const b of this.buffers) b.zeroGrad();
  }

  private onGradAccumulated(slot: ParamSlot): void {
    if (!this.syncEnabled) return;
    const run = this.runOf.get(slot.bucket)!;
    const n = (this.calls.get(slot) ?? 0) + 1;
    this.calls.set(slot, n);
    if (run.state !== 'pending') {
      this.failure = `gradient for parameter '${slot.name}' arrived after its bucket #${slot.bucket.index} was already being reduced`;
      throw new Error(
        `DataParallel: gradient for parameter '${slot.name}' arrived after its bucket #${slot.bucket.index} was already being reduced ` +
          `(use ${n} in this backward, ${this.expected?.get(slot) ?? '?'} in the first); the graph uses this parameter more often ` +
          `than before. Keep the graph's parameter uses fixed across steps, or call finishGradSync() between backward passes.`,
      );
    }
    if (!this.expected || !this.overlap) return;
    if (n === this.expected.get(slot)) {
      run.ready++;
      if (run.ready === run.expectedReady) this.launchReady(true);
    }
  }

  /** Launches, in index order, every bucket whose turn has come and that is ready. */
  private launchReady(inBackward: boolean): void {
    while (this.nextLaunch < this.runs.length) {
      const run = this.runs[this.nextLaunch]!;
      if (run.deferred || run.ready < run.expectedReady) return;
      this.launch(run, inBackward);
      this.nextLaunch++;
    }
  }

  private launch(run: BucketRun, inBackward: boolean): void {
    const g = run.bucket.grad;
    if (this.nonFinite !== 'off') run.nonFinite = tidy(() => !g.isfinite().all().item());
    if (this.group.size > 1) {
      noGrad(() => g.mul_(1 / this.group.size)); // average = pre-scale, then sum (Gloo has no AVG)
      run.work = this.group.allReduce(g, 'sum');
    }
    run.state = 'inflight';
    run.launchedInBackward = inBackward;
    this.launches.push({ bucket: run.bucket.index, inBackward });
  }

  /**
   * Waits for every bucket's reduction; call after the final micro-batch's backward, before the
   * optimizer. Returns false when the step must be skipped (nonFinite: 'skip' saw NaN/Inf on some rank).
   */
  finishGradSync(): boolean {
    if (!this.syncEnabled) {
      throw new Error('DataParallel: finishGradSync() called while gradient sync is off (inside noSync / requireGradientSync(false))');
    }
    try {
      if (this.failure) {
        throw new Error(`DataParallel: this step's backward failed (${this.failure}); its gradients were not reduced. Zero the gradients and run the step again.`);
      }
      if (this.calls.size === 0) {
        throw new Error(
          'DataParallel: no gradient arrived since the last finishGradSync(): run the final micro-batch\'s backward() ' +
            'with sync on (outside noSync / after requireGradientSync(true)) before calling finishGradSync().',
        );
      }
      const unused = [...this.slotOf.values()].filter((s) => !this.calls.has(s));
      if (unused.length > 0 && !this.findUnusedParameters) {
        throw new Error(
          `DataParallel: parameters received no gradient in this backward: ${unused.map((s) => s.name).join(', ')}. ` +
            `Pass { findUnusedParameters: true } to reduce their zero gradients, or remove them from the model.`,
        );
      }
      if (!this.expected) {
        // First synchronised step: learn each parameter's call count. A bucket holding a parameter
        // that got no gradient now may get one later (the unused set can change from step to step),
        // so it is only ever reduced here, after backward, never while a late gradient could land.
        this.expected = new Map([...this.slotOf.values()].map((s) => [s, this.calls.get(s) ?? 0]));
        for (const run of this.runs) {
          run.expectedReady = run.bucket.slots.filter((s) => (this.expected!.get(s) ?? 0) > 0).length;
          run.deferred = run.expectedReady < run.bucket.slots.length;
        }
      }
      // Everything not launched yet goes now, still in index order.
      for (; this.nextLaunch < this.runs.length; this.nextLaunch++) this.launch(this.runs[this.nextLaunch]!, false);
      for (const run of this.runs) run.work?.wait();
      const ok = this.nonFinite === 'off' ? true : this.agreeOnFiniteness();
      this.lastSync = { launches: this.launches };
      return ok;
    } finally {
      // Whatever happened, no reduction is left in flight and the next step starts clean.
      for (const run of this.runs) {
        try {
          run.work?.wait();
        } catch {
          // already reported by the wait above (or by the hook's error)
        }
      }
      this.resetIteration();
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

  private resetIteration(): void {
    this.failure = undefined;
    this.calls.clear();
    this.nextLaunch = 0;
    this.launches = [];
    for (const run of this.runs) {
      run.state = 'pending';
      run.ready = 0;
      run.work = undefined;
      run.nonFinite = false;
      // A parameter that is ready by count with zero expected uses is ready from the start.
    }
  }

  // ---- GradientSource: the public gradient API reads the same buffer (see grads.ts)

  parametersWithSlots(): ParamSlot[] {
    return [...this.slotOf.values()];
  }

  /** The parameter's full, reduced gradient (a view into the buffer; no collective for DDP). */
  fullGrad(param: Tensor): Tensor {
    const slot = this.requireSlot(param);
    return gradView(slot);
  }

  /** DDP holds the whole gradient on every rank: the local shard is all of it, offset 0. */
  localGradShard(param: Tensor): GradShard {
    const slot = this.requireSlot(param);
    return { tensor: this.fullGrad(param).flatten(), offset: 0, numel: slot.numel, fullNumel: slot.numel };
  }

  /** Flat local gradient pieces whose |g|^p sums make up the global norm, and the groups to sum over. */
  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    // Replicated across DP: every rank holds the same reduced buffer, counted once, no collective.
    return { tensors: this.buffers.map((b) => b.grad), sumOver: [] };
  }

  private requireSlot(param: Tensor): ParamSlot {
    const slot = this.slotOf.get(param);
    if (!slot) throw new Error('DataParallel: this tensor is not a parameter of the wrapped module');
    return slot;
  }

  /**
   * Removes the hooks and releases the buffer handles. Parameters stay views of the flat parameter
   * buffer (their storage lives as long as they do) and keep their gradient views.
   */
  dispose(): void {
    for (const r of this.removeHooks) r();
    this.removeHooks.length = 0;
    for (const b of this.buffers) b.dispose();
  }
}
