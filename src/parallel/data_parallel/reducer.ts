// [Note: readiness] When a bucket's gradient is final, and when to launch its collective: the one
// scheduler under DDP (all-reduce), ZeRO-1 (all-reduce), ZeRO-2/3 (reduce-scatter) and HSDP
// (reduce-scatter, then all-reduce across replicas). The caller supplies what a launch does.
//
// A parameter's accumulate-grad hook fires once per backward() that reaches it: the autograd
// engine sums all uses of a leaf in one graph (a tied embedding's two uses included) before its
// accumulator runs (pinned down by [Note: hook counts] in test/engine_hooks.test.ts). We do not
// rely on that: on the first synchronised backward we only count the calls per parameter (and
// launch every bucket when that backward ends); from then on a parameter is ready when it has fired
// as often as it did then, and a bucket whose parameters are all ready is launched at once, while
// backward continues. Buckets launch strictly in index order, so every rank issues the same
// collectives in the same order. What is not launched during backward (the first step; buckets
// holding a parameter that was unused when counts were learned, since the unused set may change)
// is launched by a callback the engine runs when the backward pass ends.
//
// A gradient that arrives for a bucket whose reduction already ran since the last finish() (a
// second backward in one step where the mode reduces once per step) is an error naming the
// parameter, never a silent reduction of stale data.
import { native } from '../../tensor/native.js';
import type { Bucket, ParamSlot } from './grad_buffer.js';

export interface ReducerHooks {
  /** Before the first gradient of a backward lands in the bucket (allocate it, finish an earlier reduction). */
  beforeAccumulate?(bucket: Bucket): void;
  /** Starts the bucket's collective. */
  launch(bucket: Bucket, inBackward: boolean): void;
  /** After every backward pass, synchronised or not, once its launches are issued. */
  onBackwardEnd?(): void;
}

export interface ReducerOptions {
  /** Names the owner in error messages. */
  owner: string;
  /** Launch buckets during backward as they become ready (otherwise all at the end of backward). */
  overlap: boolean;
  /** Several synchronised backward passes per step each reduce (sharded gradients accumulate in shards). */
  reduceEachBackward: boolean;
}

interface BucketState {
  bucket: Bucket;
  launched: boolean; // in this backward
  launchedSinceFinish: boolean;
  touched: boolean; // beforeAccumulate ran in this backward
  ready: number;
  expectedReady: number;
  deferred: boolean;
}

export class Reducer {
  /** Buckets launched in order during the current step, with whether each was launched inside backward. */
  launches: { bucket: number; inBackward: boolean }[] = [];
  /** Whether the next backward launches collectives. */
  syncEnabled = true;
  /** An error raised from a hook during this step (reported again by finish). */
  failure: string | undefined;

  private readonly states: BucketState[];
  private readonly stateOf = new Map<Bucket, BucketState>();
  private readonly calls = new Map<ParamSlot, number>(); // this backward
  private readonly used = new Set<ParamSlot>(); // any backward since the last finish()
  private expected: Map<ParamSlot, number> | undefined;
  private nextLaunch = 0;
  private inBackward = false;
  private syncedBackwards = 0;
  private readonly removers: (() => void)[] = [];

  constructor(
    readonly buckets: Bucket[],
    private readonly hooks: ReducerHooks,
    private readonly opts: ReducerOptions,
  ) {
    this.states = buckets.map((bucket) => ({ bucket, launched: false, launchedSinceFinish: false, touched: false, ready: 0, expectedReady: 0, deferred: false }));
    for (const s of this.states) this.stateOf.set(s.bucket, s);
    for (const b of buckets) {
      for (const slot of b.slots) {
        // A leaf's tensor hook runs before its accumulator writes into .grad.
        if (hooks.beforeAccumulate) this.removers.push(slot.param.registerHook(() => this.onIncoming(slot)));
        this.removers.push(slot.param.registerAccumulateGradHook(() => this.onAccumulated(slot)));
      }
    }
  }

  /** Slots that received a gradient in some backward since the last finish(). */
  usedSlots(): ReadonlySet<ParamSlot> {
    return this.used;
  }

  /** Synchronised backward passes since the last finish(). */
  get syncedBackwardCount(): number {
    return this.syncedBackwards;
  }

  private startBackward(): void {
    if (this.inBackward) return;
    this.inBackward = true;
    native.queueBackwardCallback(() => this.endBackward());
  }

  private onIncoming(slot: ParamSlot): undefined {
    this.startBackward();
    const st = this.stateOf.get(slot.bucket)!;
    if (!st.touched) {
      st.touched = true;
      this.hooks.beforeAccumulate!(slot.bucket);
    }
    return undefined;
  }

