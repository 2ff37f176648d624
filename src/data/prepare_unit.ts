// One unit of `flotilla prepare` (src/data/prepare.ts): tokenizes a group of text files, a line
// range of a .jsonl file or a row range of a parquet file into one shard. Runs in a worker thread.
//
// Durability: the shard is written as .tmp files, fsync'd, renamed, and only then is its .done.json
// written (also through a fsync'd temp file). A shard without a matching .done.json is never reused,
// and the loader reads only what manifest.json (written last) lists.
//
// Example formats (chat, completion, preference; ctx.example): each .jsonl line is one example (a
// pair of documents for preference) tokenized by src/data/chat, written with no end-of-text added,
// and its trained bits go to the shard's .mask (format in src/data/prepared.ts).
import { createHash } from 'node:crypto';
import { closeSync, fsyncSync, openSync, readFileSync, readSync, renameSync, writeSync, unlinkSync, existsSync } from 'node:fs';
import { basename, dirname } from 'node:path';
import { fsyncDir, writeDurable, writeSynced } from '../io/durable.js';
import { loadTokenizer, type Tokenizer } from './tokenizer.js';
import type { TokenDtype } from './corpus_files.js';
import type { ShardRecord } from './prepared.js';
import {
  ChatDataError, ChatTemplateError, loadChatTemplate, parseExampleLine, tokenizeChat, tokenizeCompletion, tokenizePreference,
  type ChatTemplate, type ExampleFormat, type TokenizedExample, type TrainOn,
} from './chat/index.js';

export type Unit =
  | { kind: 'text'; files: string[]; bytes: number }
  | { kind: 'jsonl'; file: string; start: number; end: number; firstLine: number; bytes: number }
  | { kind: 'parquet'; file: string; rowStart: number; rowEnd: number; bytes: number };

export interface UnitJob {
  index: number;
  unit: Unit;
  key: string;
  /** Absolute path and name stem of the shard: OUT/shard_00000. */
  stem: string;
}

export interface UnitContext {
  tokenizer: string;
  dtype: TokenDtype;
  field: string;
  skipBad: boolean;
  /** How a bad example line's error ends (default: fix it or pass `flotilla prepare`'s --skip-bad). */
  badLineHint?: string;
  /** Example formats: how a line becomes ids and trained bits (absent: text). */
  example?: ExampleContext;
}

/** How `flotilla prepare --format chat|completion|preference` tokenizes a line. */
export interface ExampleContext {
  format: ExampleFormat;
  /** The chat template: "model", "chatml" or an absolute .jinja path (chat; preference when it has one). */
  template?: string;
  /** The Hugging Face directory the tokenizer came from (the "model" template, bos/eos). */
  tokenizerDir?: string;
  trainOn: TrainOn;
  /** A conversation with no assistant turn is an error, not a skip. */
  strict: boolean;
  /** Completion examples: the bos to start with (when the tokenizer adds one) and the eos to end with. */
  bos?: string;
  eos?: string;
}

/** Why example lines are skipped (ShardRecord.skippedWhy keys). */
export const SKIP_NO_ASSISTANT = 'no assistant turn';
export const SKIP_BAD_LINE = 'bad line (--skip-bad)';

/** A bad input found while tokenizing: the message names the file (and line). */
export class BadInputError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'BadInputError';
  }
}

/** Appends token ids to a temp file in 1M-token blocks, hashing as it goes. */
class ShardWriter {
  readonly fd: number;
  private readonly buf: Uint16Array | Uint32Array;
  private n = 0;
  tokens = 0;
  maxId = 0;
  readonly hash = createHash('sha256');
  constructor(readonly path: string, dtype: TokenDtype) {
    this.fd = openSync(path, 'w');
    this.buf = dtype === 'uint32' ? new Uint32Array(1 << 20) : new Uint16Array(1 << 20);
  }
  push(ids: ArrayLike<number>): void {
    for (let i = 0; i < ids.length; i++) {
      const v = ids[i]!;
      if (v > this.maxId) this.maxId = v;
      this.buf[this.n++] = v;
      if (this.n === this.buf.length) this.flush();
    }
    this.tokens += ids.length;
  }
  flush(): void {
    if (this.n === 0) return;
    const bytes = Buffer.from(this.buf.buffer, 0, this.n * this.buf.BYTES_PER_ELEMENT);
    writeSync(this.fd, bytes);
    this.hash.update(bytes);
    this.n = 0;
  }
  finish(): string {
    this.flush();
    fsyncSync(this.fd);
    closeSync(this.fd);
    return this.hash.digest('hex');
  }
}

