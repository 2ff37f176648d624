// The prepared-dataset format `flotilla prepare` writes and the loader reads.
//
//   DIR/manifest.json        what is below, written last (so a directory without it is unfinished)
//   DIR/shard_00000.bin      token ids, little-endian uint16 (vocabulary <= 65,536) or uint32,
//                            every document followed by the tokenizer's end-of-text id
//   DIR/shard_00000.idx      little-endian uint64 token offsets of the document boundaries:
//                            0, end of document 0, end of document 1, ... (documents + 1 entries)
//   DIR/shard_00000.done.json  the shard's stats, written after its .bin and .idx are durable;
//                            a re-run skips a shard whose done file matches its inputs
//
// A nanoGPT-style flat `.bin` (uint16 ids, no header) is read directly as one segment.
import { existsSync, readFileSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { fileSha256 } from '../io/durable.js';
import { DTYPE_BYTES, type SegmentSpec, type TokenDtype } from './corpus_files.js';

export const MANIFEST = 'manifest.json';
export const FORMAT = 'flotilla-tokens';
export const FORMAT_VERSION = 1;

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
  if (m?.format !== FORMAT || m.version !== FORMAT_VERSION || !Array.isArray(m.shards) || !m.tokenizer || !(m.dtype in DTYPE_BYTES)) {
    throw new Error(`${path} is not a ${FORMAT} v${FORMAT_VERSION} manifest; run \`flotilla prepare\` again`);
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

/** Segments of a prepared dataset, after checking sizes (always) and checksums (when asked). */
export function openPrepared(dir: string, check: OpenCheck = {}): { manifest: Manifest; segments: SegmentSpec[] } {
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
  m.shards.forEach((s, i) => {
    const bin = join(root, s.bin);
    const idx = join(root, s.idx);
    for (const [p, bytes] of [[bin, s.tokens * width], [idx, (s.documents + 1) * 8]] as const) {
      if (!existsSync(p)) throw new Error(`${p} is missing (listed in ${where}); run \`flotilla prepare\` again to remake it`);
      const size = statSync(p).size;
      if (size !== bytes) throw new Error(`${p} has ${size} bytes but ${where} says ${bytes}: the shard is truncated or was changed; run \`flotilla prepare\` again`);
    }
    if (check.vocabSize !== undefined && s.maxTokenId >= check.vocabSize) {
      throw new Error(`${bin} holds token id ${s.maxTokenId}, at or above model.vocabSize = ${check.vocabSize}; raise model.vocabSize to ${m.tokenizer.vocabSize} (or leave it 0 to follow the tokenizer)`);
    }
    if (check.checksum?.(i)) {
      for (const [p, want] of [[bin, s.binSha256], [idx, s.idxSha256]] as const) {
        const got = fileSha256(p);
        if (got !== want) throw new Error(`${p} does not match its checksum in ${where} (sha256 ${got.slice(0, 12)}..., expected ${want.slice(0, 12)}...): the file was changed or damaged; run \`flotilla prepare\` again`);
      }
    }
    segments.push({ kind: 'file', path: bin, dtype: m.dtype, lo: 0, hi: s.tokens, name: bin });
  });
  if (m.tokens === 0) throw new Error(`${where} lists no tokens; prepare a non-empty corpus`);
  return { manifest: m, segments };
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
