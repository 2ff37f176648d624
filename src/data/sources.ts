// What `[data]` names, turned into the loader's weighted corpora (data.format = "text") or example
// corpora (chat, completion, preference: prepared directories, src/data/examples.ts): the demo corpus, a UTF-8 text file
// (tokenized in memory at start; token_cache.ts keeps the ids between runs), a prepared dataset
// directory (`flotilla prepare`, read by byte range) or a nanoGPT-style flat uint16 `.bin`. The checks that need no tokenizing (paths, manifests,
// the tokenizer's identity, shard sizes, the vocabulary) run in checkDataConfig, before any rank
// starts; checksums are verified by the ranks as they open the data, each rank a share of the shards.
import { createHash } from 'node:crypto';
import { existsSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { MOBY_DICK, loadCorpus } from './corpus.js';
import { TokenCorpus, type SegmentSpec } from './corpus_files.js';
import { MANIFEST, kindProblem, openExamples, openFlatBin, openPrepared, readManifest } from './prepared.js';
import { ExampleCorpus, exampleCorpusSpec, type ExampleKind } from './examples.js';
import { cachedTokens } from './token_cache.js';
import type { LoaderSource } from './sampler.js';
import { loadTokenizer, tokenizerIdentity, type Tokenizer, type TokenizerIdentity } from './tokenizer.js';

/** One entry of `data.sources`. */
export interface SourceEntry {
  path: string;
  weight: number;
}

/** The `[data]` fields this module reads. */
export interface DataSpec {
  source: string;
  sources: SourceEntry[];
  tokenizer: string;
  valSource: string;
  valFraction: number;
  seqLen: number;
  /** "text" (the default), or the kind of example every source holds. */
  format?: 'text' | ExampleKind;
}

export type SourceKind = 'moby-dick' | 'text' | 'prepared' | 'bin';

/** How a source path is read: by what it is on disk. */
export function sourceKind(path: string): SourceKind {
  if (path === MOBY_DICK) return 'moby-dick';
  const p = resolve(path);
  if (existsSync(p) && statSync(p).isDirectory()) return 'prepared';
  if (p.endsWith('.bin')) return 'bin';
  return 'text';
}

/** The training sources: data.sources when given, else data.source with weight 1. */
function trainEntries(d: DataSpec): SourceEntry[] {
  return d.sources.length > 0 ? d.sources : [{ path: d.source, weight: 1 }];
}

/** The model's vocabulary: model.vocabSize, or the tokenizer's when it is 0. */
function resolveVocabSize(modelVocab: number, tok: TokenizerIdentity): number {
  return modelVocab > 0 ? modelVocab : tok.vocabSize;
}

function checkEntry(e: SourceEntry, what: string, tok: TokenizerIdentity, vocabSize: number, format: 'text' | ExampleKind): string | undefined {
  if (!(Number.isFinite(e.weight) && e.weight > 0)) return `${what}: the weight of ${e.path} must be a positive number, got ${e.weight}`;
  const kind = sourceKind(e.path);
  if (format !== 'text') {
    if (e.weight !== 1) return `${what}: data.format = "${format}" concatenates its sources (each example read once an epoch); the weight of ${e.path} is ${e.weight}: give every source weight 1`;
    // Checked here: that the path exists, and a prepared directory of the run's kind (sizes, tokenizer).
    // A .jsonl of examples (prepared into the cache before the ranks start), another file,
    // "moby-dick", and a directory of another kind, template or trainOn are example_source.ts's
    // checks (exampleDataProblems), reported there once.
    const abs = resolve(e.path);
    if (kind === 'moby-dick' || (kind === 'text' && e.path.toLowerCase().endsWith('.jsonl'))) return undefined;
    if (!existsSync(abs)) {
      return `${what}: ${abs} does not exist; name a .jsonl file of examples (one JSON object a line) or a directory made by \`flotilla prepare ... --format ${format}\``;
    }
    if (kind !== 'prepared') return undefined;
    try {
      if (existsSync(join(abs, MANIFEST)) && (readManifest(abs).kind ?? 'text') !== format) return undefined;
      openExamples(abs, { tokenizer: tok, vocabSize });
    } catch (err) {
      return `${what}: ${(err as Error).message}`;
    }
    return undefined;
  }
  if (kind === 'moby-dick') return undefined;
  const abs = resolve(e.path);
  if (!existsSync(abs)) return `${what}: ${kind === 'text' ? 'text file ' : ''}${abs} does not exist; name "moby-dick", an existing text file, a prepared directory (flotilla prepare) or a nanoGPT .bin`;
  try {
    if (kind === 'prepared') {
      if (!existsSync(join(abs, MANIFEST))) {
        return `${what}: ${abs} is a directory without ${MANIFEST}; prepare it with \`flotilla prepare SOURCES... --tokenizer ${tok.spec} --out ${e.path}\``;
      }
      openPrepared(abs, { tokenizer: tok, vocabSize });
    } else if (kind === 'bin') {
      openFlatBin(abs);
    } else if (!statSync(abs).isFile()) {
      return `${what}: ${abs} is not a file`;
    }
  } catch (err) {
    return `${what}: ${(err as Error).message}`;
  }
  return undefined;
}

/**
 * Problems with the data config that cost no tokenizing: the tokenizer, model.vocabSize against it,
 * every source and the validation source. `modelVocab` is model.vocabSize (0 = the tokenizer's).
 */
export function checkDataConfig(d: DataSpec, modelVocab: number): string[] {
  let tok: TokenizerIdentity;
  try {
    tok = tokenizerIdentity(d.tokenizer);
  } catch (e) {
    return [`data.tokenizer: ${(e as Error).message}`];
  }
  const p: string[] = [];
  if (modelVocab > 0 && modelVocab < tok.vocabSize) {
    p.push(`model.vocabSize = ${modelVocab} is below the ${tok.vocabSize} ids of data.tokenizer = ${JSON.stringify(d.tokenizer)}; set model.vocabSize = 0 (follow the tokenizer) or >= ${tok.vocabSize}`);
  }
  const vocab = resolveVocabSize(modelVocab, tok);
  const entries = trainEntries(d);
  entries.forEach((e) => {
    const problem = checkEntry(e, d.sources.length > 0 ? 'data.sources' : 'data.source', tok, vocab, d.format ?? 'text');
    if (problem) p.push(problem);
  });
  if (d.valSource !== '') {
    const problem = checkEntry({ path: d.valSource, weight: 1 }, 'data.valSource', tok, vocab, d.format ?? 'text');
    if (problem) p.push(problem);
  }
  return p;
}

/** Example corpora (data.format other than "text"): training and validation units, and what identifies them. */
export interface ExampleData {
  train: ExampleCorpus[];
  val: ExampleCorpus[];
  /** Identity of the training units (the prepared datasets' keys and the units taken): a resume checks it. */
  datasetKey: string;
  /** The tokenizer's end-of-text id: padding. */
  padId: number;
}

export interface TrainData {
  tokenizer: Tokenizer;
  vocabSize: number;
  /** Text: weighted corpora (empty for examples). */
  train: LoaderSource[];
  val: LoaderSource[];
  /** Examples (data.format other than "text"). */
  examples?: ExampleData;
  /** One line for the run's [data] header. */
  describe: string;
  close(): void;
}

interface Opened {
  corpus: TokenCorpus;
  label: string;
}

/** Opens one source as a corpus. Checksums: shard i is verified when verify(i) says so. */
function openSource(path: string, tok: Tokenizer, vocabSize: number, verify: (i: number) => boolean): Opened {
  const kind = sourceKind(path);
  if (kind === 'prepared') {
    const { manifest, segments } = openPrepared(path, { tokenizer: tok, vocabSize, checksum: verify });
    return { corpus: new TokenCorpus(segments, { name: resolve(path), vocabSize }), label: `${path} (${manifest.shards.length} shard(s), ${manifest.documents.toLocaleString('en-US')} documents)` };
  }
  if (kind === 'bin') {
    const seg = openFlatBin(path);
    return { corpus: new TokenCorpus([seg], { name: seg.name, vocabSize }), label: `${path} (nanoGPT uint16 .bin)` };
  }
  const text = loadCorpus(path);
  // Bytes cost nothing to tokenize; a BPE pass over the demo corpus costs each rank about a second.
  const tokens = tok.spec === 'byte'
    ? Uint16Array.from(tok.encode(text))
    : cachedTokens(text, tok.identity, vocabSize > 65536, () => tok.encode(text));
  const spec: SegmentSpec = { kind: 'memory', tokens, lo: 0, hi: tokens.length, name: kind === 'moby-dick' ? MOBY_DICK : resolve(path) };
  return { corpus: new TokenCorpus([spec], { name: spec.name, vocabSize }), label: kind === 'moby-dick' ? MOBY_DICK : path };
}

/**
 * The run's tokenizer and corpora. Validation reads data.valSource when given, else the last
 * data.valFraction of every training source. Rank r of w verifies the checksums of shards
 * r, r + w, ... of each prepared source (so together the ranks check every shard once).
 */
export async function loadTrainData(d: DataSpec, o: { modelVocab: number; rank?: number; worldSize?: number }): Promise<TrainData> {
  const tok = await loadTokenizer(d.tokenizer);
  const vocabSize = resolveVocabSize(o.modelVocab, tok);
  if (vocabSize < tok.vocabSize) throw new Error(`model.vocabSize = ${vocabSize} is below the ${tok.vocabSize} ids of data.tokenizer = ${JSON.stringify(d.tokenizer)}`);
  const rank = o.rank ?? 0;
  const world = o.worldSize ?? 1;
  const verify = (i: number) => i % world === rank;
  if ((d.format ?? 'text') !== 'text') return loadExampleData(d, tok, vocabSize, verify);
  const opened: Opened[] = [];
  const closeAll = () => opened.forEach((x) => x.corpus.close());
  try {
    const entries = trainEntries(d);
    const train: LoaderSource[] = [];
    const val: LoaderSource[] = [];
    const labels: string[] = [];
    for (const e of entries) {
      const src = openSource(e.path, tok, vocabSize, verify);
      opened.push(src);
      if (d.valSource === '') {
        const { head, tail } = src.corpus.split(d.valFraction, d.seqLen + 1);
        opened.push({ corpus: head, label: '' }, { corpus: tail, label: '' });
        train.push({ corpus: head, weight: e.weight });
        val.push({ corpus: tail, weight: e.weight });
      } else {
        train.push({ corpus: src.corpus, weight: e.weight });
      }
      labels.push(entries.length > 1 ? `${src.label} x ${e.weight}` : src.label);
    }
    if (d.valSource !== '') {
      const v = openSource(d.valSource, tok, vocabSize, verify);
      opened.push(v);
      val.push({ corpus: v.corpus, weight: 1 });
    }
    const count = (xs: LoaderSource[]) => xs.reduce((a, s) => a + s.corpus.length, 0).toLocaleString('en-US');
    const describe = `${labels.join(' + ')}: ${tok.name} tokens (vocabulary ${tok.vocabSize}${vocabSize !== tok.vocabSize ? `, model ${vocabSize}` : ''}), ` +
      `train ${count(train)}, val ${count(val)}${d.valSource !== '' ? ` from ${d.valSource}` : ''}`;
    return { tokenizer: tok, vocabSize, train, val, describe, close: closeAll };
  } catch (e) {
    closeAll();
    throw e;
  }
}

/**
 * Example corpora: every source's units concatenated (in data.sources' order) for training; validation
 * is data.valSource, or the last data.valFraction of each source's units (in order, not shuffled).
 */
function loadExampleData(d: DataSpec, tok: Tokenizer, vocabSize: number, verify: (i: number) => boolean): TrainData {
  const format = d.format as ExampleKind;
  const opened: ExampleCorpus[] = [];
  const closeAll = () => opened.forEach((c) => c.close());
  const open = (path: string): { corpus: ExampleCorpus; key: string; label: string } => {
    const dir = resolve(path);
    const { manifest, shards, kind } = openExamples(dir, { tokenizer: tok, vocabSize, checksum: verify });
    // The run's checks refused another kind before any rank started (exampleDataProblems); a caller of loadTrainData gets the same message.
    const wrong = kindProblem(kind, dir, format);
    if (wrong !== undefined) throw new Error(wrong);
    const corpus = new ExampleCorpus(exampleCorpusSpec({ name: dir, kind: format, shards, vocabSize }));
    opened.push(corpus);
    return { corpus, key: manifest.key, label: `${path} (${manifest.shards.length} shard(s), ${corpus.units.toLocaleString('en-US')} ${format === 'preference' ? 'pairs' : 'examples'})` };
  };
  try {
    const train: ExampleCorpus[] = [];
    const val: ExampleCorpus[] = [];
    const ident: unknown[] = [];
    const labels: string[] = [];
    for (const e of trainEntries(d)) {
      const src = open(e.path);
      labels.push(src.label);
      if (d.valSource === '') {
        const { head, tail } = src.corpus.split(d.valFraction);
        train.push(head);
        val.push(tail);
      } else {
        train.push(src.corpus);
      }
      ident.push([src.key, train.at(-1)!.spec.lo, train.at(-1)!.spec.hi]);
    }
    if (d.valSource !== '') val.push(open(d.valSource).corpus);
    const datasetKey = createHash('sha256').update(JSON.stringify(ident)).digest('hex');
    const count = (xs: ExampleCorpus[]) => xs.reduce((a, c) => a + c.units, 0).toLocaleString('en-US');
    const describe = `${labels.join(' + ')}: ${format}, ${tok.name} tokens (vocabulary ${tok.vocabSize}${vocabSize !== tok.vocabSize ? `, model ${vocabSize}` : ''}), ` +
      `train ${count(train)}, val ${count(val)}${d.valSource !== '' ? ` from ${d.valSource}` : ''}`;
    return { tokenizer: tok, vocabSize, train: [], val: [], examples: { train, val, datasetKey, padId: tok.eot }, describe, close: closeAll };
  } catch (e) {
    closeAll();
    throw e;
  }
}
