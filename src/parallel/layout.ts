// The layout: the one description of how a model is spread over ranks ([parallel] in a config),
// its validation and the choices derived from it. Everything that needs the layout reads it from
// here: the config (src/config/schema.ts takes its defaults and choices), the trainer, parallelize.ts
// and DataParallel's accumulation default.
//
// Mesh dims, outermost first, are the table in src/distributed/mesh_axes.ts ([Note: mesh axes]):
// pp (pipeline), dpReplicate, dpShard, cp (context parallel), tp (tensor parallel, innermost so a
// tensor-parallel group is neighbouring ranks). The data-parallel rank, which decides what data a
// rank reads, is the flattened (dpReplicate, dpShard) mesh rank: replicateRank * dpShard +
// shardRank (the Lingua lesson; DeviceMesh.flatten computes it, and no one else does). Every
// pipeline rank, context-parallel rank and tensor-parallel rank of one replica reads the same
// samples (a cp rank then keeps its chunks of each sequence).
import { SCHEDULE_NAMES, type ScheduleName } from './pipeline/schedule.js';
import { meshDims } from '../distributed/mesh_axes.js';

export type ZeroStage = 0 | 1 | 2 | 3;
export type AccumulateFlavour = 'reduceLast' | 'reduceEach' | 'reduceScatterEachAllReduceLast';

/** The accumulation flavours ([Note: accumulation] in data_parallel/data_parallel.ts). */
export const ACCUMULATE_FLAVOURS: readonly AccumulateFlavour[] = ['reduceLast', 'reduceEach', 'reduceScatterEachAllReduceLast'];
/** What [parallel] accumulate, reduceDtype, backend and ppSchedule accept. */
export const PARALLEL_CHOICES = {
  accumulate: ['auto', ...ACCUMULATE_FLAVOURS] as const,
  ppSchedule: SCHEDULE_NAMES,
  reduceDtype: ['fp32', 'bf16'] as const,
  backend: ['auto', 'gloo', 'mpi'] as const,
};

/** The [parallel] config section (every field is documented in src/config/schema.ts). */
export interface ParallelConfig {
  dp: number;
  /** 0 = plain data parallel; 1, 2, 3 = ZeRO stage (optimizer state; + gradients; + parameters sharded). */
  zero: ZeroStage;
  /** Ranks one model state is sharded over (-1: the data-parallel ranks / dpReplicate). */
  dpShard: number;
  /** Replicas of the sharded state (HSDP when > 1). */
  dpReplicate: number;
  /** When gradients are reduced under accumulation (data_parallel/data_parallel.ts, [Note: accumulation]). */
  accumulate: 'auto' | AccumulateFlavour;
  /** ZeRO-3: free a unit's gathered parameters after its forward (false keeps them until its backward). */
  reshardAfterForward: boolean;
  /** Pipeline ranks (stages per model replica, times ppVirtualStages); 1 = no pipeline. */
  pp: number;
  ppSchedule: ScheduleName;
  ppVirtualStages: number;
  bucketSizeMb: number;
  overlap: boolean;
  /** What gradient collectives move: float32, or bfloat16 (cast from and back into the float32 buckets). */
  reduceDtype: 'fp32' | 'bf16';
  /** Tensor-parallel ranks (the innermost mesh dim); 1 = none. */
  tp: number;
  /** Under tp: LayerNorm, dropout and the residual stream sharded over tokens (Megatron's sequence parallelism). */
  sequenceParallel: boolean;
  /** Under tp: logits stay sharded over the vocabulary and the loss is the vocab-parallel cross-entropy. */
  lossParallel: boolean;
  /** Collective backend: "auto" (Open MPI when installed, else Gloo), "gloo" or "mpi" (src/distributed/process_group.ts). */
  backend: 'auto' | 'gloo' | 'mpi';
  /** Expert parallelism: MoE experts split over this many neighbouring ranks of dpShard x cp (1 = every rank holds every expert). */
  ep: number;
  /** Context parallelism: each sequence split over this many ranks, attention as a ring (1 = whole sequences on every rank). */
  cp: number;
  /** Train with the layout `flotilla plan` ranks first (src/plan) instead of the one this section sets. */
  auto: boolean;
}

