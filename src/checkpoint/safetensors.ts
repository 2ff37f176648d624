// safetensors I/O: the checkpoint format PyTorch and Hugging Face read without pickle.
//
// Layout of a file:
//   8 bytes    N, the header length, unsigned 64-bit little-endian
//   N bytes    a UTF-8 JSON object: {"__metadata__": {str: str}?, name: {dtype, shape, data_offsets: [begin, end]}, ...}
//              padded at the end with spaces so that the data starts at an 8-byte aligned offset
//   the rest   the tensors' bytes, little-endian, C order; data_offsets are relative to the start of this
//              region, and together they cover it exactly (no gaps, no overlaps, nothing after the last one)
//
// Writes go to a temporary file in the same directory, are flushed, then renamed over the target, so a
// crash never leaves a half-written checkpoint under the real name; the next save to that name removes
// temporary files that interrupted saves left behind.
//
// Any string may name a tensor ('__proto__' included): names become own properties, never prototypes.
// A header is refused unread when it is larger than MAX_HEADER_BYTES, and before parsing when it
// holds more than MAX_TENSORS entries (or more JSON values than such entries need), so a hostile
// header cannot make the parser spend seconds and gigabytes.
import { closeSync, fstatSync, fsyncSync, openSync, readdirSync, readFileSync, readSync, renameSync, unlinkSync, writeSync } from 'node:fs';
import { open as openAsync, readFile as readFileAsync, rename as renameAsync, unlink as unlinkAsync } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { endianness } from 'node:os';
import { randomBytes } from 'node:crypto';
import { Tensor } from '../tensor/tensor.js';
import { native } from '../tensor/native.js';
import { type DType, dtypeCode, elementSize } from '../tensor/dtype.js';

/** safetensors dtype names for the dtypes flotilla has. */
export const SAFETENSORS_DTYPE: Record<DType, string> = {
  float32: 'F32', float64: 'F64', bfloat16: 'BF16', float16: 'F16',
  int64: 'I64', int32: 'I32', int16: 'I16', int8: 'I8', uint8: 'U8', bool: 'BOOL',
};
const FROM_SAFETENSORS = new Map<string, DType>(Object.entries(SAFETENSORS_DTYPE).map(([d, s]) => [s, d as DType]));

/** Headers above this size are refused as corrupt (the reference implementation uses the same cap). */
const MAX_HEADER_BYTES = 100_000_000;
/** Entries (tensors plus __metadata__) a header may hold; real checkpoints hold thousands at most. */
export const MAX_TENSORS = 100_000;
/** JSON values a header may hold in all: generous for MAX_TENSORS entries of up to 8 dimensions. */
const MAX_HEADER_VALUES = MAX_TENSORS * 16;

/** obj[key] = value as an own property, even for '__proto__' (which would otherwise set the prototype). */
function setOwn<T>(obj: Record<string, T>, key: string, value: T): void {
  Object.defineProperty(obj, key, { value, enumerable: true, writable: true, configurable: true });
}

export interface SafetensorsEntry {
  dtype: DType;
  shape: number[];
  /** [begin, end) in bytes, relative to the start of the data region. */
  dataOffsets: [number, number];
}

export interface SafetensorsHeader {
  metadata: Record<string, string>;
  /** Entries in file order (by data offset). */
  tensors: Record<string, SafetensorsEntry>;
  /** Byte offset of the data region from the start of the file (8 + header length). */
  dataStart: number;
}

function checkLittleEndian(): void {
  if (endianness() !== 'LE') throw new Error('safetensors: big-endian hosts are not supported (the format is little-endian)');
}

/** The header bytes (JSON, space-padded) for the given entries, plus the 8-byte length prefix. */
function encodeHeader(entries: [string, SafetensorsEntry][], metadata: Record<string, string> | undefined): Buffer {
  const obj: Record<string, unknown> = {};
  if (metadata && Object.keys(metadata).length > 0) obj.__metadata__ = metadata;
  for (const [name, e] of entries) setOwn(obj, name, { dtype: SAFETENSORS_DTYPE[e.dtype], shape: e.shape, data_offsets: e.dataOffsets });
  const json = Buffer.from(JSON.stringify(obj), 'utf8');
  const padded = Math.ceil(json.length / 8) * 8;
  const out = Buffer.alloc(8 + padded, 0x20);
  out.writeBigUInt64LE(BigInt(padded), 0);
  json.copy(out, 8);
  return out;
}

/** The header bytes (length prefix, JSON, padding) for entries laid out in the given order. */
export function encodeSafetensorsHeader(entries: [string, SafetensorsEntry][], metadata?: Record<string, string>): Buffer {
  checkLittleEndian();
  return encodeHeader(entries, metadata);
}

