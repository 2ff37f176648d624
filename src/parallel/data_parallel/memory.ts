// Memory accounting of the data-parallel wrappers: the bytes a rank holds for parameters,
// gradients and optimizer state (resident storage, so freed ZeRO buckets count zero), and the
// step's peak, sampled whenever a bucket is allocated or freed.
import { procStatusBytes } from '../../io/proc_status.js';
import { isAllocated } from './grad_buffer.js';
import type { Bucket } from './grad_buffer.js';
import { elementSize, type Tensor } from '../../tensor/index.js';

/** Bytes this rank holds now, by kind (resident storage, not nominal sizes). */
export interface MemoryReport {
  paramBytes: number;
  gradBytes: number;
  optimizerBytes: number;
  /** The most parameter + gradient bytes held at once since the last resetPeak, plus optimizer state. */
  peakBytes: number;
}

/** Tracks the resident bytes of a set of buckets (and their reduce-scatter outputs) and their peak. */
export class MemoryMeter {
  private peak = 0;

  /** `held()` lists the buckets, any receive buffers in flight and any ZeRO-3 bfloat16 copy of a bucket. */
  constructor(
    private readonly held: () => { bucket: Bucket; recv?: Tensor | undefined; copy?: Tensor | undefined }[],
    /** Parameters held outside the buckets (frozen ones under zero 0/1/2): counted as parameter bytes. */
    private readonly outside: () => readonly Tensor[] = () => [],
  ) {}

  /** Bytes held now for parameters and gradients (resident storage), and the peak since reset. */
  report(optimizerBytes = 0): MemoryReport {
    const { params, grads } = this.resident();
    return { paramBytes: params, gradBytes: grads, optimizerBytes, peakBytes: Math.max(this.peak, params + grads) + optimizerBytes };
  }

  /** Starts a new peak measurement (the peak is per step). */
  reset(): void {
    const { params, grads } = this.resident();
    this.peak = params + grads;
  }

  /** Samples the current bytes into the peak (called whenever storage is allocated). */
  note(): void {
    const { params, grads } = this.resident();
    this.peak = Math.max(this.peak, params + grads);
  }

  private resident(): { params: number; grads: number } {
    let params = 0, grads = 0;
    for (const { bucket: b, recv, copy } of this.held()) {
      // Each at its own dtype's bytes: a bfloat16 frozen region takes 2 per element ([Note: frozen parameters]).
      params += b.data.storageNbytes() + (b.frozenData?.storageNbytes() ?? 0) + (b.shardData?.storageNbytes() ?? 0) +
        (b.frozenShardData?.storageNbytes() ?? 0) + (copy ? copy.storageNbytes() : 0);
      grads += b.grad.storageNbytes() + (b.shardGrad ? b.shardGrad.storageNbytes() : 0) + (recv && isAllocated(recv) ? recv.storageNbytes() : 0);
    }
    for (const p of this.outside()) params += p.numel() * elementSize(p.dtype);
    return { params, grads };
  }
}

/**
 * What the whole process holds, from the kernel (/proc/self/status): resident bytes now and the
 * peak since the process started (VmRSS, VmHWM). A MemoryReport counts the wrapper's buffers and
 * optimizer state only; the process also holds activations, collective staging, memory the
 * allocator keeps for the next step ([Note: allocator tuning] in src/tensor/allocator.ts) and the
 * runtime (Node, libtorch). Undefined where /proc is not available.
 */
export function processMemory(): { rssBytes: number; peakBytes: number } | undefined {
  const s = procStatusBytes();
  const rssBytes = s?.VmRSS, peakBytes = s?.VmHWM;
  return rssBytes !== undefined && peakBytes !== undefined ? { rssBytes, peakBytes } : undefined;
}
