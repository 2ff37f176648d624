// Proof that data-parallel ranks read a partition of the global batch.
//
// Under replicate × shard data parallelism the DP rank is
//     dp_rank = replicate_rank * shard_size + shard_rank
// (the row-major index over the two mesh dims: mesh.ts's rowMajorIndex, which DeviceMesh.flatten
// uses too). A trainer once
// used replicate_rank * replicate_size + shard_rank: whenever the two sizes differ, some ranks read
// the same samples and others read samples nobody should, silently. So the assignment is checked at
// start-up instead of trusted: every DP rank contributes the sample ids it will read, and together
// they must cover [0, globalBatchSize) exactly once.
import type { ProcessGroup } from './process_group.js';
import { rowMajorIndex } from './mesh.js';
import { tensor, zeros, full, tidy } from '../tensor/index.js';

/** The data-parallel rank of (replicate_rank, shard_rank): replicate_rank * shard_size + shard_rank. */
export function dpRank(replicateRank: number, shardRank: number, shardSize: number): number {
  for (const [n, v] of [['replicateRank', replicateRank], ['shardRank', shardRank]] as const) {
    if (!Number.isInteger(v) || v < 0) throw new RangeError(`dpRank: ${n} = ${v} must be a non-negative integer`);
  }
  if (!Number.isInteger(shardSize) || shardSize < 1) throw new RangeError(`dpRank: shardSize = ${shardSize} must be a positive integer`);
  if (shardRank >= shardSize) throw new RangeError(`dpRank: shardRank ${shardRank} must be below shardSize ${shardSize}`);
  return rowMajorIndex([replicateRank, shardRank], [shardSize]);
}

export interface PartitionReport {
  ok: boolean;
  /** Samples read more than once, with every DP rank that reads them (a rank twice if it reads a sample twice). */
  collisions: { sample: number; ranks: number[] }[];
  /** Samples in [0, globalBatchSize) that no rank reads. */
  missing: number[];
  /** Ids outside [0, globalBatchSize) or not integers, with the rank that reads them. */
  outOfRange: { sample: number; rank: number }[];
  /** One paragraph naming what is wrong ('' when ok). */
  message: string;
}

const SHOW = 8;

function listSome<T>(items: T[], show: (t: T) => string): string {
  const head = items.slice(0, SHOW).map(show).join('; ');
  return items.length > SHOW ? `${head}; and ${items.length - SHOW} more` : head;
}

/** Compresses sorted integers into ranges: [1,2,3,7] -> "1..3, 7". */
function ranges(xs: number[]): string {
  const parts: string[] = [];
  for (let i = 0; i < xs.length; ) {
    let j = i;
    while (j + 1 < xs.length && xs[j + 1] === xs[j]! + 1) j++;
    parts.push(i === j ? `${xs[i]}` : `${xs[i]}..${xs[j]}`);
    i = j + 1;
  }
  return parts.length > SHOW ? `${parts.slice(0, SHOW).join(', ')}, ... (${xs.length} samples)` : parts.join(', ');
}

/**
 * Checks that perRank[i] (the sample ids DP rank i reads) are disjoint and together cover
 * [0, globalBatchSize). `label` names a rank in the message (default "DP rank i").
 */