/** Packs trained bits 8 a byte, least significant first, into a temp file, hashing as it goes. */
class MaskWriter {
  private readonly fd: number;
  private readonly buf = new Uint8Array(1 << 16);
  private n = 0;
  private cur = 0;
  private bit = 0;
  private readonly hash = createHash('sha256');
  constructor(readonly path: string) {
    this.fd = openSync(path, 'w');
  }
  push(bits: Uint8Array): void {
    for (let i = 0; i < bits.length; i++) {
      if (bits[i]) this.cur |= 1 << this.bit;
      if (++this.bit === 8) {
        this.buf[this.n++] = this.cur;
        this.cur = 0;
        this.bit = 0;
        if (this.n === this.buf.length) this.flush();
      }
    }
  }
  private flush(): void {
    if (this.n === 0) return;
    const bytes = Buffer.from(this.buf.buffer, 0, this.n);
    writeSync(this.fd, bytes);
    this.hash.update(bytes);
    this.n = 0;
  }
  abort(): void {
    closeSync(this.fd);
  }
  finish(): string {
    if (this.bit > 0) {
      this.buf[this.n++] = this.cur;
      this.bit = 0;
    }
    this.flush();
    fsyncSync(this.fd);
    closeSync(this.fd);
    return this.hash.digest('hex');
  }
}

/** Calls fn(line, lineNumber) for each line of bytes [start, end) of a file, read in 4 MiB blocks. */
function forEachLine(file: string, start: number, end: number, firstLine: number, fn: (line: string, lineNo: number) => void, progress: (bytes: number) => void): void {
  const fd = openSync(file, 'r');
  try {
    const block = Buffer.allocUnsafe(4 << 20);
    let carry = Buffer.alloc(0);
    let pos = start;
    let lineNo = firstLine;
    while (pos < end) {
      const n = readSync(fd, block, 0, Math.min(block.length, end - pos), pos);
      if (n === 0) break;
      pos += n;
      progress(n);
      const chunk = carry.length > 0 ? Buffer.concat([carry, block.subarray(0, n)]) : block.subarray(0, n);
      let from = 0;
      for (;;) {
        const nl = chunk.indexOf(10, from);
        if (nl < 0) break;
        fn(chunk.toString('utf8', from, nl), lineNo++);
        from = nl + 1;
      }
      carry = Buffer.from(chunk.subarray(from));
    }
    if (carry.length > 0) fn(carry.toString('utf8'), lineNo);
  } finally {
    closeSync(fd);
  }
}

let cached: { spec: string; tok: Tokenizer } | undefined;
let cachedTemplate: { key: string; t: ChatTemplate } | undefined;

