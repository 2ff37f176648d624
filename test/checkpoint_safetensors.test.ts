// safetensors: exact byte layout, round trip of every dtype, PyTorch reading our files (and us reading
// PyTorch's), atomic writes and clear errors for damaged files.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, writeFileSync, readdirSync, rmSync, existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { tensor, tidy, arange, randn, zeros, liveTensors, setNumThreads, type DType, type Tensor } from '../src/tensor/index.js';
import {
  saveSafetensors, loadSafetensors, loadSafetensorsWithMetadata, readSafetensorsHeader, decodeSafetensors, encodeSafetensors,
  saveSafetensorsAsync, loadSafetensorsAsync,
} from '../src/checkpoint/safetensors.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';

setNumThreads(1);
const dir = mkdtempSync(join(tmpdir(), 'flotilla-st-'));
process.on('exit', () => rmSync(dir, { recursive: true, force: true }));

/** One tensor of every dtype with values that survive the dtype exactly. */
function everyDtype(): Record<string, Tensor> {
  const f = [1.5, -2, 0.15625, 3, 0, -0.5];
  return tidy(() => ({
    f32: tensor([[0.1, -2.5, 3.25], [1e-20, 7, -0]], { dtype: 'float32' }),
    f64: tensor([Math.PI, -1e300, 5e-324, 2], { dtype: 'float64' }),
    bf16: tensor(f, { dtype: 'float32' }).view(2, 3).to('bfloat16'),
    f16: tensor(f, { dtype: 'float32' }).view(3, 2).to('float16'),
    i64: tensor(new BigInt64Array([-(2n ** 62n), 0n, 2n ** 62n + 5n])),
    i32: tensor([-2147483648, 0, 2147483647], { dtype: 'int32' }),
    i16: tensor([-32768, 1, 32767], { dtype: 'int16' }),
    i8: tensor([-128, 0, 127, 5], { dtype: 'int8' }).view(2, 2),
    u8: tensor([0, 128, 255], { dtype: 'uint8' }),
    bool: tensor([[true, false], [false, true]]),
  }));
}

function sameTensor(a: Tensor, b: Tensor, what: string): void {
  assert.equal(a.dtype, b.dtype, `${what}: dtype`);
  assert.deepEqual(a.shape, b.shape, `${what}: shape`);
  assert.deepEqual(a.toArray(), b.toArray(), `${what}: values`);
}

test('round trip keeps dtype, shape, values and key order for every dtype', () => {
  const before = liveTensors();
  const src = everyDtype();
  const path = join(dir, 'all.safetensors');
  saveSafetensors(path, src, { format: 'pt', note: 'ünïcode ✓' });
  const { tensors, metadata } = loadSafetensorsWithMetadata(path);
  assert.deepEqual(Object.keys(tensors), Object.keys(src));
  for (const k of Object.keys(src)) sameTensor(tensors[k]!, src[k]!, k);
  assert.deepEqual(metadata, { format: 'pt', note: 'ünïcode ✓' });
  for (const t of [...Object.values(src), ...Object.values(tensors)]) t.dispose();
  assert.equal(liveTensors(), before, 'no handles leaked by save/load');
});

test('byte layout: u64 LE length, space-padded JSON header aligned to 8, data in order', () => {
  const a = tensor([1, 2, 3], { dtype: 'float32' });
  const b = tensor([7], { dtype: 'int64' });
  const path = join(dir, 'layout.safetensors');
  saveSafetensors(path, { b, a }, { k: 'v' });
  const raw = readFileSync(path);
  const n = Number(raw.readBigUInt64LE(0));
  assert.equal(n % 8, 0, 'header length is a multiple of 8');
  const text = raw.subarray(8, 8 + n).toString('utf8');
  assert.match(text, /^\{.*\} *$/s, 'JSON object then only spaces');
  const header = JSON.parse(text);
  assert.deepEqual(header.__metadata__, { k: 'v' });
  assert.deepEqual(header.b, { dtype: 'I64', shape: [1], data_offsets: [0, 8] });
  assert.deepEqual(header.a, { dtype: 'F32', shape: [3], data_offsets: [8, 20] });
  assert.equal(raw.length, 8 + n + 20);
  assert.equal(raw.readBigInt64LE(8 + n), 7n);
  assert.deepEqual([0, 1, 2].map((i) => raw.readFloatLE(8 + n + 8 + 4 * i)), [1, 2, 3]);
  // No metadata: no __metadata__ key at all.
  saveSafetensors(path, { a });
  const raw2 = readFileSync(path);
  assert.ok(!raw2.subarray(8, 8 + Number(raw2.readBigUInt64LE(0))).toString().includes('__metadata__'));
});

