export { GradBuffer, buildGradBuffers, gradView, type Bucket, type ParamSlot, type GradBufferOptions } from './grad_buffer.js';
export { DataParallel, type DataParallelOptions, type SyncRecord } from './data_parallel.js';
export { LocalGrads, gradNorm, clipGradNorm, type GradientSource, type GradShard, type ClipResult } from './grads.js';
