// flotilla's public API: `import { GPT, DataParallel, initProcessGroup, ... } from 'flotilla'`.
export * from './tensor/index.js';
export * as nn from './nn/index.js';
export { Module, Linear, Embedding, LayerNorm, RMSNorm, Dropout, ModuleList, F, withKernels } from './nn/index.js';
export { GPT, defaultGPTConfig, type GPTConfig } from './models/gpt.js';
export { gptPipeline, gptTensorPlan, gptUnits, gptCriterion, planStages, measureGPTPartCosts, type GPTPipelineOptions, type PartCosts } from './models/gpt_parallel.js';
export * from './optim/index.js';
export * from './distributed/index.js';
export { runLauncher, parseRunArgs, RUN_USAGE, type RunOptions, type LauncherIO } from './cli/run.js';
export { UsageError, RunUsageError } from './cli/usage.js';
export * from './parallel/index.js';
export * from './data/index.js';
export { saveSafetensors, loadSafetensors } from './checkpoint/safetensors.js';
export { Checkpointer, loadCheckpoint, loadWeights, checkCheckpoint, type RankState, type RunInfo, type SaveReport } from './checkpoint/checkpoint.js';
export { resolveCheckpoint, listCheckpoints } from './checkpoint/format.js';
export { consolidate, exportCheckpoint } from './checkpoint/export.js';
export { CheckpointError, type CheckpointMeta } from './checkpoint/format.js';
export { loadPretrained, savePretrained, readHfDir, exportCheckpointHf, type Pretrained, type SaveHfOptions } from './checkpoint/hf.js';
export { train, type TrainOptions, type TrainSummary } from './train/trainer.js';