/**
 * The [parallel] defaults: the config schema (src/config/schema.ts) documents each field and takes
 * its default from here, and layoutFor fills a script's unset fields from here, so both agree.
 */
export const PARALLEL_DEFAULTS: Readonly<ParallelConfig> = {
  dp: -1, zero: 0, dpShard: -1, dpReplicate: 1, accumulate: 'auto', reshardAfterForward: true, bucketSizeMb: 0, reduceDtype: 'fp32',
  overlap: true, backend: 'auto', pp: 1, ppSchedule: '1f1b', ppVirtualStages: 1, tp: 1, sequenceParallel: false, lossParallel: false, ep: 1, cp: 1, auto: false,
};

/** A layout resolved for a world: every degree known. */
export interface Layout {
  pp: number;
  /** Data-parallel ranks: dpReplicate x dpShard. */
  dp: number;
  dpReplicate: number;
  dpShard: number;
  zero: ZeroStage;
  accumulate: AccumulateFlavour;
  /** Tensor-parallel degree (absent or 1 = none), and its two options. */
  tp?: number;
  sequenceParallel?: boolean;
  lossParallel?: boolean;
  /** Pipeline schedule and stages per rank (used when pp > 1). */
  schedule?: ScheduleName;
  virtualStages?: number;
  /** Expert-parallel degree (absent or 1 = none): carved from the data-parallel shard ranks, neighbours in dp-rank order. */
  ep?: number;
  /** Context-parallel degree (absent or 1 = none): ranks that split each sequence ([Note: context parallelism]). */
  cp?: number;
}

/**
 * The accumulation flavour, decided here only: 'auto' (or nothing) means reduceLast in a pipeline
 * (it reduces once per step), else reduceEach where gradients are sharded (zero 2/3), else
 * reduceLast. A flavour asked for is kept (accumulateProblems refuses what cannot run).
 */
export function resolveAccumulate(zero: ZeroStage, requested: 'auto' | AccumulateFlavour | undefined, opts: { pipeline?: boolean } = {}): AccumulateFlavour {
  if (requested === undefined || requested === 'auto') return !opts.pipeline && zero >= 2 ? 'reduceEach' : 'reduceLast';
  return requested;
}

/**
 * Why an accumulation flavour cannot run with this zero stage (empty when it can), worded for a
 * config ('parallel.accumulate', with the pipeline degree) or for the DataParallel options ('api').
 */
export function accumulateProblems(zero: ZeroStage, acc: string, replicated: boolean, pp: number, wording: 'config' | 'api'): string[] {
  const flavours: readonly string[] = ACCUMULATE_FLAVOURS;
  const config = wording === 'config';
  if (!flavours.includes(acc) && !(config && acc === 'auto')) {
    return [config ? `parallel.accumulate must be "auto" or one of ${flavours.join(', ')}, got ${String(acc)}` : `accumulate must be one of ${flavours.join(', ')}, got ${String(acc)}`];
  }
  const out: string[] = [];
  if (zero <= 1 && (acc === 'reduceEach' || acc === 'reduceScatterEachAllReduceLast')) {
    out.push(config
      ? `parallel.accumulate = "${acc}" reduces into gradient shards, which parallel.zero = ${zero} does not keep; use "reduceLast" (or "auto"), or set parallel.zero to 2 or 3`
      : `accumulate '${acc}' reduces into gradient shards, which zero ${zero} does not keep (its gradients are replicated); use 'reduceLast' or zero >= 2`);
  }
  if (acc === 'reduceScatterEachAllReduceLast' && !replicated) {
    out.push(config
      ? 'parallel.accumulate = "reduceScatterEachAllReduceLast" is for hybrid sharding: set parallel.dpReplicate > 1, or use "reduceEach" / "reduceLast"'
      : "accumulate 'reduceScatterEachAllReduceLast' is for hybrid sharding (a replicate group of size > 1); without replicas use 'reduceEach' or 'reduceLast'");
  }
  // A pipeline's schedule accumulates every micro-batch into the full gradient buckets (the
  // zero-bubble weight pass writes into them by hand) and reduces once per step, so a flavour that
  // reduces every micro-batch cannot run. Under HSDP, reduceScatterEachAllReduceLast reduces there
  // as reduceLast does: reduce-scatter, then one all-reduce across replicas.
  if (pp > 1 && acc === 'reduceEach') {
    out.push(config
      ? `parallel.accumulate = "${acc}" with parallel.pp = ${pp}: a pipeline reduces its gradients once per step; use "auto" or "reduceLast" (or, with parallel.dpReplicate > 1, "reduceScatterEachAllReduceLast")`
      : `accumulate '${acc}' in a pipeline: the schedule reduces its gradients once per step; use 'reduceLast' (or, under hybrid sharding, 'reduceScatterEachAllReduceLast')`);
  }
  return out;
}