function validateInputs(tensors: Record<string, Tensor>, metadata: Record<string, string> | undefined): void {
  if (metadata !== undefined) {
    for (const [k, v] of Object.entries(metadata)) {
      if (typeof v !== 'string') throw new Error(`saveSafetensors: metadata value for '${k}' must be a string, got ${typeof v}`);
    }
  }
  for (const [name, t] of Object.entries(tensors)) {
    if (name === '__metadata__') throw new Error("saveSafetensors: '__metadata__' is reserved and cannot name a tensor");
    if (!(t instanceof Tensor)) throw new Error(`saveSafetensors: '${name}' is not a Tensor`);
    if (t.isDisposed) throw new Error(`saveSafetensors: tensor '${name}' was disposed`);
  }
}

/**
 * Encodes tensors (in the given key order) and optional string metadata as safetensors bytes:
 * the header buffer followed by one buffer per tensor.
 */
export function encodeSafetensors(tensors: Record<string, Tensor>, metadata?: Record<string, string>): Buffer[] {
  checkLittleEndian();
  validateInputs(tensors, metadata);
  const entries: [string, SafetensorsEntry][] = [];
  const datas: Buffer[] = [];
  let offset = 0;
  for (const [name, t] of Object.entries(tensors)) {
    const dtype = t.dtype;
    const shape = t.shape;
    const bytes = Buffer.from(native.toBuffer(t.handle)); // contiguous copy, raw elements (bf16/f16 as-is)
    entries.push([name, { dtype, shape, dataOffsets: [offset, offset + bytes.length] }]);
    datas.push(bytes);
    offset += bytes.length;
  }
  return [encodeHeader(entries, metadata), ...datas];
}

/**
 * Writes tensors to `path` in safetensors format (keys in insertion order), atomically: a temporary
 * file in the same directory is written, flushed and renamed over `path`. On any error nothing is
 * left on disk and an existing file at `path` is untouched.
 */
export function saveSafetensors(path: string, tensors: Record<string, Tensor>, metadata?: Record<string, string>): void {
  const parts = encodeSafetensors(tensors, metadata);
  removeStaleTemps(path);
  const tmp = tempPath(path);
  inFlight.add(tmp);
  let fd: number | undefined;
  try {
    fd = openSync(tmp, 'wx');
    for (const p of parts) {
      let done = 0;
      while (done < p.length) done += writeSync(fd, p, done, p.length - done);
    }
    fsyncSync(fd);
    closeSync(fd);
    fd = undefined;
    renameSync(tmp, path);
  } catch (e) {
    if (fd !== undefined) closeSync(fd);
    try {
      unlinkSync(tmp);
    } catch {
      // the temporary file was never created or is already gone
    }
    throw new Error(`saveSafetensors: could not write ${path}: ${(e as Error).message}`);
  } finally {
    inFlight.delete(tmp);
  }
}

function tempPath(path: string): string {
  return join(dirname(path), `.${basename(path)}.${process.pid}.${randomBytes(4).toString('hex')}.tmp`);
}

/** Temporary files this process is writing now (never removed as stale). */
const inFlight = new Set<string>();

function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/**
 * Removes temporary files of earlier saves to `path` that were interrupted (their writer is gone, or
 * it is this process and the save is no longer running). Saves by other live processes are left alone.
 */
function removeStaleTemps(path: string): string[] {
  const dir = dirname(path);
  const base = basename(path).replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  const re = new RegExp(`^\\.${base}\\.(\\d+)\\.[0-9a-f]{8}\\.tmp$`);
  let names: string[];
  try {
    names = readdirSync(dir);
  } catch {
    return [];
  }
  const removed: string[] = [];
  for (const name of names) {
    const m = re.exec(name);
    if (!m) continue;
    const pid = Number(m[1]);
    const full = join(dir, name);
    if ((pid === process.pid && !inFlight.has(full)) || (pid !== process.pid && !processAlive(pid))) {
      try {
        unlinkSync(full);
        removed.push(full);
      } catch {
        // already gone
      }
    }
  }
  return removed;
}

/**
 * saveSafetensors without blocking the event loop on disk writes. The tensors are copied out
 * synchronously first, so they may be changed or disposed as soon as the promise exists.
 */
export async function saveSafetensorsAsync(path: string, tensors: Record<string, Tensor>, metadata?: Record<string, string>): Promise<void> {
  const parts = encodeSafetensors(tensors, metadata);
  removeStaleTemps(path);
  const tmp = tempPath(path);
  inFlight.add(tmp);
  let fh: Awaited<ReturnType<typeof openAsync>> | undefined;
  try {
    fh = await openAsync(tmp, 'wx');
    for (const p of parts) await fh.write(p);
    await fh.sync();
    await fh.close();
    fh = undefined;
    await renameAsync(tmp, path);
  } catch (e) {
    await fh?.close().catch(() => undefined);
    await unlinkAsync(tmp).catch(() => undefined);
    throw new Error(`saveSafetensors: could not write ${path}: ${(e as Error).message}`);
  } finally {
    inFlight.delete(tmp);
  }
}

