// Tokenizers: bytes (vocabulary 256, nothing to train or ship), GPT-2's BPE (its 50,257 ranks ship
// inside the npm package gpt-tokenizer, so nothing is fetched), and any Hugging Face tokenizer.json
// (read by @huggingface/tokenizers; `flotilla tokenizer train` writes one, src/data/bpe_train.ts).
//
// `loadTokenizer(spec)` is the one entry point: training, `flotilla prepare` and decoding samples all
// use it, and a prepared dataset records `tokenizer.identity` so a run refuses data made by another.
import { createHash } from 'node:crypto';
import { createRequire } from 'node:module';
import { existsSync, readFileSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { GPT2_SPLIT, bytesToUnicode } from './bpe_train.js';

/** Token ids as stored by datasets and loaders. */
export type TokenArray = Uint8Array | Uint16Array | Uint32Array | Int32Array;

/** What every tokenizer offers. */
export interface Tokenizer {
  /** "byte", "gpt2", or the absolute path of a tokenizer.json or of the Hugging Face directory holding it. */
  readonly spec: string;
  /** Short human name for messages. */
  readonly name: string;
  /** Ids lie in 0..vocabSize-1; the model's embedding must hold at least this many. */
  readonly vocabSize: number;
  /** The id written between documents by `flotilla prepare`. */
  readonly eot: number;
  /** A digest of everything that decides the ids (the merge table, the special tokens). */
  readonly identity: string;
  /** Ids of text; special-token strings in the text are ordinary text. */
  encode(text: string): ArrayLike<number>;
  /** Text of ids; a cut through a multi-byte character decodes to U+FFFD. */
  decode(ids: ArrayLike<number>): string;
}

/** Digest of a tokenizer's defining content, as recorded in a prepared dataset's manifest. */
function digest(...parts: (string | Buffer)[]): string {
  const h = createHash('sha256');
  for (const p of parts) h.update(p);
  return `sha256:${h.digest('hex')}`;
}

/**
 * Byte-level tokenizer: a token is one byte of the UTF-8 encoding, so the vocabulary is 256 and
 * every string round-trips. Prepared byte datasets separate documents with byte 0 (NUL), which
 * text does not use.
 */
export class ByteTokenizer implements Tokenizer {
  readonly spec = 'byte';
  readonly name = 'byte';
  /** Number of distinct ids (0..255). */
  readonly vocabSize = 256;
  readonly eot = 0;
  readonly identity = tokenizerIdentity('byte').identity;

  /** UTF-8 bytes of text, one id per byte. */
  encode(text: string): Uint8Array {
    const b = Buffer.from(text, 'utf8');
    return new Uint8Array(b.buffer, b.byteOffset, b.byteLength);
  }

  /** The same ids widened to int32 (for tensors and APIs that mix tokenizers). */
  encodeInt32(text: string): Int32Array {
    return Int32Array.from(this.encode(text));
  }

  /** Text from ids in 0..255. */
  decode(ids: ArrayLike<number>): string {
    let bytes: Uint8Array;
    if (ids instanceof Uint8Array) {
      bytes = ids;
    } else {
      bytes = new Uint8Array(ids.length);
      for (let i = 0; i < ids.length; i++) {
        const v = ids[i]!;
        if (!Number.isInteger(v) || v < 0 || v > 255) {
          throw new RangeError(`ByteTokenizer.decode: id ${v} at position ${i} is outside the byte vocabulary 0..255`);
        }
        bytes[i] = v;
      }
    }
    return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString('utf8');
  }
}

interface GptTokenizerModule {
  encode(text: string, opts?: { allowedSpecial?: Set<string>; disallowedSpecial?: Set<string> }): number[];
  decode(ids: Iterable<number>): string;
}

/** GPT-2's byte-level BPE (50,257 ids; <|endoftext|> = 50256), from the package's own ranks. */
export class Gpt2Tokenizer implements Tokenizer {
  readonly spec = 'gpt2';
  readonly name = 'gpt2';
  readonly vocabSize = 50257;
  readonly eot = 50256;
  readonly identity = tokenizerIdentity('gpt2').identity;
  private readonly ordinary = { allowedSpecial: new Set<string>(), disallowedSpecial: new Set<string>() };

  constructor(private readonly impl: GptTokenizerModule) {}

  encode(text: string): number[] {
    return this.impl.encode(text, this.ordinary);
  }

  decode(ids: ArrayLike<number>): string {
    return this.impl.decode(Array.from(ids));
  }
}

interface JsonShape {
  model?: { vocab?: unknown; type?: string };
  added_tokens?: AddedToken[];
  decoder?: unknown;
  normalizer?: unknown;
  pre_tokenizer?: unknown;
}

/** An entry of a tokenizer.json's added_tokens (special tokens and other strings matched whole). */
export interface AddedToken {
  id: number;
  content: string;
  lstrip?: boolean;
  rstrip?: boolean;
  special?: boolean;
}

/** Ids of a text whose added tokens are single ids, with the UTF-8 byte offset where each token starts. */
export interface EncodedWithOffsets {
  ids: number[];
  /** starts[k] = byte offset in the text's UTF-8 of token k's first byte (ascending). */
  starts: number[];
}

interface HfTokenizer {
  encode(text: string, opts?: { add_special_tokens?: boolean }): { ids: number[] };
  decode(ids: number[], opts?: { skip_special_tokens?: boolean }): string;
  token_to_id(token: string): number | undefined;
}

/** End-of-text tokens, by convention, in the order they are looked for in a tokenizer.json. */
const EOT_NAMES = ['<|endoftext|>', '</s>', '<eos>', '[SEP]', '<|end_of_text|>'];

/** A Hugging Face tokenizer.json (any model @huggingface/tokenizers reads: BPE, WordPiece, Unigram). */
export class JsonTokenizer implements Tokenizer {
  readonly name: string;
  readonly vocabSize: number;
  readonly eot: number;
  readonly identity: string;

  /** Whether encoding may go piece by piece through a cache (a plain GPT-2-style byte-level BPE). */
  private readonly byWord: boolean;
  private readonly cache = new Map<string, number[]>();
  private ranks: Map<string, number> | undefined;
  private vocab: Map<string, number> | undefined;
  private byteChar: string[] | undefined;
  /** The tokenizer.json's added tokens, longest content first (the order they are matched in). */
  readonly addedTokens: readonly AddedToken[];
  /** The vocabulary of a byte-level BPE (its strings are bytes through bytes_to_unicode), for token byte lengths. */
  private byteLevelVocab: Record<string, number> | undefined;
  private tokenByteLength: Map<number, number> | undefined;

  constructor(readonly spec: string, private readonly impl: HfTokenizer, json: JsonShape, bytes: Buffer) {
    this.name = spec;
    const pre = json.pre_tokenizer as { type?: string; add_prefix_space?: boolean; use_regex?: boolean } | null | undefined;
    const model = json.model as { type?: string; vocab?: Record<string, number>; merges?: (string | [string, string])[]; byte_fallback?: boolean; ignore_merges?: boolean } | undefined;
    this.byWord = (json.normalizer ?? null) === null && model?.type === 'BPE' && pre?.type === 'ByteLevel' && pre.add_prefix_space === false &&
      pre.use_regex !== false && !model.byte_fallback && !model.ignore_merges && Array.isArray(model.merges) && !Array.isArray(model.vocab);
    if (this.byWord) {
      this.ranks = new Map(model!.merges!.map((m, i) => [Array.isArray(m) ? `${m[0]} ${m[1]}` : m, i]));
      this.vocab = new Map(Object.entries(model!.vocab ?? {}));
      this.byteChar = bytesToUnicode();
    }
    this.vocabSize = jsonVocabSize(json);
    this.addedTokens = [...(json.added_tokens ?? [])].filter((t) => typeof t.content === 'string' && t.content.length > 0)
      .sort((a, b) => b.content.length - a.content.length);
    const decoder = json.decoder as { type?: string } | null | undefined;
    if (model?.type === 'BPE' && decoder?.type === 'ByteLevel' && !Array.isArray(model.vocab) && model.vocab) this.byteLevelVocab = model.vocab;
    const eot = EOT_NAMES.map((n) => impl.token_to_id(n)).find((id) => id !== undefined);
    if (eot === undefined) {
      throw new Error(`tokenizer ${spec} has no end-of-text token (one of ${EOT_NAMES.join(', ')}); add one to its added_tokens, or train one with \`flotilla tokenizer train\``);
    }
    this.eot = eot;
    this.identity = digest(bytes);
  }

  encode(text: string): number[] {
    if (!this.byWord) return this.impl.encode(text, { add_special_tokens: false }).ids;
    // GPT-2-style byte-level BPE: the library splits text with the same regex and applies the merges
    // to every piece on its own, so applying them here, once per distinct piece, gives the same ids
    // (special-token strings in text stay ordinary text, as with "gpt2"), many times faster.
    const out: number[] = [];
    for (const m of text.matchAll(GPT2_SPLIT)) {
      const w = m[0];
      let ids = this.cache.get(w);
      if (ids === undefined) {
        ids = this.bpeWord(w);
        if (this.cache.size >= 200_000) this.cache.clear();
        this.cache.set(w, ids);
      }
      for (const id of ids) out.push(id);
    }
    return out;
  }

  /**
   * Ids of text in which every added token (special tokens such as <|im_start|>, <|eot_id|>, </s>) is
   * matched whole and becomes its single id, as Hugging Face tokenizers do (and as transformers'
   * apply_chat_template(tokenize=True) encodes a rendered conversation). The text between added tokens
   * is encoded as ordinary text. `encode` keeps treating those strings as text, so plain-text datasets
   * cannot smuggle control tokens in.
   */
  encodeWithSpecials(text: string): number[] {
    return this.encodeWithOffsets(text).ids;
  }

  /**
   * `encodeWithSpecials` plus the UTF-8 byte offset of each token's first byte. Needs a byte-level
   * BPE (GPT-2, Llama 3, Qwen and flotilla's own tokenizers), whose tokens are exact byte strings.
   * An added token with lstrip/rstrip absorbs the whitespace beside it, as the library does.
   */
  encodeWithOffsets(text: string): EncodedWithOffsets {
    const lengths = this.byteLengths();
    if (!lengths) {
      throw new Error(`tokenizer ${this.spec} is not a byte-level BPE, so token byte offsets (needed for chat loss masks) are not exact; use a byte-level BPE tokenizer.json (GPT-2, Llama 3, Qwen or \`flotilla tokenizer train\`)`);
    }
    const ids: number[] = [];
    const starts: number[] = [];
    let byte = 0;
    const plain = (piece: string): void => {
      if (piece.length === 0) return;
      for (const id of this.encode(piece)) {
        const n = lengths.get(id);
        if (n === undefined) throw new Error(`tokenizer ${this.spec}: id ${id} has no byte string`);
        ids.push(id);
        starts.push(byte);
        byte += n;
      }
    };
    const firsts = new Set(this.addedTokens.map((t) => t.content[0]!));
    let from = 0; // start of the text not yet encoded
    let at = 0;
    while (at < text.length) {
      let hit: AddedToken | undefined;
      if (firsts.has(text[at]!)) for (const t of this.addedTokens) {
        if (text.startsWith(t.content, at)) {
          hit = t;
          break;
        }
      }
      if (!hit) {
        at++;
        continue;
      }
      let left = at;
      if (hit.lstrip) while (left > from && /\s/.test(text[left - 1]!)) left--;
      let right = at + hit.content.length;
      if (hit.rstrip) while (right < text.length && /\s/.test(text[right]!)) right++;
      plain(text.slice(from, left));
      ids.push(hit.id);
      starts.push(byte);
      byte += Buffer.byteLength(text.slice(left, right), 'utf8');
      from = at = right;
    }
    plain(text.slice(from));
    if (byte !== Buffer.byteLength(text, 'utf8')) {
      throw new Error(`tokenizer ${this.spec}: the tokens of a text cover ${byte} bytes but the text has ${Buffer.byteLength(text, 'utf8')} (a normalizer changes the text?), so loss-mask offsets would be wrong`);
    }
    return { ids, starts };
  }

  /** Byte length of every id (vocabulary and added tokens), built on first use; undefined unless byte-level. */
  private byteLengths(): Map<number, number> | undefined {
    if (this.tokenByteLength || !this.byteLevelVocab) return this.tokenByteLength;
    const unicodeByte = new Map(bytesToUnicode().map((c, b) => [c, b]));
    const lengths = new Map<number, number>();
    for (const [str, id] of Object.entries(this.byteLevelVocab)) {
      let n = 0;
      for (const ch of str) n += unicodeByte.has(ch) ? 1 : Buffer.byteLength(ch, 'utf8');
      lengths.set(id, n);
    }
    for (const t of this.addedTokens) lengths.set(t.id, Buffer.byteLength(t.content, 'utf8'));
    return (this.tokenByteLength = lengths);
  }

  /** The library's ids of the whole text (the reference the fast path must equal). */
  encodeReference(text: string): number[] {
    return this.impl.encode(text, { add_special_tokens: false }).ids;
  }

  /** GPT-2's bpe(): merge the lowest-ranked adjacent pair until none of the pairs is a merge. */
  private bpeWord(w: string): number[] {
    let parts = Array.from(Buffer.from(w, 'utf8'), (b) => this.byteChar![b]!);
    while (parts.length > 1) {
      let best = Infinity;
      let at = -1;
      for (let i = 0; i + 1 < parts.length; i++) {
        const r = this.ranks!.get(`${parts[i]} ${parts[i + 1]}`);
        if (r !== undefined && r < best) {
          best = r;
          at = i;
        }
      }
      if (at < 0) break;
      const a = parts[at]!;
      const b = parts[at + 1]!;
      const next: string[] = [];
      for (let i = 0; i < parts.length; i++) {
        if (i + 1 < parts.length && parts[i] === a && parts[i + 1] === b) {
          next.push(a + b);
          i++;
        } else {
          next.push(parts[i]!);
        }
      }
      parts = next;
    }
    return parts.map((p) => {
      const id = this.vocab!.get(p);
      if (id === undefined) throw new Error(`tokenizer ${this.spec}: the merged piece ${JSON.stringify(p)} is not in its vocabulary`);
      return id;
    });
  }

  decode(ids: ArrayLike<number>): string {
    if (ids.length === 0) return ''; // the library refuses an empty list
    return this.impl.decode(Array.from(ids), { skip_special_tokens: false });
  }
}

/** Ids a tokenizer.json can produce: its model's vocabulary and its added tokens. */
function jsonVocabSize(json: { model?: { vocab?: unknown }; added_tokens?: { id: number }[] }): number {
  let maxId = -1;
  const vocab = json.model?.vocab;
  if (Array.isArray(vocab)) maxId = vocab.length - 1; // Unigram: [token, score] pairs
  else if (vocab && typeof vocab === 'object') for (const v of Object.values(vocab as Record<string, number>)) if (v > maxId) maxId = v;
  for (const t of json.added_tokens ?? []) if (t.id > maxId) maxId = t.id;
  return maxId + 1;
}

/** What identifies a tokenizer, without loading its implementation (config checks run this). */
export interface TokenizerIdentity {
  spec: string;
  vocabSize: number;
  identity: string;
}

/** The identity of a `data.tokenizer` value, synchronously; throws naming the fix. */
export function tokenizerIdentity(spec: string): TokenizerIdentity {
  if (spec === 'byte') return { spec, vocabSize: 256, identity: digest('flotilla byte tokenizer v1') };
  if (spec === 'gpt2') return { spec, vocabSize: 50257, identity: digest('gpt2 r50k_base (gpt-tokenizer)') };
  const path = tokenizerFile(spec);
  const bytes = readFileSync(path);
  let json: { model?: { vocab?: unknown }; added_tokens?: { id: number }[] };
  try {
    json = JSON.parse(bytes.toString('utf8')) as typeof json;
  } catch (e) {
    throw new Error(`tokenizer ${path} is not JSON (${(e as Error).message}); pass a Hugging Face tokenizer.json`);
  }
  if (json === null || typeof json !== 'object' || typeof json.model !== 'object' || json.model === null) {
    throw new Error(`tokenizer ${path} has no "model" table, so it is not a Hugging Face tokenizer.json`);
  }
  return { spec: hfTokenizerDir(spec) ?? path, vocabSize: jsonVocabSize(json), identity: digest(bytes) };
}

/**
 * The Hugging Face directory a tokenizer spec names (absolute), when it names one: a directory holding
 * tokenizer.json (and, for chat templates and bos/eos, tokenizer_config.json).
 */
export function hfTokenizerDir(spec: string): string | undefined {
  if (spec === 'byte' || spec === 'gpt2') return undefined;
  const p = resolve(spec);
  return existsSync(p) && statSync(p).isDirectory() && existsSync(join(p, 'tokenizer.json')) ? p : undefined;
}

/** The tokenizer.json a file-or-directory spec names; throws naming the fix. */
function tokenizerFile(spec: string): string {
  const path = resolve(spec);
  if (existsSync(path) && statSync(path).isDirectory()) {
    const file = join(path, 'tokenizer.json');
    if (!existsSync(file)) throw new Error(`tokenizer ${JSON.stringify(spec)}: the directory ${path} has no tokenizer.json; name a Hugging Face model directory or a tokenizer.json file`);
    return file;
  }
  if (!existsSync(path) || !statSync(path).isFile()) {
    throw new Error(`tokenizer ${JSON.stringify(spec)}: no such file ${path}; use "byte", "gpt2" or the path of a tokenizer.json (make one with \`flotilla tokenizer train\`), or a Hugging Face directory holding one`);
  }
  return path;
}

const require = createRequire(import.meta.url);

/**
 * The tokenizer a `data.tokenizer` / `--tokenizer` value names: "byte", "gpt2", the path of a
 * tokenizer.json, or a Hugging Face directory holding one. Errors name the value and the fix.
 */
export async function loadTokenizer(spec: string): Promise<Tokenizer> {
  if (spec === 'byte') return new ByteTokenizer();
  if (spec === 'gpt2') {
    let mod: GptTokenizerModule;
    try {
      mod = (await import('gpt-tokenizer/encoding/r50k_base')) as unknown as GptTokenizerModule;
    } catch {
      throw new Error('tokenizer "gpt2" needs the npm package gpt-tokenizer; run `npm install` in the flotilla checkout');
    }
    return new Gpt2Tokenizer(mod);
  }
  const path = tokenizerFile(spec);
  const bytes = readFileSync(path);
  let json: Record<string, unknown>;
  try {
    json = JSON.parse(bytes.toString('utf8')) as Record<string, unknown>;
  } catch (e) {
    throw new Error(`tokenizer ${path} is not JSON (${(e as Error).message}); pass a Hugging Face tokenizer.json`);
  }
  if (json === null || typeof json !== 'object' || typeof json.model !== 'object' || json.model === null) {
    throw new Error(`tokenizer ${path} has no "model" table, so it is not a Hugging Face tokenizer.json`);
  }
  const { Tokenizer: HfTokenizerClass } = require('@huggingface/tokenizers') as { Tokenizer: new (t: object, c: object) => HfTokenizer };
  let impl: HfTokenizer;
  try {
    impl = new HfTokenizerClass(json, {});
  } catch (e) {
    throw new Error(`tokenizer ${path} cannot be loaded by @huggingface/tokenizers: ${(e as Error).message}`);
  }
  // A directory keeps its own path as the spec: it is also where the chat template and bos/eos live.
  return new JsonTokenizer(hfTokenizerDir(spec) ?? path, impl, json as JsonShape, bytes);
}