/**
 * Every problem with a [parallel] section, each naming the field and the fix; with a world size
 * also whether the degrees fit it. The one validation of a layout: the config checks it without a
 * world when parsed, and with the world before any rank starts.
 */
export function layoutProblems(p: ParallelConfig, worldSize?: number): string[] {
  const out: string[] = [];
  if (p.dp === 0) out.push('parallel.dp must be -1 (the world size) or a positive integer, got 0');
  if (p.dpShard === 0) out.push('parallel.dpShard must be -1 (the rest of the data-parallel ranks) or a positive integer, got 0');
  if (p.zero === 0 && (p.dpShard > 1 || p.dpReplicate > 1)) {
    out.push('parallel.dpShard / parallel.dpReplicate split the data-parallel ranks for sharding, but parallel.zero = 0 replicates everything; set parallel.zero to 1, 2 or 3, or leave dpShard and dpReplicate unset');
  }
  out.push(...accumulateProblems(p.zero, p.accumulate, p.dpReplicate > 1, p.pp, 'config'));
  if (p.ppVirtualStages > 1 && p.ppSchedule !== 'interleaved') {
    out.push(`parallel.ppVirtualStages=${p.ppVirtualStages} needs parallel.ppSchedule = "interleaved" (got "${p.ppSchedule}"); set ppVirtualStages = 1 or switch the schedule`);
  }
  const tp = p.tp ?? 1;
  if (!Number.isInteger(tp) || tp < 1) out.push(`parallel.tp must be a positive integer (1 = no tensor parallelism), got ${tp}`);
  if (tp === 1 && p.sequenceParallel) out.push('parallel.sequenceParallel shards activations over the tensor-parallel ranks: set parallel.tp > 1, or sequenceParallel = false');
  if (tp === 1 && p.lossParallel) out.push('parallel.lossParallel shards the logits over the tensor-parallel ranks: set parallel.tp > 1, or lossParallel = false');
  const ep = p.ep ?? 1;
  if (!Number.isInteger(ep) || ep < 1) out.push(`parallel.ep must be a positive integer (1 = no expert parallelism), got ${ep}`);
  const cp = p.cp ?? 1;
  if (!Number.isInteger(cp) || cp < 1) out.push(`parallel.cp must be a positive integer (1 = no context parallelism), got ${cp}`);
  if (worldSize === undefined || !(tp >= 1) || !(cp >= 1)) return out;
  const pp = p.pp;
  const model = pp * cp * tp; // ranks one data-parallel rank spans
  if (worldSize % model !== 0) {
    const what = tp > 1 || cp > 1 ? [`parallel.pp=${pp}`, ...(cp > 1 ? [`parallel.cp=${cp}`] : []), ...(tp > 1 ? [`parallel.tp=${tp}`] : [])].join(' x ') + ` = ${model}` : `parallel.pp=${pp}`;
    out.push(`${what} does not divide the world of ${worldSize} rank(s); start a multiple of ${model} ranks (--nproc ${model * Math.max(1, Math.round(worldSize / model))}) or choose degrees whose product divides ${worldSize}`);
  }
  const replicas = Math.max(1, Math.floor(worldSize / model)); // ranks left for data parallelism
  const dp = p.dp === -1 ? replicas : p.dp;
  if (dp !== replicas) {
    const over = [pp > 1 ? `parallel.pp=${pp} pipeline ranks` : '', cp > 1 ? `parallel.cp=${cp} context-parallel ranks` : '', tp > 1 ? `parallel.tp=${tp} tensor-parallel ranks` : ''].filter(Boolean).join(' x ');
    out.push(
      `parallel.dp=${p.dp} but the world has ${worldSize} rank(s)${over ? ` over ${over}` : ''}; ` +
        `set parallel.dp=-1 (or ${replicas}), or start ${dp * model} ranks (--nproc ${dp * model})`,
    );
  }
  // Expert-parallel ranks are carved from the ranks holding the same dense parameters: dp x cp, and
  // under sharding the shard ranks of one replica, dpShard x cp ([Note: expert parallelism]).
  const cpOf = (n: number) => (cp > 1 ? ` x parallel.cp (${cp}) = ${n * cp}` : '');
  if (ep > 1 && (dp * cp) % ep !== 0) out.push(`parallel.ep = ${ep} must divide the ${dp} data-parallel rank(s)${cpOf(dp)} (expert-parallel ranks are carved from them); choose an ep that divides ${dp * cp}`);
  if (p.zero >= 1) {
    const r = p.dpReplicate;
    const shard = p.dpShard === -1 ? dp / r : p.dpShard;
    if (ep > 1 && Number.isInteger(shard) && (shard * cp) % ep !== 0 && (dp * cp) % ep === 0) out.push(`parallel.ep = ${ep} must divide parallel.dpShard (${shard})${cpOf(shard)}: expert-parallel ranks are carved from the shard ranks of one replica; choose an ep that divides ${shard * cp}`);
    if (!Number.isInteger(shard) || shard * r !== dp) {
      out.push(
        `parallel.dpReplicate=${r} x parallel.dpShard=${p.dpShard === -1 ? `-1 (${dp} / ${r})` : p.dpShard} must equal the ${dp} data-parallel rank(s); ` +
          `choose dpReplicate and dpShard whose product is ${dp} (dpShard = -1 takes the rest)`,
      );
    }
  }
  return out;
}