test('scalars, empty tensors, non-contiguous views and grad-requiring tensors', () => {
  const base = arange(0, 12).to('float32').view(3, 4);
  const src: Record<string, Tensor> = {
    scalar: tensor(new Float32Array([2.5]), { shape: [] }),
    empty: zeros([0, 3]),
    transposed: base.t(), // strides (1, 4): saved in C order of the view
    narrowed: base.narrow(1, 1, 2),
    param: randn([2, 2], { requiresGrad: true }),
  };
  const path = join(dir, 'odd.safetensors');
  saveSafetensors(path, src);
  const got = loadSafetensors(path);
  assert.deepEqual(got.scalar!.shape, []);
  assert.equal(got.scalar!.item(), 2.5);
  assert.deepEqual(got.empty!.shape, [0, 3]);
  assert.deepEqual(got.transposed!.toNumbers(), [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]);
  assert.deepEqual(got.narrowed!.toNumbers(), [1, 2, 5, 6, 9, 10]);
  sameTensor(got.param!, src.param!, 'param');
  assert.equal(got.param!.requiresGrad, false, 'loaded tensors are plain data');
  const h = readSafetensorsHeader(path);
  assert.deepEqual(h.tensors.empty, { dtype: 'float32', shape: [0, 3], dataOffsets: [4, 4] });
  assert.deepEqual(h.tensors.transposed!.shape, [4, 3]);
});

test('PyTorch reads our files (every dtype, metadata) and we read files PyTorch wrote', { skip: oracleMissing() }, () => {
  const src = everyDtype();
  const { tensors: out, metadata } = runOracle('roundtrip', src);
  const tmpMeta = JSON.parse(metadata.meta!);
  assert.deepEqual(tmpMeta, {});
  assert.deepEqual(JSON.parse(metadata.names!), Object.keys(src));
  const torchDtype: Record<DType, string> = {
    float32: 'torch.float32', float64: 'torch.float64', bfloat16: 'torch.bfloat16', float16: 'torch.float16', int64: 'torch.int64',
    int32: 'torch.int32', int16: 'torch.int16', int8: 'torch.int8', uint8: 'torch.uint8', bool: 'torch.bool',
  };
  assert.deepEqual(JSON.parse(metadata.dtypes!), Object.values(src).map((t) => torchDtype[t.dtype]));
  assert.deepEqual(JSON.parse(metadata.shapes!), Object.values(src).map((t) => t.shape));
  for (const [k, t] of Object.entries(src)) {
    const wide = t.dtype === 'int64' || t.dtype === 'int32' || t.dtype === 'int16' || t.dtype === 'int8' || t.dtype === 'uint8' || t.dtype === 'bool'
      ? t.to('int64') : t.to('float64');
    sameTensor(out[`value.${k}`]!, wide, `python saw ${k}`);
  }
});

test('refuses bad input before touching the disk; an existing file survives', () => {
  const path = join(dir, 'keep.safetensors');
  const a = tensor([1, 2], { dtype: 'float32' });
  saveSafetensors(path, { a });
  const before = readFileSync(path);
  const gone = tensor([3], { dtype: 'float32' });
  gone.dispose();
  assert.throws(() => saveSafetensors(path, { a, gone }), /tensor 'gone' was disposed/);
  assert.throws(() => saveSafetensors(path, { __metadata__: a }), /reserved/);
  assert.throws(() => saveSafetensors(path, { a }, { n: 3 as unknown as string }), /metadata value for 'n' must be a string/);
  assert.deepEqual(readFileSync(path), before);
  assert.throws(() => saveSafetensors(join(dir, 'no', 'such', 'dir', 'x.safetensors'), { a }), /could not write .*x\.safetensors/);
  assert.deepEqual(readdirSync(dir).filter((f) => f.endsWith('.tmp')), [], 'no temporary files left behind');
});

test('overwrites atomically: the new content replaces the old in one rename', () => {
  const path = join(dir, 'over.safetensors');
  saveSafetensors(path, { a: tensor([1], { dtype: 'float32' }) });
  saveSafetensors(path, { b: tensor([2, 3], { dtype: 'int32' }) });
  const got = loadSafetensors(path);
  assert.deepEqual(Object.keys(got), ['b']);
  assert.deepEqual(got.b!.toNumbers(), [2, 3]);
  assert.deepEqual(readdirSync(dir).filter((f) => f.endsWith('.tmp')), []);
});

