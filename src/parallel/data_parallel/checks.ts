// Wrap-time checks and set-up of the data-parallel wrapper: options that cannot work are one clear
// error, every rank must hold the same parameters in the same buckets (checked by a digest), and
// every rank starts from rank 0's parameters and buffers.
import { type Tensor, tensor, zeros } from '../../tensor/index.js';
import type { Module } from '../../nn/module.js';
import type { ProcessGroup, Work } from '../../distributed/process_group.js';
import type { Bucket, LayoutDescription } from './grad_buffer.js';
import { accumulateProblems, type AccumulateFlavour, type ZeroStage } from '../layout.js';

/** One clear error per combination of options that cannot work, at wrap time. */
export function checkOptions(zero: ZeroStage, acc: AccumulateFlavour, group: ProcessGroup, shard: ProcessGroup, replicate: ProcessGroup | undefined): void {
  if (![0, 1, 2, 3].includes(zero)) throw new Error(`DataParallel: zero must be 0, 1, 2 or 3, got ${zero}`);
  const [problem] = accumulateProblems(zero, acc, replicate !== undefined, 1, 'api');
  if (problem) throw new Error(`DataParallel: ${problem}`);
  if (zero === 0 && (shard !== group || replicate)) {
    throw new Error('DataParallel: shardGroup / replicateGroup need zero >= 1 (plain data parallelism replicates over the whole group)');
  }
  const expect = shard.size * (replicate?.size ?? 1);
  if (zero >= 1 && expect !== group.size) {
    throw new Error(`DataParallel: shard group (${shard.size}) x replicate group (${replicate?.size ?? 1}) = ${expect} ranks, but the data-parallel group has ${group.size}`);
  }
}

/**
 * Every rank must hold the same parameters in the same buckets, or the collectives would mix
 * unrelated gradients (or fail after the timeout). Checked once, by all-gathering a digest of the
 * buffers' layout and `mode` (the sharding mode), before any collective that depends on it
 * (describeLayout gives the layout before the buffers exist).
 */
export function verifySameLayout(group: ProcessGroup, buffers: readonly LayoutDescription[], mode: string): void {
  if (group.size === 1) return;
  let desc = mode;
  let slots = 0;
  for (const b of buffers) {
    desc += `|${b.dtype}:${b.numel}`;
    for (const s of b.slots) desc += `;${s.name}[${s.shape.join(',')}]@${s.offset}${s.dtype === b.dtype ? '' : `:${s.dtype}`}`;
    slots += b.slots.length;
  }
  let hash = 0x811c9dc5; // FNV-1a, 32 bits: exact in a float64
  for (let i = 0; i < desc.length; i++) hash = Math.imul(hash ^ desc.charCodeAt(i), 0x01000193) >>> 0;
  const mine = tensor([slots, buffers.reduce((a, b) => a + b.numel, 0), hash], { dtype: 'float64' });
  const all = Array.from({ length: group.size }, () => zeros([3], { dtype: 'float64' }));
  try {
    group.allGather(all, mine).wait();
    const ref = all[0]!.toNumbers().join(',');
    const bad = all.flatMap((t, r) => (t.toNumbers().join(',') === ref ? [] : [group.ranks[r] ?? r]));
    if (bad.length > 0) {
      throw new Error(
        `DataParallel: rank(s) ${bad.join(', ')} hold different parameters or buckets than rank ${group.ranks[0]} ` +
          `(parameter count, sizes, names and the sharding mode are compared). Build the same model on every rank, with the same bucketSizeMb and zero stage.`,
      );
    }
  } finally {
    mine.dispose();
    for (const t of all) t.dispose();
  }
}

/** Every rank starts from rank 0's parameters (the buckets, and frozen parameters outside them) and buffers. */
export function broadcastState(group: ProcessGroup, module: Module, buckets: readonly Bucket[], inBuckets: ReadonlySet<Tensor>): void {
  if (group.size === 1) return;
  const works: Work[] = [];
  for (const b of buckets) works.push(group.broadcast(b.data, 0));
  for (const [, p] of module.namedParameters()) if (!inBuckets.has(p)) works.push(group.broadcast(p, 0));
  for (const [, buf] of module.namedBuffers()) works.push(group.broadcast(buf, 0));
  for (const w of works) w.wait();
}
