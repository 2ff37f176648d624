// Example datasets (chat, completion, preference): whole documents with a trained-target mask,
// read by byte range from v2 prepared shards (src/data/prepared.ts), and the rows they are packed
// into. Tensor-free, so the prefetch worker (prefetch_worker.ts) uses it without the native addon.
//
// A unit is what the plan places: one document, or a preference pair (documents 2i = prompt +
// chosen and 2i + 1 = prompt + rejected, always in one row: a pair never spans micro-batches or
// ranks). See [Note: example rows] in example_loader.ts for how rows become (x, y).
import { closeSync, openSync, readSync } from 'node:fs';
import { DTYPE_BYTES, type TokenDtype } from './corpus_files.js';
import { EpochStream, type PackOptions } from './packing.js';
import { IGNORE_INDEX } from '../parallel/parallel_model.js';
import { readDocumentOffsets, type ExampleKind, type ExampleShard } from './prepared.js';

export type { ExampleKind };

/** One shard of documents: token ids, the trained-target bits (LSB first), document boundaries. */
export type ExampleShardSpec =
  | { kind: 'file'; bin: string; mask: string; dtype: TokenDtype; offsets: Float64Array; name: string }
  | { kind: 'memory'; ids: Int32Array; mask: Uint8Array; offsets: Float64Array; name: string };

/** A plain description of an example corpus, posted to worker threads. */
export interface ExampleCorpusSpec {
  name: string;
  kind: ExampleKind;
  shards: ExampleShardSpec[];
  vocabSize: number;
  /** The units [lo, hi) of the shards taken together (a training head or a validation tail). */
  lo: number;
  hi: number;
}

/** Tokens of a pair's or an example's documents after fitting `max`: one length, or chosen and rejected. */
export type DocLengths = [number] | [number, number];

interface OpenShard {
  spec: ExampleShardSpec;
  units: number;
  fdBin?: number;
  fdMask?: number;
}

export class ExampleCorpus {
  readonly name: string;
  readonly kind: ExampleKind;
  readonly pairs: boolean;
  readonly vocabSize: number;
  /** Units in this corpus (examples, or pairs). */
  readonly units: number;
  private readonly shards: OpenShard[] = [];
  /** Units before each shard (over the whole shard list, before lo). */
  private readonly cum: number[] = [];
  private buf = Buffer.alloc(0);
  private mbuf = Buffer.alloc(0);

  constructor(readonly spec: ExampleCorpusSpec) {
    this.name = spec.name;
    this.kind = spec.kind;
    this.pairs = spec.kind === 'preference';
    this.vocabSize = spec.vocabSize;
    let acc = 0;
    for (const s of spec.shards) {
      const docs = s.offsets.length - 1;
      if (this.pairs && docs % 2 !== 0) throw new Error(`${s.name}: a preference shard holds pairs (2 documents each), this one ${docs} documents; run \`flotilla prepare\` again`);
      const units = this.pairs ? docs / 2 : docs;
      this.cum.push(acc);
      acc += units;
      this.shards.push({ spec: s, units });
    }
    if (!(Number.isInteger(spec.lo) && Number.isInteger(spec.hi) && 0 <= spec.lo && spec.lo <= spec.hi && spec.hi <= acc)) {
      throw new Error(`internal: unit range [${spec.lo}, ${spec.hi}) outside the ${acc} units of ${spec.name}`);
    }
    this.units = spec.hi - spec.lo;
  }

