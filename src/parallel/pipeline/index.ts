// Pipeline parallelism: what a model gives a pipeline (model.ts), schedules as data (schedule.ts), stages (stage.ts), the executor
// (executor.ts) and the entry point a trainer calls (pipeline_parallel.ts).
export * from './schedule.js';
export { Stage, type SplitLinear } from './stage.js';
export { sequentialStages, evenSplitPoints, LayerRange, type PipelineModel, type TiedParameter, type SequentialOptions } from './model.js';
export { Executor, type TraceEvent } from './executor.js';
export { PipelineParallel, PipelineGrads, type PipelineOptions, type PipelineStepOptions } from './pipeline_parallel.js';
