// The gradient API of the data-parallel wrapper ([Note: gradient API] in ../grads.ts), as functions of
// the layout: what a parameter's full gradient, its local shard, the norm's pieces and the
// optimizer's ranges are, read from the flat buckets (grad_buffer.ts) whether they are replicated
// (zero 0/1) or sharded over the shard group (zero 2/3).
import { type Tensor, empty } from '../../tensor/index.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import { gradView, shardRange, type Bucket, type ParamSlot } from './grad_buffer.js';
import type { GradShard, StepPiece } from '../grads.js';
import type { ZeroStage } from '../layout.js';

/**
 * The parameter's full, reduced gradient, shaped like it. Replicated gradients (zero 0/1) are a
 * view into the bucket; sharded ones are all-gathered (a collective: every rank of the shard group
 * calls it, for the same parameters in the same order) into a new tensor.
 */
export function fullGradOf(zero: ZeroStage, shardGroup: ProcessGroup, slot: ParamSlot): Tensor {
  if (zero <= 1) return gradView(slot);
  const b = slot.bucket;
  const full = empty([b.numel], { dtype: b.shardGrad!.dtype });
  const outs = Array.from({ length: shardGroup.size }, (_, k) => full.narrow(0, k * b.shardNumel, b.shardNumel));
  try {
    shardGroup.allGather(outs, b.shardGrad!).wait();
    return full.narrow(0, slot.offset - b.offset, slot.numel).view(...slot.shape);
  } finally {
    for (const o of outs) o.dispose();
    full.dispose();
  }
}

/** The part of the parameter's flattened gradient this rank holds (all of it when replicated). */
export function localGradShardOf(zero: ZeroStage, shardGroup: ProcessGroup, slot: ParamSlot): GradShard {
  if (zero <= 1) return { tensor: gradView(slot).flatten(), offset: 0, numel: slot.numel, fullNumel: slot.numel };
  const b = slot.bucket;
  const [s, e] = shardRange(b, shardGroup.rank);
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
export function normPiecesOf(zero: ZeroStage, shardGroup: ProcessGroup, buckets: readonly Bucket[]): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
  // Replicated gradients are counted once with no collective; shards are summed over the shard
  // group (replicas across HSDP hold the same shard and are counted once).
  if (zero <= 1) return { tensors: buckets.map((b) => b.grad), sumOver: [] };
  return { tensors: buckets.map((b) => b.shardGrad!), sumOver: shardGroup.size > 1 ? [shardGroup] : [] };
}

/** Per bucket, the (parameter, gradient) range this rank's optimizer updates (optimizer state is named and sized by them). */
export function pieceLayoutOf(zero: ZeroStage, shardGroup: ProcessGroup, buckets: readonly Bucket[]): StepPiece[] {
  return buckets.map((b) => {
    const [s, e] = zero === 0 ? [0, b.numel] : shardRange(b, shardGroup.rank);
    // ZeRO-3's shardData is the trainable shard alone (the frozen parameters' is frozenShardData,
    // [Note: frozen parameters]), so the optimizer's range and state never cover a frozen one.
    const data = zero === 3 ? b.shardData! : zero === 0 ? b.data : b.data.narrow(0, s, e - s);
    const grad = zero >= 2 ? b.shardGrad! : zero === 0 ? b.grad : b.grad.narrow(0, s, e - s);
    const segments: StepPiece['segments'] = [];
    for (const slot of b.slots) {
      const lo = Math.max(s, slot.offset - b.offset);
      const hi = Math.min(e, slot.offset - b.offset + slot.numel);
      if (hi > lo) segments.push({ param: slot.param, name: slot.name, start: lo - s, numel: hi - lo, paramOffset: lo - (slot.offset - b.offset) });
    }
    return { key: `bucket${b.index}`, data, grad, segments, owned: zero !== 0 };
  });
}
