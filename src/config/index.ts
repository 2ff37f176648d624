// The training job's config (src/config): schema, parsing, paths, validation.
export { configSchema, defaultConfig, type FlotillaConfig, type ModelConfig, type DataConfig, type OptimConfig, type TrainConfig, type CheckpointConfig, type LogConfig, type ParallelConfig } from './schema.js';
export { ConfigError } from './error.js';
export { parseConfig, loadConfig, parseOverrides, configToToml } from './parse.js';
export { validateConfig, checkRunnable } from './validate.js';
