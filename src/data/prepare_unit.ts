// One unit of `flotilla prepare` (src/data/prepare.ts): tokenizes a group of text files, a line
// range of a .jsonl file or a row range of a parquet file into one shard. Runs in a worker thread.
//
// Durability: the shard is written as .tmp files, fsync'd, renamed, and only then is its .done.json
// written (also through a fsync'd temp file). A shard without a matching .done.json is never reused,
// and the loader reads only what manifest.json (written last) lists.
import { createHash } from 'node:crypto';
import { closeSync, fsyncSync, openSync, readFileSync, readSync, renameSync, writeSync, unlinkSync, existsSync } from 'node:fs';
import { basename, dirname } from 'node:path';
import { fsyncDir, writeDurable, writeSynced } from '../io/durable.js';
import { loadTokenizer, type Tokenizer } from './tokenizer.js';
import type { TokenDtype } from './corpus_files.js';
import type { ShardRecord } from './prepared.js';

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
}

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

/** Tokenizes one unit into OUT/shard_NNNNN.{bin,idx,done.json}; returns the shard's record. */
export async function processUnit(job: UnitJob, ctx: UnitContext, progress: (bytes: number) => void): Promise<ShardRecord> {
  if (cached?.spec !== ctx.tokenizer) cached = { spec: ctx.tokenizer, tok: await loadTokenizer(ctx.tokenizer) };
  const tok = cached.tok;
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
  for (const p of [`${stem}.bin.tmp`, `${stem}.idx.tmp`, `${stem}.done.json.tmp`]) if (existsSync(p)) unlinkSync(p);
}