/** loadSafetensorsWithMetadata, reading the file without blocking the event loop. */
export async function loadSafetensorsAsync(path: string): Promise<{ tensors: Record<string, Tensor>; metadata: Record<string, string> }> {
  let bytes: Buffer;
  try {
    bytes = await readFileAsync(path);
  } catch (e) {
    throw new Error(`loadSafetensors: cannot read ${path}: ${(e as Error).message}`);
  }
  return decodeSafetensors(bytes, path);
}

function corrupt(where: string, why: string): Error {
  return new Error(`safetensors: ${where} is not a valid safetensors file: ${why}`);
}

/**
 * Parses and checks a header. `fileBytes` is the total size, used to check that the data region
 * matches the offsets exactly (a shorter file is reported as truncated).
 */
function parseHeader(prefix: Buffer, fileBytes: number, where: string): SafetensorsHeader {
  if (fileBytes < 8) throw corrupt(where, `truncated: ${fileBytes} bytes, shorter than the 8-byte header length`);
  const n64 = prefix.readBigUInt64LE(0);
  if (n64 > BigInt(MAX_HEADER_BYTES)) throw corrupt(where, `header length ${n64} is implausibly large (corrupt length prefix?)`);
  const n = Number(n64);
  if (8 + n > fileBytes) throw corrupt(where, `truncated: header needs ${n} bytes but only ${fileBytes - 8} follow the length prefix`);
  if (prefix.length < 8 + n) throw new Error('internal: header prefix not fully read');
  const headerBytes = prefix.subarray(8, 8 + n);
  if (headerBytes[0] !== 0x7b /* { */) throw corrupt(where, 'header does not start with a JSON object');
  const tooMany = countHeaderValues(headerBytes);
  if (tooMany !== undefined) throw corrupt(where, tooMany);
  const text = headerBytes.toString('utf8');
  let obj: unknown;
  try {
    obj = JSON.parse(text);
  } catch (e) {
    throw corrupt(where, `header is not valid JSON (${(e as Error).message})`);
  }
  if (obj === null || typeof obj !== 'object' || Array.isArray(obj)) throw corrupt(where, 'header is not a JSON object');
  const metadata: Record<string, string> = {};
  const list: [string, SafetensorsEntry][] = [];
  // JSON.parse makes '__proto__' an own property like any other key; Object.entries lists it.
  for (const [name, raw] of Object.entries(obj as Record<string, unknown>)) {
    if (name === '__metadata__') {
      if (raw === null || typeof raw !== 'object' || Array.isArray(raw)) throw corrupt(where, '__metadata__ is not an object');
      for (const [k, v] of Object.entries(raw as Record<string, unknown>)) {
        if (typeof v !== 'string') throw corrupt(where, `__metadata__['${k}'] is not a string`);
        setOwn(metadata, k, v);
      }
      continue;
    }
    const e = raw as { dtype?: unknown; shape?: unknown; data_offsets?: unknown } | null;
    if (e === null || typeof e !== 'object') throw corrupt(where, `entry '${name}' is not an object`);
    const dtype = typeof e.dtype === 'string' ? FROM_SAFETENSORS.get(e.dtype) : undefined;
    if (!dtype) {
      throw corrupt(where, `tensor '${name}' has dtype ${JSON.stringify(e.dtype)}; supported: ${[...FROM_SAFETENSORS.keys()].join(', ')}`);
    }
    const shape = e.shape;
    if (!Array.isArray(shape) || !shape.every((s) => Number.isSafeInteger(s) && s >= 0)) {
      throw corrupt(where, `tensor '${name}' has shape ${JSON.stringify(shape)}, expected a list of non-negative integers`);
    }
    const off = e.data_offsets;
    if (!Array.isArray(off) || off.length !== 2 || !off.every((s) => Number.isSafeInteger(s) && s >= 0) || off[0] > off[1]) {
      throw corrupt(where, `tensor '${name}' has data_offsets ${JSON.stringify(off)}, expected [begin, end] with begin <= end`);
    }
    const numel = (shape as number[]).reduce((a, b) => a * b, 1);
    const need = numel * elementSize(dtype);
    if (off[1] - off[0] !== need) {
      throw corrupt(where, `tensor '${name}' (${e.dtype} [${shape.join(', ')}]) needs ${need} bytes, data_offsets [${off[0]}, ${off[1]}] span ${off[1] - off[0]}`);
    }
    list.push([name, { dtype, shape: shape as number[], dataOffsets: [off[0], off[1]] }]);
  }
  // The offsets must tile the data region: sorted by begin, each starts where the previous ended.
  list.sort((a, b) => a[1].dataOffsets[0] - b[1].dataOffsets[0] || a[1].dataOffsets[1] - b[1].dataOffsets[1]);
  let end = 0;
  for (const [name, e] of list) {
    if (e.dataOffsets[0] !== end) {
      throw corrupt(where, `tensor '${name}' starts at byte ${e.dataOffsets[0]} of the data, expected ${end} (gap or overlap)`);
    }
    end = e.dataOffsets[1];
  }
  const dataStart = 8 + n;
  const have = fileBytes - dataStart;
  if (have < end) throw corrupt(where, `truncated: the header describes ${end} bytes of tensor data, the file holds ${have}`);
  if (have > end) throw corrupt(where, `${have - end} unexpected bytes after the last tensor (header describes ${end} bytes of data)`);
  const tensors: Record<string, SafetensorsEntry> = {};
  for (const [name, e] of list) setOwn(tensors, name, e);
  return { metadata, tensors, dataStart };
}

