// Tensor creation: constant fills, ranges, random draws from the global seed, and copies of JS data.
import { native } from './native.js';
import { Tensor, run } from './tensor.js';
import { type DType, dtypeCode, elementSize, isFloating } from './dtype.js';

export interface CreateOptions {
  dtype?: DType;
  requiresGrad?: boolean;
}

function finish(t: Tensor, opts: CreateOptions): Tensor {
  if (opts.requiresGrad) t.requiresGrad = true;
  return t;
}

let defaultDtype: DType = 'float32';

/** The floating dtype that creation functions use when none is given (like torch.set_default_dtype). */
export function setDefaultDtype(d: DType): void {
  if (!isFloating(d)) throw new Error(`setDefaultDtype: ${d} is not a floating dtype (use float32, float64 or bfloat16)`);
  defaultDtype = d;
}
export function getDefaultDtype(): DType {
  return defaultDtype;
}

function code(opts: CreateOptions, fallback?: DType): number {
  return dtypeCode(opts.dtype ?? fallback ?? defaultDtype);
}

function checkShape(shape: readonly number[], what: string): number[] {
  for (const s of shape) {
    if (!Number.isInteger(s) || s < 0) throw new Error(`${what}: shape [${shape.join(', ')}] must hold non-negative integers`);
  }
  return [...shape];
}

export function zeros(shape: readonly number[], opts: CreateOptions = {}): Tensor {
  return finish(run('zeros', checkShape(shape, 'zeros'), code(opts)), opts);
}
export function ones(shape: readonly number[], opts: CreateOptions = {}): Tensor {
  return finish(run('ones', checkShape(shape, 'ones'), code(opts)), opts);
}
export function empty(shape: readonly number[], opts: CreateOptions = {}): Tensor {
  return finish(run('empty', checkShape(shape, 'empty'), code(opts)), opts);
}
/**
 * An uninitialised tensor whose storage is pages mapped for it alone ([Note: mapped storage] in
 * native/tensor.cc): freeing it, or resizing its storage to 0, gives the memory back to the OS at
 * once, and allocating it never grows the malloc heap. For large flat buffers that are allocated
 * and freed around each use (sharded buckets, collective staging), which would otherwise leave
 * bucket-sized holes that the next step's smaller tensors cannot fill. Every allocation costs a
 * page fault per 4 KiB touched, so not for small or short-lived tensors.
 */
export function emptyMapped(shape: readonly number[], opts: CreateOptions = {}): Tensor {
  return finish(new Tensor(native.emptyMapped(checkShape(shape, 'emptyMapped'), code(opts))), opts);
}
export function full(shape: readonly number[], value: number, opts: CreateOptions = {}): Tensor {
  return finish(run('full', checkShape(shape, 'full'), value, code(opts)), opts);
}
/** Values start, start+step, ... below end (int64 when all arguments are integers, as in PyTorch). */
export function arange(start: number, end?: number, step = 1, opts: CreateOptions = {}): Tensor {
  if (end === undefined) [start, end] = [0, start];
  const ints = [start, end, step].every(Number.isInteger);
  return finish(run('arange', start, end, step, code(opts, ints ? 'int64' : undefined)), opts);
}
/** Uniform [0, 1) from the global generator. */
export function rand(shape: readonly number[], opts: CreateOptions = {}): Tensor {
  return finish(run('rand', checkShape(shape, 'rand'), code(opts)), opts);
}
/** Standard normal from the global generator. */
export function randn(shape: readonly number[], opts: CreateOptions = {}): Tensor {
  return finish(run('randn', checkShape(shape, 'randn'), code(opts)), opts);
}
/** Integers uniform in [low, high). */
export function randint(low: number, high: number, shape: readonly number[], opts: CreateOptions = {}): Tensor {
  return finish(run('randint', low, high, checkShape(shape, 'randint'), code(opts, 'int64')), opts);
}
export function zerosLike(t: Tensor, opts: CreateOptions = {}): Tensor {
  return finish(run('zerosLike', t, opts.dtype ? dtypeCode(opts.dtype) : undefined), opts);
}
export function onesLike(t: Tensor, opts: CreateOptions = {}): Tensor {
  return finish(run('onesLike', t, opts.dtype ? dtypeCode(opts.dtype) : undefined), opts);
}
export function fullLike(t: Tensor, value: number, opts: CreateOptions = {}): Tensor {
  return finish(run('fullLike', t, value, opts.dtype ? dtypeCode(opts.dtype) : undefined), opts);
}
export function randnLike(t: Tensor, opts: CreateOptions = {}): Tensor {
  return finish(run('randnLike', t, opts.dtype ? dtypeCode(opts.dtype) : undefined), opts);
}
export function randLike(t: Tensor, opts: CreateOptions = {}): Tensor {
  return finish(run('randLike', t, opts.dtype ? dtypeCode(opts.dtype) : undefined), opts);
}

