// ZeRO-1/2: parameters are replicated but each rank updates only its shard of every bucket, so
// after the optimizer step every bucket's shards are all-gathered. A bucket's gather starts as soon
// as the optimizer finished it (overlapping its other buckets and then the next forward), and each
// module waits, just before its forward, for the buckets that hold its own parameters.
import type { Tensor } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import type { ProcessGroup, Work } from '../distributed/process_group.js';
import type { Bucket, ParamSlot } from './grad_buffer.js';

export class ParamGathers {
  /** Per bucket with a gather in flight: waits for it and frees its views. */
  private readonly inFlight = new Map<Bucket, () => void>();

  constructor(private readonly group: ProcessGroup) {}

  /** Starts the all-gather of the bucket's shards into its full `data` (no-op when one is in flight). */
  gather(b: Bucket): void {
    if (this.inFlight.has(b)) return;
    const outs = Array.from({ length: this.group.size }, (_, k) => b.data.narrow(0, k * b.shardNumel, b.shardNumel));
    const mine = outs[this.group.rank]!.clone();
    const work: Work = this.group.allGather(outs, mine);
    this.inFlight.set(b, () => {
      try {
        work.wait();
      } finally {
        mine.dispose();
        for (const o of outs) o.dispose();
      }
    });
  }

  /** Waits for the bucket's gather, if one is in flight. */
  wait(b: Bucket): void {
    const w = this.inFlight.get(b);
    if (!w) return;
    this.inFlight.delete(b);
    w();
  }

  /** Waits for every gather in flight (before reading parameters directly). */
  waitAll(): void {
    for (const b of [...this.inFlight.keys()]) this.wait(b);
  }

  /** Each module that owns parameters waits before its forward for the buckets holding them; returns the hooks' removers. */
  installWaits(model: Module, slotOf: ReadonlyMap<Tensor, ParamSlot>): (() => void)[] {
    const removers: (() => void)[] = [];
    for (const [, m] of model.namedModules()) {
      const buckets = [...new Set(m.namedParameters().flatMap(([, p]) => {
        const s = slotOf.get(p);
        return s ? [s.bucket] : [];
      }))];
      if (buckets.length === 0) continue;
      removers.push(m.registerForwardPreHook(() => {
        for (const b of buckets) this.wait(b);
      }));
    }
    return removers;
  }
}