/** The data-parallel degree a [parallel] section gives on a world (-1 resolved). */
export function dataParallelDegree(p: Pick<ParallelConfig, 'dp' | 'pp'> & { tp?: number; cp?: number }, worldSize: number): number {
  return p.dp === -1 ? Math.max(1, Math.floor(worldSize / (p.pp * (p.cp ?? 1) * (p.tp ?? 1)))) : p.dp;
}

/** A [parallel] section that cannot run on this world: every problem, each naming the fix. */
export class LayoutError extends Error {
  constructor(readonly problems: string[]) {
    super(`the [parallel] layout cannot run:\n  - ${problems.join('\n  - ')}`);
    this.name = 'LayoutError';
  }
}

/** Resolves -1 and 'auto' in the [parallel] section for a world; throws LayoutError when it does not fit. */
export function resolveLayout(p: ParallelConfig, worldSize: number): Required<Layout> {
  const problems = layoutProblems(p, worldSize);
  if (problems.length > 0) throw new LayoutError(problems);
  const dp = dataParallelDegree(p, worldSize);
  const zero = p.zero;
  const dpReplicate = zero === 0 ? 1 : p.dpReplicate;
  const dpShard = zero === 0 ? dp : p.dpShard === -1 ? dp / dpReplicate : p.dpShard;
  const accumulate = resolveAccumulate(zero, p.accumulate, { pipeline: p.pp > 1 });
  const tp = p.tp ?? 1;
  return {
    pp: p.pp, dp, dpReplicate, dpShard, zero, accumulate, tp, sequenceParallel: tp > 1 && !!p.sequenceParallel, lossParallel: tp > 1 && !!p.lossParallel,
    schedule: p.ppSchedule, virtualStages: p.ppVirtualStages, ep: p.ep ?? 1, cp: p.cp ?? 1,
  };
}

/**
 * Whether the whole model is built without parameter memory ([Note: deferred init] in
 * src/nn/module.ts): under ZeRO-3, where each rank then makes only its shards, unless tensor or
 * expert parallelism first cuts its slices or its experts from the built tensors. (A pipeline
 * rank builds only its stages, whole.)
 */
