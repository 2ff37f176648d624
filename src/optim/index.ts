export { Optimizer, type ParamGroup } from './optimizer.js';
export { AdamW, type AdamWOptions } from './adamw.js';
export { SGD, type SGDOptions } from './sgd.js';
export { warmupCosine, constant } from './schedule.js';
