// [Note: plan terms] The one model of a layout's memory and step time. Every layout axis describes,
// beside its own code, what it does to one rank: which part of the model the rank holds and
// computes, which bytes it keeps (parameters, gradients, optimizer state, gathered units, buffers),
// how many micro-batches of activations stay alive, and which collectives it sends per step over
// which group. The planner (src/plan) folds those descriptions in mesh order (PLAN_AXES in
// src/plan/axes.ts) into a RankBudget and turns the budget into bytes and milliseconds with what
// this machine measured (the model's own forward and backward, and the collectives' latency and
// bandwidth: src/plan/calibrate.ts). Nothing here knows a wrapper's internals; a new [parallel]
// field without an axis that claims it fails test/plan_enumerate.test.ts.
//
// These are the terms every layer prices itself in (src/nn's precision and activation
// checkpointing, src/parallel's wrappers), so they sit in the runtime, below all of them, and
// import nothing above it: they are ranks, groups and collectives, the mesh's vocabulary. The
// layout's choices are therefore written out here rather than imported from src/parallel and
// src/config (ppSchedule, accumulate, reduceDtype, precision, activationCheckpoint);
// TERMS_AGREE in src/plan/terms.ts makes the compiler hold them equal to the originals.
import { meshStride, type MeshAxis, type MeshDegrees } from './mesh_axes.js';

/** What a layout sets, in the config's own field names (the `layout` of `flotilla plan --json`). */
export interface PlanLayout {
  dp: number;
  zero: 0 | 1 | 2 | 3;
  dpShard: number;
  dpReplicate: number;
  pp: number;
  ppSchedule: 'gpipe' | '1f1b' | 'interleaved' | 'zb';
  ppVirtualStages: number;
  tp: number;
  sequenceParallel: boolean;
  cp: number;
  ep: number;
  microBatches: number;
  activationCheckpoint: 'none' | 'full' | 'selective';
  precision: 'fp32' | 'bf16-mixed';
}

/** The model's sizes, counted from its own parameters (facts.ts), by part. */
export interface ModelFacts {
  arch: string;
  numParams: number;
  /** Parameters before the first block (embeddings) and after the last (final norm, head). */
  embedParams: number;
  headParams: number;
  /** Per block: its dense parameters, and those in routed experts. */
  blockParams: number[];
  blockExpertParams: number[];
  /** The largest ZeRO-3 wrapping unit (a block), in parameters. */
  largestUnitParams: number;
  /**
   * Per token, the summed output widths of the Linears of the largest block (outside routed experts):
   * the output gradients the zero-bubble schedule keeps for each weight gradient it defers.
   */
  blockLinearOutputs: number;
  nEmbd: number;
  /** Query heads (the attention scores' count). */
  nHead: number;
  vocabSize: number;
  /** Experts each token goes to (MoE models; 0 without experts). */
  topK: number;
  /**
   * A LoRA run ([lora] rank > 0; [Note: LoRA plan]): the counts above include the adapters, which
   * are the only trainable parameters; these are the adapters' counts by the same parts, and the
   * bytes of each frozen base element (2 stored in bfloat16, 4 in float32).
   */
  lora?: { baseBytes: 2 | 4; embedAdapterParams: number; headAdapterParams: number; blockAdapterParams: number[] };
}

/** A collective this layout issues per step. */
export type Collective = 'allReduce' | 'allGather' | 'reduceScatter' | 'sendRecv' | 'allToAll';

export interface CommOp {
  /** Which axis sends it and why (shown in --json). */
  what: string;
  op: Collective;
  /** Ranks in the group. */
  group: number;
  /** Bytes of one call's input (the whole buffer reduced or gathered, or the message sent). */
  bytes: number;
  /** Calls per step. */
  times: number;
  /** Each call is issued as this many collectives of bytes / calls each (gradient buckets, ZeRO-3 units); default 1. */
  calls?: number;
  /** ZeRO-3's own work per unit collective (gathering into and freeing the unit's parameters), priced from the baseline's measurement. */
  zero3Unit?: boolean;
  /**
   * A collective the rank's compute waits on where it is issued (tensor, sequence and context
   * parallelism's inside forward and backward; ZeRO-2's gradient buckets, each finished before the
   * next is launched). Each call also pays what that probe measured beyond the table ([Note: in-step
   * collectives] in src/plan/predict.ts).
   */
  inStep?: InStepProbe;
  /** What it can hide behind: the backward pass (gradient buckets, ZeRO-3 prefetch), or nothing. */
  overlaps: 'backward' | 'forward' | 'none';
  /** The group spans hosts (measured apart, when it could be). */
  crossHost: boolean;
}

/**
 * The layouts whose in-step collectives are measured (src/plan/calibrate.ts, with the probe model
 * of the config's width: probeFlags) ([Note: in-step collectives] in src/plan/predict.ts).
 */
export const IN_STEP_PROBES = ['tp', 'sp', 'cp', 'zero2'] as const;
export type InStepProbe = (typeof IN_STEP_PROBES)[number];

/** The memory terms of a rank's peak, in bytes (their sum is the prediction). */
export const MEMORY_TERMS = [
  'baseline', 'parameters', 'gradients', 'optimizer', 'zero3Gathers', 'bf16Copies', 'activations', 'commBuffers',
] as const;
export type MemoryTerm = (typeof MEMORY_TERMS)[number];