export function defersInit(l: Pick<Layout, 'zero' | 'tp' | 'ep'>): boolean {
  return l.zero === 3 && (l.tp ?? 1) === 1 && (l.ep ?? 1) === 1;
}

/** One line for the run's header. */
export function describeLayout(l: Layout): string {
  const parts: string[] = [];
  if (l.pp > 1) parts.push(`pipeline ${l.pp}`);
  if ((l.cp ?? 1) > 1) parts.push(`context parallel ${l.cp}`);
  if ((l.tp ?? 1) > 1) parts.push(`tensor parallel ${l.tp}${l.sequenceParallel ? ' + sequence parallel' : ''}${l.lossParallel ? ' + loss parallel' : ''}`);
  if (l.zero === 0) parts.push(l.dp > 1 ? `data parallel ${l.dp}` : 'single replica');
  else parts.push(`ZeRO-${l.zero} sharded over ${l.dpShard}${(l.cp ?? 1) > 1 ? ` x cp ${l.cp}` : ''}` + (l.dpReplicate > 1 ? ` x ${l.dpReplicate} replicas (HSDP)` : ''));
  if ((l.ep ?? 1) > 1) parts.push(`expert parallel ${l.ep}`);
  parts.push(`accumulate ${l.accumulate}`);
  return parts.join(', ');
}

/** The mesh's degrees, outermost first, for the run's header and its report. */
export function describeMesh(l: Layout): string {
  return `mesh ${meshDims(l).map(([a, d]) => `${a} ${d}`).join(' x ')}`;
}

/** The layout fields a script sets; the rest take the config's defaults. */
export type LayoutRequest = Partial<Pick<ParallelConfig, 'dp' | 'zero' | 'dpShard' | 'dpReplicate' | 'accumulate' | 'pp' | 'ppSchedule' | 'ppVirtualStages' | 'tp' | 'sequenceParallel' | 'lossParallel' | 'ep' | 'cp'>>;

/**
 * A layout for a script that has no config file: `layoutFor({ pp: 2, zero: 2 }, world.size)`.
 * Unset fields default as in [parallel] (dp and dpShard take the rest of the ranks); validated
 * like a config.
 */
export function layoutFor(req: LayoutRequest, worldSize: number): Required<Layout> {
  return resolveLayout({ ...PARALLEL_DEFAULTS, ...req }, worldSize);
}

/**
 * The bucket size when none is given: 25 MiB (PyTorch DDP's), but 4 MiB under ZeRO-2. A ZeRO-2 rank
 * holds full gradients only for the buckets in reduction: the one backward is filling, the one
 * being reduce-scattered and that one's staging ([Note: reduction window] in data_parallel/data_parallel.ts),
 * about three buckets at full size. At 25 MiB that is more than the 2 B/param the sharded gradients
 * save on a model of 25M parameters; at 4 MiB it is 12 MiB whatever the model (measured in
 * docs/BENCHMARKS.md, "ZeRO peak memory"). The price is time: under plain data parallelism a step
 * takes the same at 2 and 25 MiB buckets (docs/BENCHMARKS.md, "Data parallel"), but a ZeRO-2 bucket
 * waits for the previous one's reduction, and a 25M-parameter GPT on 2 ranks stepped in 1.8-1.95 s
 * at 4 MiB against 1.3-1.5 s at 25 MiB, with the same peak (there the peak is not in the reduction
 * window): set bucketSizeMb on a large model that has memory to spare. Under ZeRO-3 a bucket is a
 * wrapping unit. The planner prices buckets of this size too.
 */
export function defaultBucketSizeMb(zero: ZeroStage): number {
  return zero === 2 ? 4 : 25;
}

/** The bucket size a config's `[parallel] bucketSizeMb` asks for: its value, or 0 for the stage's default. */
export function configuredBucketSizeMb(bucketSizeMb: number, zero: ZeroStage): number {
  return bucketSizeMb > 0 ? bucketSizeMb : defaultBucketSizeMb(zero);
}