  /** Shard and first document of unit u (0 <= u < units). */
  private locate(u: number): { shard: OpenShard; doc: number } {
    if (!(Number.isInteger(u) && u >= 0 && u < this.units)) throw new RangeError(`unit ${u} is outside 0..${this.units - 1} of ${this.name}`);
    const g = this.spec.lo + u;
    let lo = 0, hi = this.cum.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (this.cum[mid]! <= g) lo = mid;
      else hi = mid - 1;
    }
    const local = g - this.cum[lo]!;
    return { shard: this.shards[lo]!, doc: this.pairs ? 2 * local : local };
  }

  /** Tokens of each document of unit u. */
  docLengths(u: number): DocLengths {
    const { shard, doc } = this.locate(u);
    const o = shard.spec.offsets;
    const a = o[doc + 1]! - o[doc]!;
    return this.pairs ? [a, o[doc + 2]! - o[doc + 1]!] : [a];
  }

  /** Tokens of unit u (a pair: chosen + rejected). */
  unitLength(u: number): number {
    const d = this.docLengths(u);
    return d.length === 1 ? d[0] : d[0] + d[1];
  }

  /** Every unit's length, in order (what the epoch plans are made from). */
  lengths(): Int32Array {
    const out = new Int32Array(this.units);
    for (let u = 0; u < this.units; u++) out[u] = this.unitLength(u);
    return out;
  }

  /**
   * Writes unit u, fitted to `max` tokens, at ids[at..] and its trained-target bits at trained[at..]:
   * a single document is cut at its end; a pair's two responses lose their tails evenly (the prompt,
   * their common head, kept), each keeping one token at least. Returns each document's tokens written.
   */
  read(u: number, max: number, ids: Int32Array, trained: Uint8Array, at: number): DocLengths {
    const { shard, doc } = this.locate(u);
    const fitted = this.fit(u, max);
    this.readDoc(shard, doc, fitted[0], ids, trained, at);
    if (fitted.length === 2) this.readDoc(shard, doc + 1, fitted[1], ids, trained, at + fitted[0]);
    return fitted;
  }

  /** Tokens of each document of unit u that read(u, max) writes. */
  fit(u: number, max: number): DocLengths {
    const full = this.docLengths(u);
    return full.length === 1 ? [Math.min(full[0], max)] : fitPair(full[0], full[1], max);
  }

  /**
   * Whether every document of unit u, fitted to `max` tokens, keeps a trained target (a set bit at
   * one of its tokens 1 .. n - 1, the targets of its positions 0 .. n - 2). A preference pair whose
   * response a cut leaves untrained has no log-probability to compare, so the plans leave it out.
   */
  keepsTargets(u: number, max: number): boolean {
    const { shard, doc } = this.locate(u);
    return this.fit(u, max).every((n, i) => this.anyTrained(shard, doc + i, n));
  }

  private anyTrained(shard: OpenShard, doc: number, n: number): boolean {
    const s = shard.spec;
    const start = s.offsets[doc]!;
    if (n < 2) return false;
    const bit = (mask: Uint8Array, t: number) => (mask[t >> 3]! >> (t & 7)) & 1;
    if (s.kind === 'memory') {
      for (let k = 1; k < n; k++) if (bit(s.mask, start + k)) return true;
      return false;
    }
    shard.fdMask ??= openFd(s.mask);
    const m0 = Math.floor(start / 8), m1 = Math.ceil((start + n) / 8);
    if (this.mbuf.byteLength < m1 - m0) this.mbuf = Buffer.alloc(Math.max(m1 - m0, 1024));
    preadAll(shard.fdMask, this.mbuf, m1 - m0, m0, s.mask);
    for (let k = 1; k < n; k++) if (bit(this.mbuf, start + k - m0 * 8)) return true;
    return false;
  }

  private readDoc(shard: OpenShard, doc: number, n: number, ids: Int32Array, trained: Uint8Array, at: number): void {
    const s = shard.spec;
    const start = s.offsets[doc]!;
    if (s.kind === 'memory') {
      for (let k = 0; k < n; k++) {
        const t = start + k;
        ids[at + k] = s.ids[t]!;
        trained[at + k] = (s.mask[t >> 3]! >> (t & 7)) & 1;
      }
    } else {
      const width = DTYPE_BYTES[s.dtype];
      shard.fdBin ??= openFd(s.bin);
      shard.fdMask ??= openFd(s.mask);
      const bytes = n * width;
      if (this.buf.byteLength < bytes) this.buf = Buffer.alloc(Math.max(bytes, 4096));
      preadAll(shard.fdBin, this.buf, bytes, start * width, s.bin);
      const b = this.buf;
      if (width === 2) for (let k = 0; k < n; k++) ids[at + k] = b[2 * k]! | (b[2 * k + 1]! << 8);
      else if (width === 4) for (let k = 0; k < n; k++) ids[at + k] = b.readUInt32LE(4 * k);
      else for (let k = 0; k < n; k++) ids[at + k] = b[k]!;
      const m0 = Math.floor(start / 8), m1 = Math.ceil((start + n) / 8);
      if (this.mbuf.byteLength < m1 - m0) this.mbuf = Buffer.alloc(Math.max(m1 - m0, 1024));
      preadAll(shard.fdMask, this.mbuf, m1 - m0, m0, s.mask);
      for (let k = 0; k < n; k++) {
        const t = start + k - m0 * 8;
        trained[at + k] = (this.mbuf[t >> 3]! >> (t & 7)) & 1;
      }
    }
    for (let k = 0; k < n; k++) {
      const v = ids[at + k]!;
      if (v < 0 || v >= this.vocabSize) {
        throw new Error(`${s.name}: token id ${v} of document ${doc} is outside the vocabulary 0..${this.vocabSize - 1}; the data was made with another tokenizer (set data.tokenizer to it) or model.vocabSize is too small`);
      }
    }
  }

  /** The first `1 - fraction` and the last `fraction` of the units, in order (no copy). */
  split(fraction: number): { head: ExampleCorpus; tail: ExampleCorpus } {
    const nTail = Math.floor(this.units * fraction);
    const cut = this.spec.lo + this.units - nTail;
    const what = this.pairs ? 'pairs' : 'examples';
    if (nTail === 0 || cut === this.spec.lo) {
      throw new Error(`${this.name} has ${this.units} ${what}: holding out ${fraction} leaves ${nTail === 0 ? 'none for validation' : 'none for training'}; use more data, another data.valFraction, or give data.valSource`);
    }
    return {
      head: new ExampleCorpus({ ...this.spec, hi: cut }),
      tail: new ExampleCorpus({ ...this.spec, lo: cut, name: `${this.name} (held out)` }),
    };
  }

  close(): void {
    for (const s of this.shards) {
      if (s.fdBin !== undefined) closeSync(s.fdBin);
      if (s.fdMask !== undefined) closeSync(s.fdMask);
      s.fdBin = s.fdMask = undefined;
    }
  }
}

