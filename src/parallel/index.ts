export { GradBuffer, buildGradBuffers, gradView, shardRange, type Bucket, type ParamSlot, type GradBufferOptions } from './grad_buffer.js';
export { DataParallel, type DataParallelOptions, type SyncRecord, type MemoryReport, type ZeroStage, type AccumulateFlavour } from './data_parallel.js';
export { FsdpUnits, unitsByClass, unitsByPath, singleUnitWarning, type UnitPolicy, type ModuleClass, type PathPattern } from './fsdp.js';
export type { ParallelModel } from './parallel_model.js';
export { Reducer } from './reducer.js';
export { parallelize, buildMesh, resolveLayout, describeLayout, type Layout, type DataParallelMesh, type ParallelizeOptions } from './parallelize.js';
export { LocalGrads, gradNorm, clipGradNorm, type GradientSource, type GradShard, type ClipResult, type StepPiece } from './grads.js';
export * from './pipeline/index.js';