/** One rank's share of a layout, built by the axes in mesh order. */
export interface RankBudget {
  /** Parameters of the model piece this rank computes with (after pp, tp and ep split the model). */
  params: number;
  /** Of which in routed experts. */
  expertParams: number;
  /** Of which frozen (a LoRA run's base, [Note: LoRA plan]; 0 otherwise): no gradient, no optimizer state. */
  frozenParams: number;
  /** Blocks this rank computes (its pipeline stages'), and whether it holds the embedding and the head. */
  blocks: number;
  embed: boolean;
  head: boolean;
  /** Share of a block's compute per token this rank does (tp divides it), and of its activations. */
  blockShare: number;
  activationShare: number;
  /** Bytes per block and micro-batch an axis adds to (or takes from) the share of the calibrated activations. */
  blockActivationBytes: number;
  /** Samples per micro-batch and tokens per sample this rank computes. */
  samples: number;
  tokens: number;
  /** Micro-batches whose activations are alive at the peak (a pipeline schedule keeps several). */
  liveMicroBatches: number;
  /** Parameter, gradient and optimizer bytes per held parameter (fp32: 4, 4, 8) and the parameters each covers. */
  paramsHeld: number;
  gradsHeld: number;
  optimizerHeld: number;
  /** Bytes by term (the baseline and activations are filled in by the planner from measurements). */
  memory: Record<MemoryTerm, number>;
  comm: CommOp[];
  /** A pipeline's schedule (its bubbles come from the project's simulator). */
  pipeline?: { schedule: PlanLayout['ppSchedule']; pp: number; micro: number; virtualStages: number };
  /** What the axes want said beside the numbers. */
  notes: string[];
}

/** What an axis reads: the layout, the world, the model and the batch. */
export interface PlanContext {
  layout: PlanLayout;
  world: number;
  ranksPerHost: number;
  /** This rank's pipeline stage (0..pp-1): stages differ in what they hold. */
  stageRank: number;
  model: ModelFacts;
  globalBatch: number;
  seqLen: number;
  /** [parallel] knobs every layout keeps from the config. */
  bucketBytes: number;
  reduceDtype: 'fp32' | 'bf16';
  overlap: boolean;
  accumulate: 'auto' | 'reduceLast' | 'reduceEach' | 'reduceScatterEachAllReduceLast';
  reshardAfterForward: boolean;
  lossParallel: boolean;
}

/**
 * One layout axis's description of itself: the config fields it owns and what it does to a rank.
 * Axes run in mesh order (pipeline, tensor, context, expert, data parallelism, then the step's
 * policies), each on what the previous ones left. An axis is written `{ ..., fields: [...] as const,
 * ... } satisfies PlanAxis`, so the planner's list of axes (PLAN_AXES, typed with the config's
 * fields) checks each name it claims.
 */
export interface PlanAxis<Field extends string = string> {
  name: string;
  fields: readonly Field[];
  apply(b: RankBudget, ctx: PlanContext): void;
}

// [Note: LoRA plan] A LoRA run holds its frozen base at its stored bytes (2 in bfloat16, 4 in
// float32) with no gradient, no optimizer state and no reduction, and its adapters as any trained
// parameter (4 + 4 + 8 bytes under AdamW in float32): the parameter terms count both, the gradient,
// optimizer and reduction terms the adapters only (trainedParams). The base is split by pp, tp and
// ep as every parameter is, and sharded and gathered by ZeRO-3 in its own dtype.

/** Of the parameters a rank computes with, those trained (all but a LoRA run's frozen base). */
export function trainedParams(b: Pick<RankBudget, 'params' | 'frozenParams'>): number {
  return b.params - b.frozenParams;
}

/** Bytes of `params` parameters of which `frozen` are a LoRA base ([Note: LoRA plan]): 4 each, the base's at its stored bytes. */
export function heldParamBytes(m: ModelFacts, params: number, frozen: number): number {
  return 4 * (params - frozen) + (m.lora?.baseBytes ?? 4) * frozen;
}

/** Bytes per element of what a layout computes and communicates in (activations, bf16 gathers): 2 under bf16-mixed, else 4. */
export function computeBytes(l: PlanLayout): 2 | 4 {
  return l.precision === 'bf16-mixed' ? 2 : 4;
}

/** Whether a group of `size` ranks whose members are `stride` ranks apart spans hosts. */
export function crossesHosts(stride: number, size: number, ranksPerHost: number): boolean {
  return size > 1 && stride * size > ranksPerHost;
}

/** A layout's degree on each mesh axis, with -1 resolved (without ZeRO every data-parallel rank is a shard rank). */
export function planMeshDegrees(l: PlanLayout): MeshDegrees {
  const dpReplicate = l.zero === 0 ? 1 : l.dpReplicate;
  return { pp: l.pp, dpReplicate, dpShard: l.zero === 0 || l.dpShard === -1 ? l.dp / dpReplicate : l.dpShard, cp: l.cp, tp: l.tp };
}

/**
 * The ranks between neighbours of a group, from the mesh's order ([Note: mesh axes] in
 * mesh_axes.ts; tp is innermost, so its ranks are neighbours on one host). The data-parallel group
 * ('dp') and the shard group ('dpShard') take the cp ranks in ([Note: context parallelism]): they
 * span dp x cp (dpShard x cp) neighbouring blocks of tp ranks, so their innermost axis is cp.
 */
export function axisStride(l: PlanLayout, group: MeshAxis | 'dp'): number {
  return meshStride(planMeshDegrees(l), group === 'dp' || group === 'dpShard' ? 'cp' : group);
}