/** Tokenizes one unit into OUT/shard_NNNNN.{bin,idx,done.json}; returns the shard's record. */
export async function processUnit(job: UnitJob, ctx: UnitContext, progress: (bytes: number) => void): Promise<ShardRecord> {
  if (cached?.spec !== ctx.tokenizer) cached = { spec: ctx.tokenizer, tok: await loadTokenizer(ctx.tokenizer) };
  const tok = cached.tok;
  if (ctx.example) return processExamples(job, ctx, ctx.example, tok, progress);
  const binTmp = `${job.stem}.bin.tmp`;
  const idxTmp = `${job.stem}.idx.tmp`;
  const w = new ShardWriter(binTmp, ctx.dtype);
  const ends: number[] = [0];
  let skipped = 0;
  const eot = [tok.eot];
  const doc = (text: string): void => {
    w.push(tok.encode(text));
    w.push(eot);
    ends.push(w.tokens);
  };
  const u = job.unit;
  const inputs = u.kind === 'text' ? u.files : [u.file];
  try {
    if (u.kind === 'text') {
      for (const f of u.files) {
        const text = readFileSync(f, 'utf8');
        progress(Buffer.byteLength(text));
        if (text.length > 0) doc(text);
      }
    } else if (u.kind === 'jsonl') {
      forEachLine(u.file, u.start, u.end, u.firstLine, (line, lineNo) => {
        if (line.trim() === '') return;
        let text: unknown;
        let problem: string | undefined;
        try {
          const v = JSON.parse(line) as unknown;
          text = v !== null && typeof v === 'object' ? (v as Record<string, unknown>)[ctx.field] : undefined;
          if (typeof text !== 'string') problem = `has no string field ${JSON.stringify(ctx.field)}`;
        } catch (e) {
          problem = `is not JSON (${(e as Error).message})`;
        }
        if (problem !== undefined) {
          if (ctx.skipBad) {
            skipped++;
            return;
          }
          throw new BadInputError(`${u.file}:${lineNo}: line ${lineNo} ${problem}; fix it, pass --field NAME for another field, or --skip-bad to count and skip such lines`);
        }
        doc(text as string);
      }, progress);
    } else {
      const { asyncBufferFromFile, parquetReadObjects } = await import('hyparquet');
      const { compressors } = await import('hyparquet-compressors');
      const file = await asyncBufferFromFile(u.file);
      const rows = await parquetReadObjects({ file, columns: [ctx.field], rowStart: u.rowStart, rowEnd: u.rowEnd, compressors });
      for (let r = 0; r < rows.length; r++) {
        const text = (rows[r] as Record<string, unknown>)[ctx.field];
        if (typeof text !== 'string') {
          if (ctx.skipBad || text === null || text === undefined) {
            skipped++;
            continue;
          }
          throw new BadInputError(`${u.file}: row ${u.rowStart + r} has a ${typeof text} in column ${JSON.stringify(ctx.field)}, not text; pass --field NAME for a text column, or --skip-bad`);
        }
        doc(text);
      }
      progress(u.bytes);
    }
  } catch (e) {
    closeSync(w.fd);
    for (const p of [binTmp, idxTmp]) if (existsSync(p)) unlinkSync(p);
    throw e;
  }
  const binSha256 = w.finish();
  const idx = Buffer.alloc(ends.length * 8);
  ends.forEach((v, i) => idx.writeBigUInt64LE(BigInt(v), i * 8));
  writeSynced(idxTmp, idx);
  renameSync(idxTmp, `${job.stem}.idx`);
  renameSync(binTmp, `${job.stem}.bin`);
  const rec: ShardRecord = {
    bin: `${basename(job.stem)}.bin`, idx: `${basename(job.stem)}.idx`, tokens: w.tokens, documents: ends.length - 1, maxTokenId: w.maxId,
    binSha256, idxSha256: createHash('sha256').update(idx).digest('hex'), key: job.key, inputs, skipped,
  };
  fsyncDir(dirname(job.stem));
  writeDurable(`${job.stem}.done.json`, JSON.stringify(rec));
  fsyncDir(dirname(job.stem));
  return rec;
}

/** Removes a unit's leftover temp files (an interrupted earlier run's). */
export function removeTemps(stem: string): void {
  for (const p of [`${stem}.bin.tmp`, `${stem}.idx.tmp`, `${stem}.mask.tmp`, `${stem}.done.json.tmp`]) if (existsSync(p)) unlinkSync(p);
}

/**
 * A .jsonl line range of examples into OUT/shard_NNNNN.{bin,idx,mask,done.json}. Every bad line is a
 * BadInputError naming FILE:LINE (or, with --skip-bad, counted); a conversation with no assistant turn
 * (trained on the assistant) is counted in skippedWhy, or an error under --strict.
 */