/**
 * A pair of c + r tokens fitted to `max`: both responses lose their tails evenly (the prompt, their
 * common head, kept), each keeping one token at least.
 */
export function fitPair(c: number, r: number, max: number): [number, number] {
  const excess = c + r - max;
  if (excess <= 0) return [c, r];
  if (max < 2) throw new Error(`a preference pair needs 2 tokens of a row at least; data.seqLen is ${max}`);
  let cutC = Math.ceil(excess / 2), cutR = excess - cutC;
  if (c - cutC < 1) [cutC, cutR] = [c - 1, excess - (c - 1)];
  if (r - cutR < 1) [cutR, cutC] = [r - 1, excess - (r - 1)];
  return [c - cutC, r - cutR];
}

function openFd(path: string): number {
  try {
    return openSync(path, 'r');
  } catch (e) {
    throw new Error(`${path} cannot be opened (${(e as NodeJS.ErrnoException).code ?? (e as Error).message}); run \`flotilla prepare\` again`);
  }
}

function preadAll(fd: number, buf: Buffer, bytes: number, pos: number, path: string): void {
  let got = 0;
  while (got < bytes) {
    const r = readSync(fd, buf, got, bytes - got, pos + got);
    if (r === 0) throw new Error(`${path} ended at byte ${pos + got}, inside a document its manifest lists: the file is truncated; run \`flotilla prepare\` again`);
    got += r;
  }
}

/** What the loader's row stream is made of (plain data: the prefetch worker rebuilds it). */
export interface ExampleRowsSpec {
  corpora: ExampleCorpusSpec[];
  pack: PackOptions;
  seed: number;
  /** false: every epoch is the units in order (validation's fixed rows). */
  shuffle: boolean;
  /** The id padding takes in x (the tokenizer's end-of-text). */
  padId: number;
  globalBatch: number;
  dpRank: number;
  dpSize: number;
  microBatches: number;
}

/** The planes of one micro-batch (B x T int32 each) the loader turns into tensors. */
export interface RowPlanes {
  x: Int32Array;
  y: Int32Array;
  /** Each token's index within its document (pads: within the trailing pad document). */
  pos: Int32Array;
  /** Each token's document number within its row, non-decreasing; pads are one trailing document. */
  ids: Int32Array;
  /** Each token's unit (dataset example or pair, over the corpora in order); -1 for padding. */
  unit: Int32Array;
}

export const PLANES = 5;

/** The planes of a slot of PLANES x bt int32. */
export function planesOf(slot: Int32Array, bt: number): RowPlanes {
  const p = (i: number) => slot.subarray(i * bt, (i + 1) * bt);
  return { x: p(0), y: p(1), pos: p(2), ids: p(3), unit: p(4) };
}

/**
 * The run's rows: the corpora concatenated into one list of units, planned epoch by epoch
 * (src/data/packing.ts), and one micro-batch's rows written into planes.
 */
export class ExampleRows {
  readonly corpora: ExampleCorpus[];
  readonly stream: EpochStream;
  readonly seqLen: number;
  readonly localBatch: number;
  readonly microBatchSize: number;
  /** Preference pairs left out of every epoch: cut to seqLen, a response would keep no trained target. */
  readonly untrainedPairs: number;
  private readonly firstUnit: number[] = [];
  private readonly ids: Int32Array;
  private readonly trained: Uint8Array;

