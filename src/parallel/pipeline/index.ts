// Pipeline parallelism: schedules as data (schedule.ts), stages (stage.ts), the executor
// (executor.ts) and the entry point a trainer calls (pipeline_parallel.ts).
export * from './schedule.js';
export { planStages, measureGPTPartCosts, Stage, type PartCosts, type SplitLinear } from './stage.js';
export { Executor, type MicroBatch, type TraceEvent } from './executor.js';
export { PipelineParallel, PipelineGrads, type PipelineOptions, type PipelineStepOptions } from './pipeline_parallel.js';
