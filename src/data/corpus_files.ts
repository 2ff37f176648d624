// Token corpora the loader samples windows from, without holding them in memory: a corpus is a
// list of segments, each a token range of an in-memory array or of a file read by byte range
// (pread). So resident memory does not grow with the corpus; the page cache holds what the OS likes.
import { closeSync, fstatSync, openSync, readSync } from 'node:fs';
import type { TokenArray } from './tokenizer.js';

export type TokenDtype = 'uint8' | 'uint16' | 'uint32';

export const DTYPE_BYTES: Record<TokenDtype, number> = { uint8: 1, uint16: 2, uint32: 4 };

/** A plain description of a segment, posted to worker threads (no file handles, no closures). */
export type SegmentSpec =
  | { kind: 'memory'; tokens: TokenArray; lo: number; hi: number; name: string }
  | { kind: 'file'; path: string; dtype: TokenDtype; lo: number; hi: number; name: string };

/** Reads tokens [lo, hi) of one segment. */
interface Segment {
  readonly spec: SegmentSpec;
  readonly length: number;
  read(start: number, n: number, out: Int32Array, at: number): void;
  close(): void;
}

class MemorySegment implements Segment {
  readonly length: number;
  constructor(readonly spec: Extract<SegmentSpec, { kind: 'memory' }>) {
    this.length = spec.hi - spec.lo;
  }
  read(start: number, n: number, out: Int32Array, at: number): void {
    const base = this.spec.lo + start;
    const t = this.spec.tokens;
    for (let i = 0; i < n; i++) out[at + i] = t[base + i]!;
  }
  close(): void {}
}

/** Token files opened once and shared by every segment that reads them (in this thread). */
const openFiles = new Map<string, { fd: number; refs: number }>();

class FileSegment implements Segment {
  readonly length: number;
  private readonly fd: number;
  private readonly width: number;
  private buf = Buffer.alloc(0);
  private closed = false;
  constructor(readonly spec: Extract<SegmentSpec, { kind: 'file' }>) {
    this.length = spec.hi - spec.lo;
    this.width = DTYPE_BYTES[spec.dtype];
    let f = openFiles.get(spec.path);
    if (!f) {
      let fd: number;
      try {
        fd = openSync(spec.path, 'r');
      } catch (e) {
        throw new Error(`token file ${spec.path} cannot be opened (${(e as NodeJS.ErrnoException).code ?? (e as Error).message}); run \`flotilla prepare\` again or fix data.sources`);
      }
      const need = spec.hi * this.width;
      const size = fstatSync(fd).size;
      if (size < need) {
        closeSync(fd);
        throw new Error(`token file ${spec.path} is truncated: it has ${size} bytes, its manifest promises ${need}; run \`flotilla prepare\` again`);
      }
      f = { fd, refs: 0 };
      openFiles.set(spec.path, f);
    }
    f.refs++;
    this.fd = f.fd;
  }
  read(start: number, n: number, out: Int32Array, at: number): void {
    const bytes = n * this.width;
    if (this.buf.byteLength < bytes) this.buf = Buffer.alloc(Math.max(bytes, 4096));
    const pos = (this.spec.lo + start) * this.width;
    let got = 0;
    while (got < bytes) {
      const r = readSync(this.fd, this.buf, got, bytes - got, pos + got);
      if (r === 0) throw new Error(`token file ${this.spec.path} ended at byte ${pos + got}, inside a window the manifest says it holds: the file is truncated; run \`flotilla prepare\` again`);
      got += r;
    }
    const b = this.buf;
    if (this.width === 2) {
      for (let i = 0; i < n; i++) out[at + i] = b[2 * i]! | (b[2 * i + 1]! << 8);
    } else if (this.width === 4) {
      for (let i = 0; i < n; i++) out[at + i] = b.readUInt32LE(4 * i);
    } else {
      for (let i = 0; i < n; i++) out[at + i] = b[i]!;
    }
  }
  close(): void {
    if (this.closed) return;
    this.closed = true;
    const f = openFiles.get(this.spec.path);
    if (f && --f.refs === 0) {
      closeSync(f.fd);
      openFiles.delete(this.spec.path);
    }
  }
}

