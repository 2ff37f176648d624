export { Module, deferParameters, type Parameter, type DeferredInit } from './module.js';
export { Linear, Embedding, LayerNorm, RMSNorm, Dropout, ModuleList } from './layers.js';
export { CausalSelfAttention, MLP, Block, type BlockConfig } from './transformer.js';
export * as F from './functional.js';
export { withSequenceShard, sequenceShard, tokenPositions, type SequenceShard } from './sequence_shard.js';
export { normal_, zeros_, ones_ } from './init.js';
export { autocast, castFor, castParam, currentPrecision, opDtype, parsePrecision, BF16_MIXED_OPS, PRECISIONS, type Precision, type OpClass } from './precision.js';
export { LoraAdapter, applyLora, hfModuleNames, loraAdapterOf, loraAdapters, mergeLora, unmergeLora, withAdaptersDisabled, type LoraOptions, type ApplyLoraOptions, type AppliedLora } from './lora.js';
export { documentLayout, withDocuments, documents, type DocumentLayout } from './documents.js';
