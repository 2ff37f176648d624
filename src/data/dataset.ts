// A token stream split into a training part and a held-out validation tail.
import { ByteTokenizer, type TokenArray } from './tokenizer.js';
import { loadCorpus } from './corpus.js';

export interface TokenSplit {
  train: TokenArray;
  val: TokenArray;
}

/**
 * Splits tokens into train (the head) and validation (the last `valFraction`). Both parts are views
 * (no copy). Each part must hold at least `minTokens` tokens (seqLen + 1 for next-token pairs).
 */
export function splitTokens(tokens: TokenArray, valFraction: number, minTokens = 2): TokenSplit {
  if (!(valFraction > 0 && valFraction < 1)) {
    throw new Error(`data.valFraction must be in (0, 1), got ${valFraction}`);
  }
  const nVal = Math.floor(tokens.length * valFraction);
  const nTrain = tokens.length - nVal;
  if (nTrain < minTokens || nVal < minTokens) {
    throw new Error(
      `the corpus has ${tokens.length} tokens: a ${1 - valFraction}/${valFraction} split leaves ${nTrain} for training and ` +
        `${nVal} for validation, and each needs at least ${minTokens} (data.seqLen + 1); use a longer text or a shorter data.seqLen`,
    );
  }
  return { train: tokens.subarray(0, nTrain), val: tokens.subarray(nTrain) };
}

export interface TextDataset {
  /** What data.source named ("moby-dick" or a file path). */
  source: string;
  vocabSize: number;
  tokens: TokenArray;
  train: TokenArray;
  val: TokenArray;
}

/** Reads a text source, tokenizes it bytewise and splits off the validation tail. */
export function loadTextDataset(o: { source: string; valFraction: number; seqLen: number }): TextDataset {
  const tok = new ByteTokenizer();
  const tokens = tok.encode(loadCorpus(o.source));
  const { train, val } = splitTokens(tokens, o.valFraction, o.seqLen + 1);
  return { source: o.source, vocabSize: tok.vocabSize, tokens, train, val };
}
