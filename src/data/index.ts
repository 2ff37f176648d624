// Data: tokenizer, text sources, train/validation split, and the rank-aware resumable loader.
export { ByteTokenizer, type TokenArray } from './tokenizer.js';
export { MOBY_DICK, loadMobyDick, loadTextFile, loadCorpus, mobyDickDataDir } from './corpus.js';
export { splitTokens, loadTextDataset, type TokenSplit, type TextDataset } from './dataset.js';
export { DataLoader, sampleStream, type LoaderOptions, type LoaderState, type Batch } from './loader.js';