/**
 * Counts the header's top-level entries and its JSON values (commas and colons outside strings) in
 * one pass over the bytes, stopping at the first limit exceeded; returns why it is refused, if so.
 * Structural characters are ASCII and never occur inside a multi-byte UTF-8 sequence.
 */
function countHeaderValues(b: Uint8Array): string | undefined {
  let depth = 0;
  let entries = 0;
  let values = 0;
  let inString = false;
  for (let i = 0; i < b.length; i++) {
    const c = b[i]!;
    if (inString) {
      if (c === 0x5c /* \ */) i++;
      else if (c === 0x22 /* " */) inString = false;
      continue;
    }
    if (c === 0x22) inString = true;
    else if (c === 0x7b || c === 0x5b) depth++;
    else if (c === 0x7d || c === 0x5d) depth--;
    else if (c === 0x3a /* : */ || c === 0x2c /* , */) {
      if (c === 0x3a && depth === 1 && ++entries > MAX_TENSORS) {
        return `header holds more than ${MAX_TENSORS} entries (the limit of this reader)`;
      }
      if (++values > MAX_HEADER_VALUES) return `header holds more than ${MAX_HEADER_VALUES} JSON values (the limit of this reader)`;
    }
  }
  return undefined;
}

/** Decodes safetensors bytes into new tensors (file order) and the metadata. */
export function decodeSafetensors(bytes: Uint8Array, where = 'buffer'): { tensors: Record<string, Tensor>; metadata: Record<string, string> } {
  checkLittleEndian();
  const buf = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const header = parseHeader(buf, buf.length, where);
  const tensors: Record<string, Tensor> = {};
  try {
    for (const [name, e] of Object.entries(header.tensors)) {
      const data = buf.subarray(header.dataStart + e.dataOffsets[0], header.dataStart + e.dataOffsets[1]);
      setOwn(tensors, name, new Tensor(native.fromBuffer(data, e.shape, dtypeCode(e.dtype))));
    }
  } catch (err) {
    for (const t of Object.values(tensors)) t.dispose();
    throw err;
  }
  return { tensors, metadata: header.metadata };
}

/** Reads every tensor of a safetensors file (keys in file order). */
export function loadSafetensors(path: string): Record<string, Tensor> {
  return loadSafetensorsWithMetadata(path).tensors;
}

/** Reads every tensor of a safetensors file and its `__metadata__` strings. */
export function loadSafetensorsWithMetadata(path: string): { tensors: Record<string, Tensor>; metadata: Record<string, string> } {
  let bytes: Buffer;
  try {
    bytes = readFileSync(path);
  } catch (e) {
    throw new Error(`loadSafetensors: cannot read ${path}: ${(e as Error).message}`);
  }
  return decodeSafetensors(bytes, path);
}

/** Reads only the header of a file: names, dtypes, shapes, offsets and metadata (no tensor data). */
export function readSafetensorsHeader(path: string): SafetensorsHeader {
  let fd: number;
  try {
    fd = openSync(path, 'r');
  } catch (e) {
    throw new Error(`readSafetensorsHeader: cannot read ${path}: ${(e as Error).message}`);
  }
  try {
    const size = fstatSync(fd).size;
    const lenBuf = Buffer.alloc(8);
    const got = size >= 8 ? readSync(fd, lenBuf, 0, 8, 0) : 0;
    if (got < 8) return parseHeader(lenBuf, size, path); // throws "truncated"
    const n = lenBuf.readBigUInt64LE(0);
    const want = n > BigInt(MAX_HEADER_BYTES) || 8n + n > BigInt(size) ? 8 : 8 + Number(n);
    const prefix = Buffer.alloc(want);
    readSync(fd, prefix, 0, want, 0);
    return parseHeader(prefix, size, path);
  } finally {
    closeSync(fd);
  }
}
