// The prepared-dataset format `flotilla prepare` writes and the loader reads.
//
//   DIR/manifest.json        what is below, written last (so a directory without it is unfinished)
//   DIR/shard_00000.bin      token ids, little-endian uint16 (vocabulary <= 65,536) or uint32;
//                            text (version 1): every document followed by the tokenizer's end-of-text id;
//                            examples (version 2, kind chat/completion/preference): the examples' ids
//                            back to back, nothing added (the template's or completion's own tokens
//                            end each example)
//   DIR/shard_00000.idx      little-endian uint64 token offsets of the document boundaries:
//                            0, end of document 0, end of document 1, ... (documents + 1 entries);
//                            an example is a document; a preference pair i is documents 2i (prompt +
//                            chosen) and 2i + 1 (prompt + rejected)
//   DIR/shard_00000.mask     examples only: the loss mask, 1 bit a token, least significant bit first,
//                            ceil(tokens / 8) bytes: bit k (byte k >> 3, bit k & 7) set = token k is a
//                            trained target (the loss counts the prediction of token k from those
//                            before it; the loader makes that y)
//   DIR/shard_00000.done.json  the shard's stats, written after its other files are durable;
//                            a re-run skips a shard whose done file matches its inputs
//
// Version 1 manifests (text) are still what text prepares write; version 2 adds kind, template,
// examples and skippedWhy (and a shard's mask). A nanoGPT-style flat `.bin` (uint16 ids, no header)
// is read directly as one segment.
import { existsSync, readFileSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { fileSha256 } from '../io/durable.js';
import { DTYPE_BYTES, type SegmentSpec, type TokenDtype } from './corpus_files.js';

export const MANIFEST = 'manifest.json';
export const FORMAT = 'flotilla-tokens';
/** The newest manifest version (example datasets); text datasets are written as TEXT_FORMAT_VERSION. */
export const FORMAT_VERSION = 2;
export const TEXT_FORMAT_VERSION = 1;

export interface TokenizerRecord {
  spec: string;
  name: string;
  vocabSize: number;
  eot: number;
  identity: string;
}

export interface ShardRecord {
  bin: string;
  idx: string;
  tokens: number;
  documents: number;
  /** Largest id in the shard (below tokenizer.vocabSize). */
  maxTokenId: number;
  binSha256: string;
  idxSha256: string;
  /** Identifies the inputs the shard was made from (file, size, mtime, range, tokenizer, field). */
  key: string;
  /** The input files it came from (for messages). */
  inputs: string[];
  /** Input lines or rows skipped as bad (--skip-bad). */
  skipped: number;
  /** Example kinds: the loss-mask file (1 bit a token, LSB first: token k is a trained target) and its hash. */
  mask?: string;
  maskSha256?: string;
  /** Example kinds: lines skipped, by reason (no assistant turn, ...). */
  skippedWhy?: Record<string, number>;
}

/** What the tokens of an example dataset are (absent: "text", every token trained). */
export type DatasetKind = 'text' | 'chat' | 'completion' | 'preference';

/** How chat examples were rendered: a run checks it against its own data.chatTemplate and data.trainOn. */
export interface TemplateRecord {
  source: string;
  /** SHA-256 of the template text with its bos and eos tokens. */
  identity: string;
  trainOn: 'assistant' | 'last' | 'all';
}

export interface Manifest {
  format: typeof FORMAT;
  version: number;
  tokenizer: TokenizerRecord;
  dtype: TokenDtype;
  tokens: number;
  documents: number;
  skipped: number;
  /** Hash of every shard key: equal keys mean the same inputs prepared the same way. */
  key: string;
  field: string;
  sources: string[];
  shards: ShardRecord[];
  created: string;
  /** Example datasets (version 2): their kind, template, examples (preference: pairs, two documents each) and skips by reason. */
  kind?: DatasetKind;
  template?: TemplateRecord;
  examples?: number;
  skippedWhy?: Record<string, number>;
}

/** The kinds whose shards carry a loss mask (version 2). */
export type ExampleKind = Exclude<DatasetKind, 'text'>;

export function isExampleKind(k: DatasetKind | undefined): k is ExampleKind {
  return k === 'chat' || k === 'completion' || k === 'preference';
}

/** Bytes of a mask file of `tokens` bits. */
export function maskBytes(tokens: number): number {
  return Math.ceil(tokens / 8);
}

export function shardName(i: number): string {
  return `shard_${String(i).padStart(5, '0')}`;
}


/** Reads and checks DIR/manifest.json; errors name the file and the fix. */
export function readManifest(dir: string): Manifest {
  const path = join(resolve(dir), MANIFEST);
  if (!existsSync(path)) {
    throw new Error(`${resolve(dir)} has no ${MANIFEST}: it is not a prepared dataset, or its \`flotilla prepare\` did not finish; run \`flotilla prepare ... --out ${dir}\``);
  }
  let m: Manifest;
  try {
    m = JSON.parse(readFileSync(path, 'utf8')) as Manifest;
  } catch (e) {
    throw new Error(`${path} is not valid JSON (${(e as Error).message}); run \`flotilla prepare\` again`);
  }
  if (m?.format !== FORMAT || !(m.version === TEXT_FORMAT_VERSION || m.version === FORMAT_VERSION) || !Array.isArray(m.shards) || !m.tokenizer || !(m.dtype in DTYPE_BYTES)) {
    throw new Error(`${path} is not a ${FORMAT} v${TEXT_FORMAT_VERSION} or v${FORMAT_VERSION} manifest; run \`flotilla prepare\` again`);
  }
  if (isExampleKind(m.kind) !== (m.version === FORMAT_VERSION) || (isExampleKind(m.kind) && m.shards.some((x) => typeof x.mask !== 'string'))) {
    throw new Error(`${path}: a version ${m.version} manifest of kind ${JSON.stringify(m.kind ?? 'text')}${isExampleKind(m.kind) ? ' must list every shard\'s .mask' : ''} is inconsistent; run \`flotilla prepare\` again`);
  }
  return m;
}

export interface OpenCheck {
  /** The run's tokenizer: the manifest must name the same one. */
  tokenizer?: { spec: string; identity: string; vocabSize: number };
  /** The model's vocabulary: every shard's largest id must lie below it. */
  vocabSize?: number;
  /** Verify this shard's checksums (reading it whole); sizes are always checked. */
  checksum?: (shardIndex: number) => boolean;
}

/** Segments of a prepared dataset, after checking sizes (always) and checksums (when asked); `masks`: each shard's .mask (example kinds). */
export function openPrepared(dir: string, check: OpenCheck = {}): { manifest: Manifest; segments: SegmentSpec[]; masks?: string[] } {
  const root = resolve(dir);
  const m = readManifest(root);
  const where = join(root, MANIFEST);
  if (check.tokenizer && m.tokenizer.identity !== check.tokenizer.identity) {
    throw new Error(
      `${where} was prepared with tokenizer ${m.tokenizer.spec} (${m.tokenizer.identity.slice(0, 19)}...), but this run uses ${check.tokenizer.spec} ` +
        `(${check.tokenizer.identity.slice(0, 19)}...); set data.tokenizer = ${JSON.stringify(m.tokenizer.spec)} or prepare the data again with --tokenizer ${check.tokenizer.spec}`,
    );
  }
  const width = DTYPE_BYTES[m.dtype];
  const segments: SegmentSpec[] = [];
  const masks: string[] = [];
  const examples = isExampleKind(m.kind);
  m.shards.forEach((s, i) => {
    const bin = join(root, s.bin);
    const idx = join(root, s.idx);
    const files: [string, number, string][] = [[bin, s.tokens * width, s.binSha256], [idx, (s.documents + 1) * 8, s.idxSha256]];
    if (examples) {
      const mask = join(root, s.mask!);
      files.push([mask, maskBytes(s.tokens), s.maskSha256 ?? '']);
      masks.push(mask);
    }
    for (const [p, bytes] of files) {
      if (!existsSync(p)) throw new Error(`${p} is missing (listed in ${where}); run \`flotilla prepare\` again to remake it`);
      const size = statSync(p).size;
      if (size !== bytes) throw new Error(`${p} has ${size} bytes but ${where} says ${bytes}: the shard is truncated or was changed; run \`flotilla prepare\` again`);
    }
    if (check.vocabSize !== undefined && s.maxTokenId >= check.vocabSize) {
      throw new Error(`${bin} holds token id ${s.maxTokenId}, at or above model.vocabSize = ${check.vocabSize}; raise model.vocabSize to ${m.tokenizer.vocabSize} (or leave it 0 to follow the tokenizer)`);
    }
    if (check.checksum?.(i)) {
      for (const [p, , want] of files) {
        const got = fileSha256(p);
        if (got !== want) throw new Error(`${p} does not match its checksum in ${where} (sha256 ${got.slice(0, 12)}..., expected ${want.slice(0, 12)}...): the file was changed or damaged; run \`flotilla prepare\` again`);
      }
    }
    segments.push({ kind: 'file', path: bin, dtype: m.dtype, lo: 0, hi: s.tokens, name: bin });
  });
  if (m.tokens === 0) throw new Error(`${where} lists no tokens; prepare a non-empty corpus`);
  return { manifest: m, segments, ...(examples ? { masks } : {}) };
}

/** What a run expects of a prepared dataset: its data.format, and for chat its resolved template and data.trainOn. */
export interface DatasetExpectation {
  format: DatasetKind;
  /** The run's chat template (data.chatTemplate resolved), when it has one. */
  template?: { source: string; identity: string };
  trainOn: TemplateRecord['trainOn'];
}

/**
 * Whether a prepared dataset is what the run's config says it reads: the kind against data.format,
 * and for chat the template against data.chatTemplate and the trained turns against data.trainOn
 * (the mask is fixed at prepare time). A preference dataset made with a template is checked against
 * the run's template when the run has one. The message names the field and the fix.
 */
export function datasetProblem(m: Manifest, dir: string, want: DatasetExpectation): string | undefined {
  const kind = m.kind ?? 'text';
  const where = resolve(dir);
  const again = (flag: string): string => `prepare it again with \`flotilla prepare ... --format ${want.format}${flag}\` (or name another directory)`;
  const wrongKind = kindProblem(kind, where, want.format);
  if (wrongKind !== undefined) return wrongKind;
  if (!isExampleKind(kind) || m.template === undefined) return undefined;
  if (kind === 'chat' && m.template.trainOn !== want.trainOn) {
    return `${where} was prepared with --train-on ${m.template.trainOn}, but data.trainOn = ${JSON.stringify(want.trainOn)} (the loss mask is made by prepare); set data.trainOn = ${JSON.stringify(m.template.trainOn)}, or ${again(` --train-on ${want.trainOn}`)}`;
  }
  if (want.template !== undefined && want.template.identity !== m.template.identity) {
    return `${where} was prepared with the chat template ${m.template.source} (${m.template.identity.slice(0, 19)}...), but data.chatTemplate gives ${want.template.source} ` +
      `(${want.template.identity.slice(0, 19)}...); set data.chatTemplate = ${JSON.stringify(m.template.source)}, or ${again(` --chat-template ${want.template.source}`)}`;
  }
  if (kind === 'chat' && want.template === undefined) {
    return `${where} was prepared with the chat template ${m.template.source}, and data.chatTemplate gives none to check it against; set data.chatTemplate = ${JSON.stringify(m.template.source)}`;
  }
  return undefined;
}

/** A prepared dataset of another kind than data.format: the message naming both fixes, else undefined. */
export function kindProblem(kind: DatasetKind, dir: string, format: DatasetKind): string | undefined {
  if (kind === format) return undefined;
  return `${resolve(dir)} holds ${kind} data (prepared with --format ${kind}), but data.format = ${JSON.stringify(format)}; set data.format = ${JSON.stringify(kind)}, or prepare it again with \`flotilla prepare ... --format ${format}\` (or name another directory)`;
}

// [Note: example dataset reader] What the example loader (src/data/examples.ts) reads of a version 2
// directory: per shard, the absolute .bin/.idx/.mask paths, the id dtype, its documents and tokens.
// Document d of a shard is tokens [idx[d], idx[d + 1]) of its .bin, and token k's trained bit is
// maskBit(mask, k). Preference pairs are documents 2i and 2i + 1 of a shard (a pair never spans
// shards). openExamples checks sizes always and checksums of the shards `check.checksum` names.

/** One shard of an example dataset. */
export interface ExampleShard {
  bin: string;
  idx: string;
  mask: string;
  dtype: TokenDtype;
  tokens: number;
  documents: number;
}

/** An example dataset (manifest version 2) opened for reading. */
export interface ExampleDataset {
  dir: string;
  manifest: Manifest;
  kind: ExampleKind;
  /** Examples; preference: pairs (two documents each). */
  examples: number;
  shards: ExampleShard[];
}

/** Opens a version 2 directory (sizes checked, checksums when asked); with `expect`, also datasetProblem. */
export function openExamples(dir: string, check: OpenCheck & { expect?: DatasetExpectation } = {}): ExampleDataset {
  const root = resolve(dir);
  const { manifest: m, masks } = openPrepared(root, check);
  if (check.expect) {
    const p = datasetProblem(m, root, check.expect);
    if (p !== undefined) throw new Error(p);
  }
  if (!isExampleKind(m.kind) || masks === undefined) {
    throw new Error(`${join(root, MANIFEST)} is a text dataset (no loss masks); prepare the examples with \`flotilla prepare ... --format chat|completion|preference\``);
  }
  const shards = m.shards.map((s, i) => ({ bin: join(root, s.bin), idx: join(root, s.idx), mask: masks[i]!, dtype: m.dtype, tokens: s.tokens, documents: s.documents }));
  return { dir: root, manifest: m, kind: m.kind, examples: m.examples ?? (m.kind === 'preference' ? m.documents / 2 : m.documents), shards };
}

/** A shard's document boundaries: documents + 1 token offsets (0, end of document 0, ...). */
export function readDocumentOffsets(idxPath: string): Float64Array {
  const b = readFileSync(idxPath);
  const out = new Float64Array(b.byteLength / 8);
  for (let i = 0; i < out.length; i++) out[i] = Number(b.readBigUInt64LE(i * 8));
  return out;
}

/** Whether token k of a shard is a trained target, given the shard's .mask bytes. */
export function maskBit(mask: Uint8Array, k: number): boolean {
  return ((mask[k >>> 3]! >>> (k & 7)) & 1) === 1;
}

/** A nanoGPT-style flat file of little-endian uint16 ids. */
export function openFlatBin(path: string): SegmentSpec {
  const p = resolve(path);
  if (!existsSync(p)) throw new Error(`token file ${p} does not exist; fix data.source / data.sources`);
  const size = statSync(p).size;
  if (size % 2 !== 0) throw new Error(`${p} has ${size} bytes, not a whole number of uint16 tokens: it is truncated or not a nanoGPT .bin`);
  if (size === 0) throw new Error(`${p} is empty`);
  return { kind: 'file', path: p, dtype: 'uint16', lo: 0, hi: size / 2, name: p };
}
