// The layout axes the planner folds, in mesh order ([Note: plan terms] in
// src/distributed/plan_terms.ts): each is described beside its own code. The pipeline first (it
// chooses the rank's blocks), then the axes that split what a block does (tensor, context, expert),
// then data parallelism and ZeRO over what is left, then the step's policies.
import { pipelinePlanAxis } from '../parallel/pipeline/pipeline_parallel.js';
import { tensorParallelPlanAxis } from '../parallel/tensor_parallel/model.js';
import { contextParallelPlanAxis } from '../parallel/context_parallel/model.js';
import { expertParallelPlanAxis } from '../parallel/expert_parallel.js';
import { dataParallelPlanAxis } from '../parallel/data_parallel/data_parallel.js';
import { zero3PlanAxis } from '../parallel/data_parallel/fsdp.js';
import { precisionPlanAxis } from '../nn/precision.js';
import { activationCheckpointPlanAxis } from '../nn/checkpoint.js';
import type { PlanAxis } from '../distributed/plan_terms.js';
import type { PlanField } from './terms.js';

export const PLAN_AXES: readonly PlanAxis<PlanField>[] = [
  pipelinePlanAxis, tensorParallelPlanAxis, contextParallelPlanAxis, expertParallelPlanAxis, dataParallelPlanAxis, zero3PlanAxis, precisionPlanAxis, activationCheckpointPlanAxis,
];

/**
 * [parallel] fields that choose no layout: the collective backend (the planner measures the one the
 * config would use) and `auto` (the planner itself).
 */
export const PLANNER_FIELDS: readonly PlanField[] = ['backend', 'auto'];