export function checkPartition(
  perRank: readonly (readonly number[])[],
  globalBatchSize: number,
  label: (dpRank: number) => string = (i) => `DP rank ${i}`,
): PartitionReport {
  if (!Number.isInteger(globalBatchSize) || globalBatchSize < 1) {
    throw new RangeError(`checkPartition: globalBatchSize = ${globalBatchSize} must be a positive integer`);
  }
  const readers = new Map<number, number[]>();
  const outOfRange: { sample: number; rank: number }[] = [];
  perRank.forEach((ids, rank) => {
    for (const s of ids) {
      if (!Number.isInteger(s) || s < 0 || s >= globalBatchSize) {
        outOfRange.push({ sample: s, rank });
        continue;
      }
      const list = readers.get(s);
      if (list) list.push(rank);
      else readers.set(s, [rank]);
    }
  });
  const collisions = [...readers.entries()]
    .filter(([, rs]) => rs.length > 1)
    .map(([sample, ranks]) => ({ sample, ranks }))
    .sort((a, b) => a.sample - b.sample);
  const missing: number[] = [];
  for (let s = 0; s < globalBatchSize; s++) if (!readers.has(s)) missing.push(s);
  const ok = collisions.length === 0 && missing.length === 0 && outOfRange.length === 0;
  if (ok) return { ok, collisions, missing, outOfRange, message: '' };

  const problems: string[] = [];
  if (collisions.length > 0) {
    // Group collisions by the set of ranks involved so the message names who collides.
    const byRanks = new Map<string, { ranks: number[]; samples: number[] }>();
    for (const c of collisions) {
      const key = c.ranks.join(',');
      const e = byRanks.get(key);
      if (e) e.samples.push(c.sample);
      else byRanks.set(key, { ranks: c.ranks, samples: [c.sample] });
    }
    problems.push(`${collisions.length} sample(s) read by more than one rank: ` +
      listSome([...byRanks.values()], (e) => `${e.ranks.map(label).join(' and ')} both read ${ranges(e.samples)}`));
  }
  if (missing.length > 0) problems.push(`${missing.length} sample(s) read by no rank: ${ranges(missing)}`);
  if (outOfRange.length > 0) {
    const byRank = new Map<number, number[]>();
    for (const o of outOfRange) {
      const l = byRank.get(o.rank);
      if (l) l.push(o.sample);
      else byRank.set(o.rank, [o.sample]);
    }
    problems.push(`${outOfRange.length} id(s) outside [0, ${globalBatchSize}): ` +
      listSome([...byRank.entries()], ([rank, xs]) => `${label(rank)} reads ${xs.every(Number.isInteger) ? ranges([...xs].sort((a, b) => a - b)) : xs.join(', ')}`));
  }
  const message =
    `data partition check failed over ${perRank.length} DP ranks (global batch ${globalBatchSize}): ${problems.join('. ')}. ` +
    'Each DP rank must read a disjoint slice and together all of the global batch; check how the DP rank is computed ' +
    '(replicate_rank * shard_size + shard_rank) and how the loader slices by it.';
  return { ok, collisions, missing, outOfRange, message };
}

/** Thrown (identically on every rank) when the DP ranks' samples do not partition the global batch. */
export class DataPartitionError extends Error {
  constructor(readonly report: PartitionReport) {
    super(report.message);
    this.name = 'DataPartitionError';
  }
}

/**
 * Collective over the DP group: all-gathers every rank's sample ids and checks they partition
 * [0, globalBatchSize). Every rank sees the same gathered ids, so on a violation every rank throws
 * the same DataPartitionError (naming DP ranks with their global ranks, and the samples).
 * Returns the ids of every DP rank.
 */
export function verifyDataPartition(group: ProcessGroup, localSampleIds: readonly number[], globalBatchSize: number): number[][] {
  // A malformed list is reported through the same collective (count -1), so the other ranks fail
  // with this rank instead of waiting for it in the next gather.
  const valid = Array.isArray(localSampleIds) && localSampleIds.every((s) => typeof s === 'number' && Number.isSafeInteger(s));
  const n = group.size;
  const perRank = tidy(() => {
    // Ranks may read different numbers of samples: gather the counts, then pad to the largest.
    const count = full([1], valid ? localSampleIds.length : -1, { dtype: 'int64' });
    const counts = Array.from({ length: n }, () => zeros([1], { dtype: 'int64' }));
    group.allGather(counts, count).wait();
    const lens = counts.map((c) => c.toNumbers()[0]!);
    const malformed = lens.flatMap((l, r) => (l < 0 ? [`${r} (global ${group.ranks[r] ?? r})`] : []));
    if (malformed.length > 0) {
      throw new TypeError(`verifyDataPartition: DP rank(s) ${malformed.join(', ')} passed sample ids that are not an array of integers`);
    }
    const width = Math.max(1, ...lens);
    const mine = full([width], -1, { dtype: 'int64' });
    if (localSampleIds.length > 0) {
      mine.narrow(0, 0, localSampleIds.length).copy_(tensor(BigInt64Array.from(localSampleIds, (x) => BigInt(x))));
    }
    const all = zeros([n * width], { dtype: 'int64' });
    group.allGatherInto(all, mine).wait();
    const flat = all.toNumbers();
    return lens.map((len, r) => flat.slice(r * width, r * width + len));
  });
  const report = checkPartition(perRank, globalBatchSize, (i) => `DP rank ${i} (global rank ${group.ranks[i]})`);
  if (!report.ok) throw new DataPartitionError(report);
  return perRank;
}
