export { GradBuffer, buildGradBuffers, gradView, shardRange, type Bucket, type ParamSlot, type GradBufferOptions } from './data_parallel/grad_buffer.js';
export { DataParallel, type DataParallelOptions, type SyncRecord, type MemoryReport, type ZeroStage, type AccumulateFlavour } from './data_parallel/data_parallel.js';
export { FsdpUnits, unitsByClass, unitsByPath, singleUnitWarning, type UnitPolicy, type ModuleClass, type PathPattern } from './data_parallel/fsdp.js';
export {
  asList, WrappedModel, IGNORE_INDEX, type ParallelModel, type MicroBatch, type StageValue, type LossFn, type Criterion, type StepResult, type SequenceTable,
} from './parallel_model.js';
export { tokenCriterion, meanCriterion, criterionOf, globalCount } from './loss_reduction.js';
export { Reducer } from './data_parallel/reducer.js';
export { parallelize, wrapDataParallel, dataParallelGroups, buildMesh, type LayoutMesh, type ParallelPlan } from './parallelize.js';
export { buildDataParallel, type DataParallelKnobs, type DataParallelGroups, type DataParallelSpec, type DataParallelWrappers } from './data_parallel/wrappers.js';
export { resolveLayout, layoutFor, describeLayout, defersInit, layoutProblems, resolveAccumulate, accumulateProblems, dataParallelDegree, LayoutError, type Layout, type LayoutRequest, type ParallelConfig } from './layout.js';
export { DataParallelModel } from './data_parallel/model.js';
export { LocalGrads, gradNorm, clipGradNorm, clipFactor, type GradientSource, type GradShard, type ClipResult, type StepPiece } from './grads.js';
export * from './pipeline/index.js';
export { placementsOf, wholeRuns, type ParamPlacement, type ElementRange, type PlacementOptions, type TpSlice, type Run } from './placement.js';
export * from './tensor_parallel/index.js';
export { ContextParallelModel, ringShard, sequenceChunks } from './context_parallel/model.js';
export { ringAttention, chunksOf } from './context_parallel/ring_attention.js';