  constructor(corpora: ExampleCorpus[], readonly spec: ExampleRowsSpec) {
    this.corpora = corpora;
    this.seqLen = spec.pack.seqLen;
    let n = 0;
    for (const c of corpora) {
      this.firstUnit.push(n);
      n += c.units;
    }
    const lengths = new Int32Array(n);
    corpora.forEach((c, i) => lengths.set(c.lengths(), this.firstUnit[i]!));
    // A preference pair cut to seqLen may lose every trained token of a response: left out of every
    // epoch and counted with the dropped units (only the units longer than a row are read for it).
    const T = spec.pack.seqLen;
    let leftOut: Uint8Array | undefined;
    if (spec.pack.overflow === 'truncate') {
      corpora.forEach((c, i) => {
        if (!c.pairs) return;
        for (let u = 0; u < c.units; u++) {
          if (c.unitLength(u) > T && !c.keepsTargets(u, T)) (leftOut ??= new Uint8Array(n))[this.firstUnit[i]! + u] = 1;
        }
      });
    }
    this.untrainedPairs = leftOut?.reduce((a, v) => a + v, 0) ?? 0;
    this.stream = new EpochStream(lengths, spec.seed, { ...spec.pack, shuffle: spec.shuffle, ...(leftOut ? { leftOut } : {}) });
    this.localBatch = spec.globalBatch / spec.dpSize;
    this.microBatchSize = this.localBatch / spec.microBatches;
    this.ids = new Int32Array(this.seqLen);
    this.trained = new Uint8Array(this.seqLen);
  }

  static fromSpec(spec: ExampleRowsSpec): ExampleRows {
    return new ExampleRows(spec.corpora.map((c) => new ExampleCorpus(c)), spec);
  }

  get units(): number {
    return this.stream.units;
  }

  /** The global row of the run that row b of (step, micro) on this rank reads. */
  globalRow(step: number, micro: number, b: number): number {
    return step * this.spec.globalBatch + this.spec.dpRank * this.localBatch + micro * this.microBatchSize + b;
  }

  private corpusOf(u: number): { c: ExampleCorpus; local: number } {
    let k = this.firstUnit.length - 1;
    while (this.firstUnit[k]! > u) k--;
    return { c: this.corpora[k]!, local: u - this.firstUnit[k]! };
  }

  /** Writes micro-batch `micro` of this rank at `step` (see [Note: example rows] in example_loader.ts). */
  fill(step: number, micro: number, out: RowPlanes): void {
    const T = this.seqLen;
    for (let b = 0; b < this.microBatchSize; b++) {
      const { plan, row } = this.stream.locate(this.globalRow(step, micro, b));
      const base = b * T;
      let p = 0;
      let doc = 0;
      for (let i = plan.rowStart[row]!; i < plan.rowStart[row + 1]!; i++) {
        const u = plan.unit[i]!;
        const { c, local } = this.corpusOf(u);
        const lens = c.read(local, plan.take[i]!, this.ids, this.trained, 0);
        let k0 = 0;
        for (const n of lens) {
          for (let k = 0; k < n; k++) {
            const at = base + p + k;
            out.x[at] = this.ids[k0 + k]!;
            out.y[at] = k + 1 < n && this.trained[k0 + k + 1] ? this.ids[k0 + k + 1]! : IGNORE_INDEX;
            out.pos[at] = k;
            out.ids[at] = doc;
            out.unit[at] = u;
          }
          p += n;
          k0 += n;
          doc++;
        }
      }
      for (let k = 0; p + k < T; k++) {
        const at = base + p + k;
        out.x[at] = this.spec.padId;
        out.y[at] = IGNORE_INDEX;
        out.pos[at] = k;
        out.ids[at] = doc;
        out.unit[at] = -1;
      }
    }
  }

  close(): void {
    for (const c of this.corpora) c.close();
  }
}

/** The corpus spec of an example dataset's shards (prepared.ts's openExamples): each shard's document boundaries read from its .idx. */
export function exampleCorpusSpec(o: { name: string; kind: ExampleKind; shards: ExampleShard[]; vocabSize: number }): ExampleCorpusSpec {
  const shards: ExampleShardSpec[] = o.shards.map((s) => {
    const offsets = readDocumentOffsets(s.idx);
    if (offsets.length !== s.documents + 1 || offsets[0] !== 0 || offsets[s.documents] !== s.tokens || offsets.some((v, i) => i > 0 && v < offsets[i - 1]!)) {
      throw new Error(`${s.idx} does not hold ${s.documents + 1} non-decreasing offsets from 0 to ${s.tokens}; run \`flotilla prepare\` again`);
    }
    return { kind: 'file', bin: s.bin, mask: s.mask, dtype: s.dtype, offsets, name: s.bin };
  });
  const docs = o.shards.reduce((a, s) => a + s.documents, 0);
  return { name: o.name, kind: o.kind, shards, vocabSize: o.vocabSize, lo: 0, hi: o.kind === 'preference' ? docs / 2 : docs };
}
