// The one place a config's [parallel] section becomes a layout: the mesh, each rank's place in it,
// and the wrapper that applies data parallelism (replicated or sharded) to a model from outside.
// Models know nothing about ranks; each layout is a choice of config, not a new trainer.
//
// Mesh dims, outermost first: pp (pipeline), dpReplicate, dpShard. The data-parallel rank, which
// decides what data a rank reads, is replicateRank * dpShard + shardRank (the Lingua lesson), and
// every pipeline rank of one replica reads the same data.
import type { Module } from '../nn/module.js';
import { DeviceMesh } from '../distributed/mesh.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { ParallelConfig } from '../train/config.js';
import { DataParallel, type AccumulateFlavour, type ZeroStage } from './data_parallel.js';
import type { UnitPolicy } from './fsdp.js';

export interface Layout {
  pp: number;
  /** Data-parallel ranks: dpReplicate x dpShard. */
  dp: number;
  dpReplicate: number;
  dpShard: number;
  zero: ZeroStage;
  accumulate: AccumulateFlavour;
}

/** Resolves -1 and 'auto' in the [parallel] section for a world (checkRunnable has validated it). */
export function resolveLayout(p: ParallelConfig, worldSize: number): Layout {
  const dp = p.dp === -1 ? worldSize / p.pp : p.dp;
  const zero = p.zero;
  const dpReplicate = zero === 0 ? 1 : p.dpReplicate;
  const dpShard = zero === 0 ? dp : p.dpShard === -1 ? dp / dpReplicate : p.dpShard;
  const accumulate: AccumulateFlavour = p.accumulate === 'auto' ? (zero >= 2 ? 'reduceEach' : 'reduceLast') : p.accumulate;
  return { pp: p.pp, dp, dpReplicate, dpShard, zero, accumulate };
}

export interface DataParallelMesh {
  mesh: DeviceMesh;
  /** All data-parallel ranks of this rank's pipeline position. */
  dp: ProcessGroup;
  shard: ProcessGroup;
  replicate: ProcessGroup;
  pp: ProcessGroup;
  /** This rank's data-parallel rank: replicateRank * dpShard + shardRank. */
  dpRank: number;
}

/** Builds the mesh and its groups (collective: every rank calls it with the same layout). */
export function buildMesh(layout: Layout, world: ProcessGroup): DataParallelMesh {
  const mesh = DeviceMesh.build([['pp', layout.pp], ['dpReplicate', layout.dpReplicate], ['dpShard', layout.dpShard]], world);
  const dp = mesh.flatten(['dpReplicate', 'dpShard'], 'dp');
  const c = mesh.coords();
  const dpRank = c.dpReplicate! * layout.dpShard + c.dpShard!;
  if (dp.rank !== dpRank) throw new Error(`internal: flattened dp rank ${dp.rank} differs from replicateRank x dpShard + shardRank = ${dpRank}`);
  return { mesh, dp: dp.group, shard: mesh.dim('dpShard').group, replicate: mesh.dim('dpReplicate').group, pp: mesh.dim('pp').group, dpRank };
}

export interface ParallelizeOptions {
  bucketSizeMb: number;
  overlap: boolean;
  findUnusedParameters?: boolean;
  nonFinite?: 'off' | 'raise' | 'skip';
  /** ZeRO-3: free each unit's gathered parameters after its forward (default true). */
  reshardAfterForward?: boolean;
  /** ZeRO-3: gather the next unit while the current one computes (default true). */
  prefetch?: boolean;
  /** ZeRO-3: the wrapping units (fsdp.ts: unitsByClass, unitsByPath). */
  units?: UnitPolicy;
  /** Test-only: skip the 1/N averaging of one bucket (verification must catch it). */
  breakAveragingOfBucket?: number;
}

/** Wraps the model for the layout's data parallelism (plain, ZeRO-1/2/3, HSDP). */
export function parallelize<M extends Module>(model: M, m: DataParallelMesh, layout: Layout, opts: ParallelizeOptions): DataParallel<M> {
  return new DataParallel(model, {
    group: m.dp,
    zero: layout.zero,
    ...(layout.zero >= 1 ? { shardGroup: m.shard, replicateGroup: m.replicate } : {}),
    accumulate: layout.accumulate,
    bucketSizeMb: opts.bucketSizeMb,
    overlap: opts.overlap,
    ...(opts.findUnusedParameters !== undefined ? { findUnusedParameters: opts.findUnusedParameters } : {}),
    ...(opts.nonFinite !== undefined ? { nonFinite: opts.nonFinite } : {}),
    ...(opts.breakAveragingOfBucket !== undefined ? { breakAveragingOfBucket: opts.breakAveragingOfBucket } : {}),
    ...(opts.reshardAfterForward !== undefined ? { reshardAfterForward: opts.reshardAfterForward } : {}),
    ...(opts.prefetch !== undefined ? { prefetch: opts.prefetch } : {}),
    ...(opts.units ? { units: opts.units } : {}),
  });
}

/** One line for the run's header. */
export function describeLayout(l: Layout): string {
  const parts: string[] = [];
  if (l.pp > 1) parts.push(`pipeline ${l.pp}`);
  if (l.zero === 0) parts.push(l.dp > 1 ? `data parallel ${l.dp}` : 'single replica');
  else parts.push(`ZeRO-${l.zero} sharded over ${l.dpShard}` + (l.dpReplicate > 1 ? ` x ${l.dpReplicate} replicas (HSDP)` : ''));
  parts.push(`accumulate ${l.accumulate}`);
  return parts.join(', ');
}
