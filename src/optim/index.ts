export { Optimizer, type ParamGroup } from './optimizer.js';
export { AdamW, type AdamWOptions } from './adamw.js';
export { SGD, type SGDOptions } from './sgd.js';
export { warmupCosine, constant } from './schedule.js';
export { registerOptimizer, optimizerSpec, type OptimizerSpec, type OptimizerSettings, type OptimizerGroup } from './registry.js';
export { optimizerNames } from './names.js';
