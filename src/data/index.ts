// Data: tokenizers, text sources, prepared shards, the train/validation split, and the rank-aware
// resumable loader.
export { ByteTokenizer, Gpt2Tokenizer, JsonTokenizer, loadTokenizer, tokenizerIdentity, type Tokenizer, type TokenArray } from './tokenizer.js';
export { MOBY_DICK, loadMobyDick, loadTextFile, loadCorpus, mobyDickDataDir } from './corpus.js';
export { splitTokens, loadTextDataset, type TokenSplit, type TextDataset } from './dataset.js';
export { TokenCorpus, type SegmentSpec, type TokenDtype } from './corpus_files.js';
export { DataLoader, sampleStream, type LoaderOptions, type LoaderState, type ExampleState, type TrainLoader, type Batch } from './loader.js';
export { ExampleLoader, type ExampleLoaderOptions, type ExampleBatch } from './example_loader.js';
export { ExampleCorpus, type ExampleKind, type ExampleCorpusSpec } from './examples.js';
export { planEpoch, EpochStream, type PackOptions, type EpochPlan } from './packing.js';
export { Sampler, blendedSource, type LoaderSource, type Sample } from './sampler.js';
export { readManifest, openPrepared, openFlatBin, type Manifest, type ShardRecord } from './prepared.js';
export { prepare, PrepareError, type PrepareOptions, type PrepareResult } from './prepare.js';
export { loadTrainData, checkDataConfig, sourceKind, type DataSpec, type SourceEntry, type TrainData, type ExampleData } from './sources.js';
export { trainBpe, WordCounter } from './bpe_train.js';
