// What only the planner uses of its terms. The terms every layout prices itself in (PlanAxis,
// RankBudget, PlanContext, axisStride, ...) live in src/distributed/plan_terms.ts ([Note: plan
// terms]), below every layer that declares an axis; this file adds the planner's own: the config
// fields an axis may claim, the collectives and probe runs calibration measures, and the budget the
// axes start from.
import type { ParallelConfig } from '../parallel/layout.js';
import type { TrainConfig } from '../config/schema.js';
import type { ScheduleName } from '../parallel/pipeline/schedule.js';
import { MEMORY_TERMS, type Collective, type InStepProbe, type MemoryTerm, type PlanContext, type PlanLayout, type RankBudget } from '../distributed/plan_terms.js';

/** The [parallel] fields and the two [train] fields and one [data] field a layout sets. */
export type PlanField = keyof ParallelConfig | 'microBatches' | 'activationCheckpoint' | 'precision';

/** Every collective calibration measures. */
export const COLLECTIVES: readonly Collective[] = ['allReduce', 'allGather', 'reduceScatter', 'sendRecv', 'allToAll'];

/** A probe run: an in-step probe, or 'dp', the probe model under plain data parallelism: the reference every probe is measured against. */
export type ProbeRunName = InStepProbe | 'dp';

// The price terms write the layout's choices out (they sit below src/parallel and src/config); the
// compiler holds them equal to the pipeline's schedules, the layout's accumulation flavours and the
// config's choices (a type error here means the lists have drifted apart).
type Same<A, B> = [A] extends [B] ? ([B] extends [A] ? true : false) : false;
export const TERMS_AGREE: [
  Same<PlanLayout['ppSchedule'], ScheduleName>, Same<PlanContext['accumulate'], ParallelConfig['accumulate']>, Same<PlanContext['reduceDtype'], ParallelConfig['reduceDtype']>,
  Same<PlanLayout['precision'], TrainConfig['precision']>, Same<PlanLayout['activationCheckpoint'], TrainConfig['activationCheckpoint']>,
] = [true, true, true, true, true];

/** An empty budget: the whole model on one rank, one micro-batch alive. */
export function wholeModel(ctx: PlanContext): RankBudget {
  const m = ctx.model;
  const l = ctx.layout;
  const memory = Object.fromEntries(MEMORY_TERMS.map((t) => [t, 0])) as Record<MemoryTerm, number>;
  const adapters = m.lora ? m.lora.embedAdapterParams + m.lora.headAdapterParams + m.lora.blockAdapterParams.reduce((a, b) => a + b, 0) : m.numParams;
  return {
    params: m.numParams, expertParams: m.blockExpertParams.reduce((a, b) => a + b, 0), frozenParams: m.numParams - adapters, blocks: m.blockParams.length, embed: true, head: true, blockShare: 1, activationShare: 1, blockActivationBytes: 0,
    samples: ctx.globalBatch / (l.dp * l.microBatches), tokens: ctx.seqLen, liveMicroBatches: 1, paramsHeld: 0, gradsHeld: 0, optimizerHeld: 0,
    memory, comm: [], notes: [],
  };
}
