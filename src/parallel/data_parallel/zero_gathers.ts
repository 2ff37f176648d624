// ZeRO-1/2: parameters are replicated but each rank updates only its shard of every bucket, so
// after the optimizer step every bucket's shards are all-gathered. A bucket's gather starts as soon
// as the optimizer finished it (overlapping its other buckets and then the next forward), and each
// module waits, just before its forward, for the buckets that hold its own parameters.
import { noGrad, type Tensor } from '../../tensor/index.js';
import type { Module } from '../../nn/module.js';
import type { ProcessGroup, Work } from '../../distributed/process_group.js';
import type { Bucket, ParamSlot } from './grad_buffer.js';

// [Note: in-place gathers] c10d's all-gather, Gloo's and MPI's alike, stages its output in a flat
// buffer of the whole bucket and copies it out, and its input must not alias the output, so a
// bucket's gather used to cost the bucket again plus a copy of the shard on top of the bucket itself:
// under ZeRO-1/2 every bucket's gather is in flight at once after the step, which cost ZeRO-1 its
// whole saving in peak RSS (under MPI, ZeRO-1 on 2 ranks of a 25M GPT peaked 75 MiB above the same
// run on Gloo's broadcasts). Where the bucket already holds this rank's shard, the same result is one
// broadcast per rank, each from that rank's shard straight into its place in the bucket: the same
// bytes on the wire and no staging.

/**
 * Starts gathering every rank's shard of `data` (this rank's is `own`, or already in place when
 * `own` is not given); wait() on the result. An `own` of another dtype is cast to data's (a ZeRO-3
 * unit's float32 shard gathered into its bfloat16 copy).
 */
export function gatherInPlace(group: ProcessGroup, data: Tensor, shardNumel: number, own?: Tensor): { wait(): void } {
  const views = Array.from({ length: group.size }, (_, k) => data.narrow(0, k * shardNumel, shardNumel));
  const works: Work[] = [];
  try {
    if (own) noGrad(() => views[group.rank]!.copy_(own));
    for (let k = 0; k < group.size; k++) works.push(group.broadcast(views[k]!, k));
  } catch (e) {
    for (const v of views) v.dispose();
    throw e;
  }
  return {
    wait: () => {
      try {
        for (const w of works) w.wait();
      } finally {
        for (const v of views) v.dispose();
      }
    },
  };
}

export class ParamGathers {
  /** Per bucket with a gather in flight: waits for it and frees its views. */
  private readonly inFlight = new Map<Bucket, () => void>();

  constructor(private readonly group: ProcessGroup) {}

  /** Starts the all-gather of the bucket's shards into its full `data` (no-op when one is in flight). */
  gather(b: Bucket): void {
    if (this.inFlight.has(b)) return;
    const g = gatherInPlace(this.group, b.data, b.shardNumel); // the optimizer updated this rank's shard in place
    this.inFlight.set(b, () => g.wait());
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