/** Seeds the global generator (rand, randn, dropout, init). */
export function manualSeed(seed: number): void {
  native.manualSeed(seed);
}

type Nested = number | boolean | Nested[];

function flattenNested(data: Nested, shape: number[], depth: number, out: (number | boolean)[]): void {
  if (Array.isArray(data)) {
    if (shape.length === depth) shape.push(data.length);
    else if (shape[depth] !== data.length) throw new Error('tensor(): ragged nested array (rows of different lengths)');
    for (const d of data) flattenNested(d, shape, depth + 1, out);
  } else {
    if (shape.length !== depth) throw new Error('tensor(): ragged nested array (mixed depths)');
    out.push(data);
  }
}

/**
 * Copies JS data into a new tensor. Typed arrays keep their type (pass shape to reshape); nested
 * arrays infer shape, and default to int64 when all integers, bool for booleans, else float32.
 */
export function tensor(data: Nested | ArrayBufferView, opts: CreateOptions & { shape?: readonly number[] } = {}): Tensor {
  if (ArrayBuffer.isView(data)) {
    const fromView: DType | undefined =
      data instanceof Float32Array ? 'float32' : data instanceof Float64Array ? 'float64' : data instanceof BigInt64Array ? 'int64'
        : data instanceof Int32Array ? 'int32' : data instanceof Int16Array ? 'int16' : data instanceof Int8Array ? 'int8'
          : data instanceof Uint8Array ? 'uint8' : undefined;
    if (!fromView) throw new Error('tensor(): unsupported typed array; use Float32Array, Float64Array, BigInt64Array, Int32Array, Int16Array, Int8Array or Uint8Array');
    const n = data.byteLength / elementSize(fromView);
    const shape = opts.shape ? checkShape(opts.shape, 'tensor') : [n];
    const t = new Tensor(native.fromBuffer(data, shape, dtypeCode(fromView)));
    if (opts.dtype && opts.dtype !== fromView) {
      const c = t.to(opts.dtype);
      t.dispose();
      return finish(c, opts);
    }
    return finish(t, opts);
  }
  const shape: number[] = [];
  const flat: (number | boolean)[] = [];
  flattenNested(data, shape, 0, flat);
  const inferred: DType = flat.length > 0 && flat.every((x) => typeof x === 'boolean') ? 'bool'
    : flat.every((x) => typeof x === 'number' && Number.isInteger(x)) && flat.length > 0 ? 'int64' : defaultDtype;
  const dtype = opts.dtype ?? inferred;
  const f64 = Float64Array.from(flat, (x) => Number(x));
  const t = new Tensor(native.fromBuffer(f64, shape, dtypeCode('float64')));
  if (dtype === 'float64') return finish(t, opts);
  const c = t.to(dtype);
  t.dispose();
  return finish(c, opts);
}

export function cat(tensors: Tensor[], dim = 0): Tensor {
  return run('cat', tensors, dim);
}
export function stack(tensors: Tensor[], dim = 0): Tensor {
  return run('stack', tensors, dim);
}
/** Elementwise choice: cond ? a : b. */
export function where(cond: Tensor, a: Tensor, b: Tensor): Tensor {
  return run('where', cond, a, b);
}