test('damaged files give errors that say what is wrong', () => {
  const path = join(dir, 'good.safetensors');
  saveSafetensors(path, { w: tensor([1, 2, 3, 4], { dtype: 'float32' }), b: tensor([5], { dtype: 'int64' }) });
  const good = readFileSync(path);
  const n = Number(good.readBigUInt64LE(0));
  const bad = join(dir, 'bad.safetensors');
  const withBytes = (b: Buffer) => { writeFileSync(bad, b); return bad; };
  const header = (obj: unknown) => {
    const j = Buffer.from(JSON.stringify(obj));
    const len = Buffer.alloc(8);
    len.writeBigUInt64LE(BigInt(j.length));
    return Buffer.concat([len, j]);
  };

  assert.throws(() => loadSafetensors(withBytes(good.subarray(0, 5))), /bad\.safetensors is not a valid safetensors file: truncated: 5 bytes/);
  assert.throws(() => loadSafetensors(withBytes(good.subarray(0, 8 + n - 3))), /truncated: header needs \d+ bytes/);
  assert.throws(() => loadSafetensors(withBytes(good.subarray(0, good.length - 1))), /truncated: the header describes 24 bytes of tensor data, the file holds 23/);
  assert.throws(() => loadSafetensors(withBytes(Buffer.concat([good, Buffer.from([0])]))), /1 unexpected bytes after the last tensor/);
  const huge = Buffer.from(good);
  huge.writeBigUInt64LE(2n ** 60n, 0);
  assert.throws(() => loadSafetensors(withBytes(huge)), /header length \d+ is implausibly large/);
  const garbled = Buffer.from(good);
  garbled[12] = 0x7b; // '{' inside the JSON
  assert.throws(() => loadSafetensors(withBytes(garbled)), /header is not valid JSON/);
  assert.throws(() => loadSafetensors(withBytes(Buffer.concat([header({ x: { dtype: 'U64', shape: [1], data_offsets: [0, 8] } }), Buffer.alloc(8)]))),
    /tensor 'x' has dtype "U64"; supported: F32, F64, BF16/);
  assert.throws(() => loadSafetensors(withBytes(Buffer.concat([header({ x: { dtype: 'F32', shape: [3], data_offsets: [0, 8] } }), Buffer.alloc(8)]))),
    /tensor 'x' \(F32 \[3\]\) needs 12 bytes, data_offsets \[0, 8\] span 8/);
  assert.throws(() => loadSafetensors(withBytes(Buffer.concat([header({
    x: { dtype: 'F32', shape: [1], data_offsets: [0, 4] }, y: { dtype: 'F32', shape: [1], data_offsets: [8, 12] },
  }), Buffer.alloc(12)]))), /tensor 'y' starts at byte 8 of the data, expected 4 \(gap or overlap\)/);
  assert.throws(() => loadSafetensors(withBytes(Buffer.concat([header({ x: { dtype: 'F32', shape: [-1], data_offsets: [0, 4] } }), Buffer.alloc(4)]))),
    /shape \[-1\], expected a list of non-negative integers/);
  assert.throws(() => loadSafetensors(withBytes(Buffer.concat([header([1, 2]), Buffer.alloc(0)]))), /does not start with a JSON object/);
  assert.throws(() => loadSafetensors(join(dir, 'missing.safetensors')), /cannot read .*missing\.safetensors/);
  assert.throws(() => readSafetensorsHeader(withBytes(good.subarray(0, good.length - 2))), /truncated/);
  assert.throws(() => readSafetensorsHeader(join(dir, 'missing.safetensors')), /readSafetensorsHeader: cannot read/);
  // Still fine afterwards, and the good file loads.
  assert.deepEqual(loadSafetensors(path).w!.toNumbers(), [1, 2, 3, 4]);
});

test('encode/decode in memory agree with the file form', () => {
  const src = { a: randn([3, 2]), m: tensor([1, 0, 1], { dtype: 'bool' }) };
  const parts = encodeSafetensors(src, { x: 'y' });
  const { tensors, metadata } = decodeSafetensors(Buffer.concat(parts));
  sameTensor(tensors.a!, src.a, 'a');
  sameTensor(tensors.m!, src.m, 'm');
  assert.deepEqual(metadata, { x: 'y' });
  assert.ok(!existsSync(join(dir, 'a')));
});

test('async save and load give the same bytes and tensors as the sync ones', async () => {
  const src = everyDtype();
  const a = join(dir, 'sync.safetensors'), b = join(dir, 'async.safetensors');
  saveSafetensors(a, src, { m: '1' });
  await saveSafetensorsAsync(b, src, { m: '1' });
  assert.deepEqual(readFileSync(b), readFileSync(a));
  const { tensors, metadata } = await loadSafetensorsAsync(b);
  for (const k of Object.keys(src)) sameTensor(tensors[k]!, src[k]!, k);
  assert.deepEqual(metadata, { m: '1' });
  await assert.rejects(saveSafetensorsAsync(join(dir, 'nope', 'x.safetensors'), src), /could not write .*x\.safetensors/);
  await assert.rejects(loadSafetensorsAsync(join(dir, 'absent.safetensors')), /cannot read .*absent\.safetensors/);
  assert.deepEqual(readdirSync(dir).filter((f) => f.endsWith('.tmp')), []);
  for (const t of [...Object.values(src), ...Object.values(tensors)]) t.dispose();
});