function processExamples(job: UnitJob, ctx: UnitContext, ex: ExampleContext, tok: Tokenizer, progress: (bytes: number) => void): ShardRecord {
  const u = job.unit;
  if (u.kind !== 'jsonl') throw new BadInputError(`${u.kind === 'text' ? u.files[0] : u.file}: --format ${ex.format} reads .jsonl files (one JSON example a line)`);
  let t: ChatTemplate | undefined;
  if (ex.template !== undefined) {
    const key = `${ex.template}\0${ex.tokenizerDir ?? ''}`;
    if (cachedTemplate?.key !== key) cachedTemplate = { key, t: loadChatTemplate(ex.template, ex.tokenizerDir !== undefined ? { tokenizerDir: ex.tokenizerDir } : {}) };
    t = cachedTemplate.t;
  }
  const binTmp = `${job.stem}.bin.tmp`;
  const idxTmp = `${job.stem}.idx.tmp`;
  const maskTmp = `${job.stem}.mask.tmp`;
  const w = new ShardWriter(binTmp, ctx.dtype);
  const m = new MaskWriter(maskTmp);
  const ends: number[] = [0];
  let skipped = 0;
  const why: Record<string, number> = {};
  const count = (reason: string): void => {
    why[reason] = (why[reason] ?? 0) + 1;
  };
  const doc = (e: TokenizedExample): void => {
    w.push(e.ids);
    m.push(e.trained);
    ends.push(w.tokens);
  };
  const hint = ctx.skipBad ? '' : ctx.badLineHint ?? '; fix the line, or pass --skip-bad to count and skip bad lines';
  try {
    forEachLine(u.file, u.start, u.end, u.firstLine, (line, lineNo) => {
      if (line.trim() === '') return;
      const at = { line: lineNo, file: u.file };
      try {
        const parsed = parseExampleLine(line, ex.format, at);
        if (parsed.kind === 'chat') {
          if (ex.trainOn !== 'all' && !parsed.messages.some((x) => x.role === 'assistant')) {
            if (ex.strict) {
              throw new BadInputError(`${u.file}:${lineNo}: the conversation has no assistant turn, so nothing in it is trained (--train-on ${ex.trainOn}); fix the line, or drop --strict to count and skip such lines`);
            }
            count(SKIP_NO_ASSISTANT);
            return;
          }
          doc(tokenizeChat(tok, t!, parsed.messages, ex.trainOn));
        } else if (parsed.kind === 'completion') {
          doc(tokenizeCompletion(tok, parsed.prompt, parsed.completion, { ...(ex.bos ? { bos: ex.bos } : {}), ...(ex.eos ? { eos: ex.eos } : {}) }));
        } else {
          if (typeof parsed.prompt !== 'string' && t === undefined) {
            throw new ChatDataError(at, 'the prompt is a list of messages, which needs a chat template; pass --chat-template model|chatml|FILE (or set data.chatTemplate)');
          }
          const p = tokenizePreference(tok, t, parsed.prompt, parsed.chosen, parsed.rejected);
          doc(p.chosen);
          doc(p.rejected);
        }
      } catch (e) {
        if (e instanceof BadInputError) throw e;
        if (!(e instanceof ChatDataError) && !(e instanceof ChatTemplateError)) throw e;
        if (ctx.skipBad) {
          skipped++;
          count(SKIP_BAD_LINE);
          return;
        }
        const msg = e instanceof ChatDataError ? e.message : `${u.file}:${lineNo}: ${e.message}`;
        throw new BadInputError(`${msg}${hint}`);
      }
    }, progress);
  } catch (e) {
    closeSync(w.fd);
    m.abort();
    for (const p of [binTmp, idxTmp, maskTmp]) if (existsSync(p)) unlinkSync(p);
    throw e;
  }
  const binSha256 = w.finish();
  const maskSha256 = m.finish();
  const idx = Buffer.alloc(ends.length * 8);
  ends.forEach((v, i) => idx.writeBigUInt64LE(BigInt(v), i * 8));
  writeSynced(idxTmp, idx);
  renameSync(idxTmp, `${job.stem}.idx`);
  renameSync(maskTmp, `${job.stem}.mask`);
  renameSync(binTmp, `${job.stem}.bin`);
  const name = basename(job.stem);
  const rec: ShardRecord = {
    bin: `${name}.bin`, idx: `${name}.idx`, tokens: w.tokens, documents: ends.length - 1, maxTokenId: w.maxId,
    binSha256, idxSha256: createHash('sha256').update(idx).digest('hex'), key: job.key, inputs: [u.file], skipped,
    mask: `${name}.mask`, maskSha256, skippedWhy: why,
  };
  fsyncDir(dirname(job.stem));
  writeDurable(`${job.stem}.done.json`, JSON.stringify(rec));
  fsyncDir(dirname(job.stem));
  return rec;
}