  private onAccumulated(slot: ParamSlot): void {
    this.startBackward();
    this.used.add(slot);
    if (!this.syncEnabled) return;
    const st = this.stateOf.get(slot.bucket)!;
    const n = (this.calls.get(slot) ?? 0) + 1;
    this.calls.set(slot, n);
    if (st.launched || (st.launchedSinceFinish && !this.opts.reduceEachBackward)) {
      this.failure = `gradient for parameter '${slot.name}' arrived after its bucket #${slot.bucket.index} was already being reduced`;
      throw new Error(
        `${this.opts.owner}: gradient for parameter '${slot.name}' arrived after its bucket #${slot.bucket.index} was already being reduced ` +
          `(use ${n} in this backward, ${this.expected?.get(slot) ?? '?'} in the first); the graph uses this parameter more often ` +
          `than before. Keep the graph's parameter uses fixed across steps, run earlier micro-batches inside noSync(), ` +
          `or call finishGradSync() between backward passes.`,
      );
    }
    if (!this.expected || !this.opts.overlap) return;
    if (n === this.expected.get(slot)) {
      st.ready++;
      if (st.ready === st.expectedReady) this.launchReady(true);
    }
  }

  /** Launches, in index order, every bucket whose turn has come and that is ready. */
  private launchReady(inBackward: boolean): void {
    while (this.nextLaunch < this.states.length) {
      const st = this.states[this.nextLaunch]!;
      if (st.deferred || st.ready < st.expectedReady) return;
      this.launch(st, inBackward);
      this.nextLaunch++;
    }
  }

  private launch(st: BucketState, inBackward: boolean): void {
    st.launched = true;
    st.launchedSinceFinish = true;
    this.launches.push({ bucket: st.bucket.index, inBackward });
    this.hooks.launch(st.bucket, inBackward);
  }

  private endBackward(): void {
    this.inBackward = false;
    try {
      if (!this.syncEnabled || this.failure) return;
      this.syncedBackwards++;
      if (!this.expected) {
        // First synchronised backward: learn each parameter's call count. A bucket holding a
        // parameter that got no gradient now may get one later (the unused set can change from
        // step to step), so it is only ever launched here, after backward.
        this.expected = new Map(this.states.flatMap((s) => s.bucket.slots.map((slot) => [slot, this.calls.get(slot) ?? 0] as [ParamSlot, number])));
        for (const st of this.states) {
          st.expectedReady = st.bucket.slots.filter((s) => (this.expected!.get(s) ?? 0) > 0).length;
          st.deferred = st.expectedReady < st.bucket.slots.length;
        }
      }
      // Everything not launched yet goes now, still in index order.
      for (; this.nextLaunch < this.states.length; this.nextLaunch++) this.launch(this.states[this.nextLaunch]!, false);
    } finally {
      this.calls.clear();
      this.nextLaunch = 0;
      for (const st of this.states) {
        st.launched = false;
        st.touched = false;
        st.ready = 0;
      }
      this.hooks.onBackwardEnd?.();
    }
  }

  /**
   * Launches every bucket now, in index order, as if a synchronised backward had just ended: for
   * callers that run their backward passes themselves with sync off (a pipeline schedule) and
   * reduce what accumulated once at the end.
   */
  launchAll(): void {
    this.settle();
    if (this.states.some((st) => st.launchedSinceFinish) && !this.opts.reduceEachBackward) {
      throw new Error(`${this.opts.owner}: reduceAccumulated() after buckets were already reduced in this step; call it once, after every backward pass ran with gradient sync off`);
    }
    this.syncedBackwards++;
    for (const st of this.states) this.launch(st, false);
    for (const st of this.states) st.launched = false;
  }

  /** Records a gradient written without autograd's accumulator (e.g. a weight gradient computed by hand). */
  markUsed(slot: ParamSlot): void {
    this.used.add(slot);
  }

  /**
   * Runs the end-of-backward work if the engine did not (a backward that failed part-way drops its
   * queued callbacks); backward() is synchronous, so none is running when this is called.
   */
  settle(): void {
    if (this.inBackward) this.endBackward();
  }

  /** Ends the step: clears what this step recorded (learned counts stay). */
  finish(): void {
    this.settle();
    this.failure = undefined;
    this.used.clear();
    this.syncedBackwards = 0;
    this.launches = [];
    for (const st of this.states) st.launchedSinceFinish = false;
  }

  dispose(): void {
    for (const r of this.removers) r();
    this.removers.length = 0;
  }
}
