// The one place DataParallel wrappers are built for a layout: a whole model's, or a pipeline rank's
// stages under one container; with expert parallelism, a second wrapper over the experts
// ([Note: expert parallelism] in ../expert_parallel.ts). parallelize() passes the mesh's groups
// (dataParallelGroups in ../parallelize.ts); PipelineParallel used on its own passes its options'.
import type { Tensor } from '../../tensor/index.js';
import type { Module } from '../../nn/module.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import { DataParallel, type DataParallelOptions } from './data_parallel.js';
import type { UnitPolicy } from './fsdp.js';
import type { Layout } from '../layout.js';

/** Knobs of the data-parallel wrapping that are not part of the layout. */
export interface DataParallelKnobs {
  bucketSizeMb?: number;
  /** What gradient collectives move: 'fp32' (default) or 'bf16' (DataParallelOptions.reduceDtype). */
  reduceDtype?: 'fp32' | 'bf16';
  overlap?: boolean;
  findUnusedParameters?: boolean;
  /** The whole model's wrapper only: a pipeline's and the experts' leave it off (see buildDataParallel). */
  nonFinite?: 'off' | 'raise' | 'skip';
  /** ZeRO-3: free each unit's gathered parameters after its forward (default true). */
  reshardAfterForward?: boolean;
  /** ZeRO-3: gather the next unit while the current one computes (default true). */
  prefetch?: boolean;
  /** ZeRO-3: the wrapping units (fsdp.ts: unitsByClass, unitsByPath; a GPT's are gptUnits). */
  units?: UnitPolicy;
}

const KNOBS = ['bucketSizeMb', 'reduceDtype', 'overlap', 'findUnusedParameters', 'nonFinite', 'reshardAfterForward', 'prefetch', 'units'] as const;
// The use and finiteness checks stay with the dense wrapper: every expert computes every step (its
// rows stacked, applyGrouped in src/nn/moe.ts), and a verdict over edp alone could part ranks that
// step together.
const EXPERT_KNOBS = KNOBS.filter((k) => k !== 'findUnusedParameters' && k !== 'nonFinite');

/** The knobs among `keys` that are set. */
function knobsOf(knobs: DataParallelKnobs | undefined, keys: readonly (keyof DataParallelKnobs)[]): Partial<DataParallelOptions> {
  const out: Record<string, unknown> = {};
  for (const k of keys) if (knobs?.[k] !== undefined) out[k] = knobs[k];
  return out;
}

/** The groups a layout's data parallelism reduces and shards over (parallelize takes them from the mesh). */
export interface DataParallelGroups {
  /** Every rank the (dense) gradients are averaged over. */
  dp: ProcessGroup;
  /** ZeRO: the ranks that split the state (default dp) and, under HSDP, the replicas of a shard. */
  shard?: ProcessGroup;
  replicate?: ProcessGroup;
  /** Expert parallelism: the ranks holding the same experts, and under HSDP those of one replica (the experts' shard group). */
  edp?: ProcessGroup;
  edpShard?: ProcessGroup;
}

/** What a data-parallel wrapping is built from: the layout's ZeRO stage and accumulation, the groups and the knobs. */
export interface DataParallelSpec {
  layout: Pick<Layout, 'zero' | 'accumulate'>;
  groups: DataParallelGroups;
  knobs?: DataParallelKnobs;
}

export interface DataParallelWrappers<M extends Module> {
  /** Every parameter but the experts. */
  dense: DataParallel<M>;
  /** The experts (reduced over edp), when the module holds any. */
  experts?: DataParallel<M>;
}

/**
 * Wraps `module` for the spec's data parallelism (plain, ZeRO-1/2/3, HSDP). `experts`: the expert
 * parameters expert parallelism cut (a second wrapper holds them); `entries`: the modules a forward
 * enters through when `module` is a container never called itself (a pipeline's stages).
 */
export function buildDataParallel<M extends Module>(module: M, spec: DataParallelSpec, part: { experts?: ReadonlySet<Tensor>; entries?: readonly Module[] } = {}): DataParallelWrappers<M> {
  const { layout: { zero, accumulate }, groups } = spec;
  const common = { zero, accumulate, ...(part.entries ? { entries: part.entries } : {}) };
  const expertParams = part.experts && part.experts.size > 0 ? part.experts : undefined;
  const dense = new DataParallel(module, {
    ...knobsOf(spec.knobs, KNOBS), ...common, group: groups.dp,
    ...(groups.shard ? { shardGroup: groups.shard } : {}),
    ...(groups.replicate ? { replicateGroup: groups.replicate } : {}),
    ...(expertParams ? { exclude: expertParams } : {}),
  });
  if (!expertParams) return { dense };
  if (!groups.edp) throw new Error('buildDataParallel: expert parameters need groups.edp, the ranks holding the same experts (buildMesh with layout.ep > 1)');
  const denseParams = new Set(module.parameters().filter((p) => !expertParams.has(p)));
  const experts = new DataParallel(module, {
    ...knobsOf(spec.knobs, EXPERT_KNOBS), ...common, group: groups.edp, exclude: denseParams,
    // An expert's gradient already holds the sum over its ep group's tokens: 1 / every dense rank.
    gradScale: 1 / groups.dp.size,
    // Sharded over the expert-holding ranks of a replica; HSDP replicas hold the same shard.
    ...(zero >= 1 ? { shardGroup: groups.edpShard ?? groups.edp, ...(groups.replicate ? { replicateGroup: groups.replicate } : {}) } : {}),
  });
  return { dense, experts };
}