/**
 * A corpus: segments read as if concatenated. Windows never cross a segment (a shard or a file), so
 * a window of n tokens starts at one of `starts(n)` places: sum over segments of length - n + 1.
 */
export class TokenCorpus {
  readonly name: string;
  readonly length: number;
  /** The vocabulary its ids must lie below (checked as windows are read). */
  readonly vocabSize: number;
  private readonly segs: Segment[];
  private cacheN = -1;
  private cum: number[] = [];

  constructor(specs: SegmentSpec[], o: { name: string; vocabSize: number }) {
    this.name = o.name;
    this.vocabSize = o.vocabSize;
    this.segs = [];
    try {
      for (const s of specs) if (s.hi > s.lo) this.segs.push(s.kind === 'memory' ? new MemorySegment(s) : new FileSegment(s));
    } catch (e) {
      for (const s of this.segs) s.close();
      throw e;
    }
    this.length = this.segs.reduce((a, s) => a + s.length, 0);
  }

  static fromArray(tokens: TokenArray, name = 'tokens', vocabSize = Infinity): TokenCorpus {
    return new TokenCorpus([{ kind: 'memory', tokens, lo: 0, hi: tokens.length, name }], { name, vocabSize });
  }

  get specs(): SegmentSpec[] {
    return this.segs.map((s) => s.spec);
  }

  /** Window starts for windows of n tokens. */
  starts(n: number): number {
    if (this.cacheN !== n) {
      this.cum = [];
      let acc = 0;
      for (const s of this.segs) {
        acc += Math.max(0, s.length - n + 1);
        this.cum.push(acc);
      }
      this.cacheN = n;
    }
    return this.cum.length === 0 ? 0 : this.cum[this.cum.length - 1]!;
  }

  /** Copies window k (0 <= k < starts(n)) of n tokens into out[at..at+n). */
  window(k: number, n: number, out: Int32Array, at: number): void {
    const total = this.starts(n);
    if (!(k >= 0 && k < total)) throw new RangeError(`window ${k} is outside 0..${total - 1} of ${this.name}`);
    let lo = 0;
    let hi = this.cum.length - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (this.cum[mid]! > k) hi = mid;
      else lo = mid + 1;
    }
    const seg = this.segs[lo]!;
    const start = k - (lo > 0 ? this.cum[lo - 1]! : 0);
    seg.read(start, n, out, at);
    for (let i = 0; i < n; i++) {
      const v = out[at + i]!;
      if (v >= this.vocabSize || v < 0) {
        throw new Error(
          `${seg.spec.name}: token id ${v} at token ${seg.spec.lo + start + i} is outside the vocabulary 0..${this.vocabSize - 1}; ` +
            'the data was made with another tokenizer (set data.tokenizer to it) or model.vocabSize is too small',
        );
      }
    }
  }

  /** The first `1 - fraction` and the last `fraction` of the tokens, as two corpora (no copy). */
  split(fraction: number, minTokens: number): { head: TokenCorpus; tail: TokenCorpus } {
    const nTail = Math.floor(this.length * fraction);
    const cut = this.length - nTail;
    const head: SegmentSpec[] = [];
    const tail: SegmentSpec[] = [];
    let pos = 0;
    for (const s of this.segs) {
      const sp = s.spec;
      const a = pos;
      const b = pos + s.length;
      if (b <= cut) head.push(sp);
      else if (a >= cut) tail.push(sp);
      else {
        head.push({ ...sp, hi: sp.lo + (cut - a) });
        tail.push({ ...sp, lo: sp.lo + (cut - a) });
      }
      pos = b;
    }
    const o = { vocabSize: this.vocabSize };
    const h = new TokenCorpus(head, { ...o, name: this.name });
    const t = new TokenCorpus(tail, { ...o, name: `${this.name} (held out)` });
    for (const [c, what] of [[h, 'training'], [t, 'validation']] as const) {
      if (c.starts(minTokens) === 0) {
        throw new Error(
          `${this.name} has ${this.length} tokens: holding out ${fraction} leaves no window of data.seqLen + 1 = ${minTokens} tokens for ${what}; ` +
            'use more data, a shorter data.seqLen, another data.valFraction, or give data.valSource',
        );
      }
    }
    return { head: h, tail: t };
  }

  close(): void {
    for (const s of this.segs) s.close();
  }
}
