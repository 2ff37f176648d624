// The Tensor class: a thin, typed face over an owned at::Tensor handle. Math is synchronous; views
// and in-place ops are named as in PyTorch (view, narrow, add_). Every new tensor joins the current
// tidy() scope.
import { native, type TensorHandle, type NativeValue } from './native.js';
import { callOp, type OpName } from './ops.js';
import { tidy, track } from './scope.js';
import { type DType, dtypeCode, dtypeFromCode, typedArrayFor, type TypedArray } from './dtype.js';

export type Shape = readonly number[];
export type TensorOrScalar = Tensor | number;

/** Turns op results (handles, lists, tuples) into Tensors. */
export function wrap(v: NativeValue): any {
  if (Array.isArray(v)) return v.map(wrap);
  if (typeof v === 'bigint') return new Tensor(v);
  return v;
}

// The GC backstop: a Tensor that is collected without dispose() releases its handle here. Tensors
// are meant to be freed by dispose()/tidy(); this only catches what slips through. Only a tensor
// that may outlive every scope is registered (escaped(), [Note: external memory] in scope.ts): a
// scope frees each of its tensors itself, and registering costs about a microsecond, as much as
// the native call of a small op.
const backstop = new FinalizationRegistry<TensorHandle>((h) => {
  native.release(h);
});

function unwrapArg(a: unknown): unknown {
  if (a instanceof Tensor) return a.handle;
  if (Array.isArray(a)) return a.map(unwrapArg);
  return a;
}

/** Runs a table op with Tensor arguments and wraps what comes back. */
export function run(name: OpName, ...args: unknown[]): any {
  return wrap(callOp(name, args.map(unwrapArg)));
}

/** Runs an in-place table op; the addon hands back self's own handle, so nothing new is wrapped. */
/** Sizes or dims given as separate numbers or as one list: PyTorch takes both (x.reshape(-1, V), x.reshape([-1, V])). */
type DimsArgs = [readonly number[]] | number[];

function dimsOf(args: DimsArgs, op: string): number[] {
  const [first] = args;
  if (args.length === 1 && Array.isArray(first)) return [...(first as readonly number[])];
  if (args.some((a) => Array.isArray(a))) throw new Error(`${op}: give the sizes as separate numbers or as one list, not both`);
  return args as number[];
}

function runInPlace(self: Tensor, name: OpName, ...args: unknown[]): Tensor {
  const h = self.handle;
  const out = callOp(name, [h, ...args.map(unwrapArg)]) as TensorHandle;
  if (out !== h) native.release(out);
  return self;
}

function normDim(dim: number, ndim: number): number {
  return dim < 0 ? dim + ndim : dim;
}

export class Tensor {
  private h: TensorHandle | undefined;
  private backstopped = false;

  constructor(handle: TensorHandle) {
    this.h = handle;
    track(this);
  }

  /** The native handle; throws if disposed. */
  get handle(): TensorHandle {
    if (this.h === undefined) throw new Error('tensor was disposed (used after dispose() or after its tidy() scope ended; a module call is a scope too: keep() what forward stores for later)');
    return this.h;
  }

  /** Frees the native tensor now (idempotent). Views of it stay valid: they hold the storage. */
  dispose(): void {
    if (this.h !== undefined) {
      if (this.backstopped) backstop.unregister(this);
      native.release(this.h);
      this.h = undefined;
    }
  }

  /** Called when the tensor may outlive every scope: V8 learns its native bytes ([Note: external memory]). */
  escaped(): void {
    if (this.h === undefined) return;
    if (!this.backstopped) {
      backstop.register(this, this.h, this);
      this.backstopped = true;
    }
    native.reportExternal(this.h);
  }

  get isDisposed(): boolean {
    return this.h === undefined;
  }

  // ---- metadata
  get shape(): number[] {
    return native.shape(this.handle);
  }
  get dtype(): DType {
    return dtypeFromCode(native.dtype(this.handle));
  }
  get ndim(): number {
    return this.shape.length;
  }
  size(dim?: number): number {
    const s = this.shape;
    if (dim === undefined) return s.reduce((a, b) => a * b, 1);
    return s[normDim(dim, s.length)]!;
  }
  numel(): number {
    return this.size();
  }
  stride(): number[] {
    return native.meta(this.handle)[4];
  }
  get storageOffset(): number {
    return native.meta(this.handle)[5];
  }
  /** Address of the first element (tests use it to prove storage is shared). */
  dataPtr(): bigint {
    return native.dataPtr(this.handle);
  }
  toString(): string {
    return `Tensor(${this.dtype}[${this.shape.join(', ')}])`;
  }

  // ---- autograd
  get requiresGrad(): boolean {
    return native.meta(this.handle)[2];
  }
  set requiresGrad(flag: boolean) {
    native.setRequiresGrad(this.handle, flag);
  }
  requiresGrad_(flag = true): this {
    native.setRequiresGrad(this.handle, flag);
    return this;
  }
  get isLeaf(): boolean {
    return native.meta(this.handle)[3];
  }
  get gradFn(): string | undefined {
    return native.gradFnName(this.handle);
  }
  /**
   * When set, reading .grad throws this message: a parallel wrapper that shards the gradient sets
   * it, so a caller never reads a partial or freed gradient (see [Note: gradient API]).
   */
  gradAccessError: string | undefined;
  /** The accumulated gradient (a new handle onto the same storage), or undefined. */
  get grad(): Tensor | undefined {
    if (this.gradAccessError !== undefined) throw new Error(this.gradAccessError);
    const g = native.getGrad(this.handle);
    return g === undefined ? undefined : new Tensor(g);
  }
  /** Sets .grad; a view of a flat buffer makes backward accumulate into that buffer in place. */
  set grad(g: Tensor | undefined) {
    native.setGrad(this.handle, g?.handle);
  }
  backward(gradient?: Tensor, opts: { retainGraph?: boolean } = {}): void {
    native.backward([this.handle], gradient ? [gradient.handle] : undefined, opts.retainGraph ?? false);
  }
  detach(): Tensor {
    return run('detach', this);
  }
  // ---- storage (sharded parameters: see src/parallel/flat_buffer.ts)
  /** Resizes the whole underlying storage to nbytes: 0 frees it while views keep their shapes. */
  resizeStorage_(nbytes: number): this {
    native.resizeStorage(this.handle, nbytes);
    return this;
  }
  /**
   * PyTorch's `p.data = src`: this tensor object becomes src's tensor (its dtype, shape and
   * storage), keeping its requiresGrad, so everything that holds this object (a module's field, maps
   * keyed by it) sees the new one. src is consumed: its object is disposed. Autograd hooks and
   * .grad set on the old tensor are not carried over: use it before anything registers them
   * (applyLora's baseDtype does, before a model is parallelized).
   */
  replaceData_(src: Tensor): this {
    if (src === this) return this;
    const flag = this.requiresGrad;
    const h = src.handle;
    if (src.backstopped) backstop.unregister(src);
    src.h = undefined;
    src.backstopped = false;
    const wasKept = this.backstopped;
    if (this.backstopped) backstop.unregister(this);
    native.release(this.handle);
    this.h = h;
    this.backstopped = false;
    if (wasKept) this.escaped();
    if (this.requiresGrad !== flag) native.setRequiresGrad(h, flag);
    return this;
  }
  /** Bytes the underlying storage holds now (0 when freed). */
  storageNbytes(): number {
    return native.storageNbytes(this.handle);
  }
  /** PyTorch's .data: the same storage without autograd history and with its own version counter. */
  variableData(): Tensor {
    return new Tensor(native.variableData(this.handle));
  }
  /**
   * Calls fn(grad) when this tensor's gradient is computed; fn may return a replacement. The call is
   * a scope of its own: the grad and whatever fn makes are freed when it returns, except what it
   * returns or keep()s. (Tracked by the enclosing scope instead, a training step's tidy, every
   * parameter's incoming gradient stayed alive to the step's end: data parallelism's readiness hook
   * made a step hold its weight gradients twice, about 84 MiB more for a 25M GPT.)
   */
  registerHook(fn: (grad: Tensor) => Tensor | void): () => void {
    const id = native.registerHook(this.handle, (g) => tidy(() => {
      const r = fn(new Tensor(g));
      return r instanceof Tensor ? r : undefined;
    })?.handle);
    return () => native.removeHook(this.handle, id);
  }
  /**
   * Calls fn after backward has accumulated this leaf's gradient into .grad: once per backward()
   * that reaches the leaf (the engine sums all of its uses in one graph first, so a tied weight fires
   * once, with both contributions in). Data parallelism uses it to start a bucket's reduction while
   * backward runs.
   */
  registerAccumulateGradHook(fn: () => void): () => void {
    const id = native.registerAccumulateGradHook(this.handle, fn);
    return () => native.removeAccumulateGradHook(id);
  }

  // ---- data out
  /** A copy of the elements in a typed array (bf16/f16 are converted to float32). */
  toArray(): TypedArray {
    const d = this.dtype;
    if (d === 'bfloat16' || d === 'float16') {
      const f = this.to('float32');
      const out = f.toArray();
      f.dispose();
      return out;
    }
    return typedArrayFor(d, native.toBuffer(this.handle));
  }
  /** Elements as plain numbers, flat. */
  toNumbers(): number[] {
    return Array.from(this.toArray() as ArrayLike<number | bigint>, (x) => Number(x));
  }
  item(): number {
    const v = callOp('item', [this.handle]);
    return typeof v === 'boolean' ? Number(v) : (v as number);
  }

  // ---- conversion
  to(dtype: DType): Tensor {
    return run('to', this, dtypeCode(dtype));
  }
  float(): Tensor {
    return this.to('float32');
  }
  double(): Tensor {
    return this.to('float64');
  }
  clone(): Tensor {
    return run('clone', this);
  }
  contiguous(): Tensor {
    return run('contiguous', this);
  }

  // ---- elementwise
  add(other: TensorOrScalar, alpha = 1): Tensor {
    return other instanceof Tensor ? run('add', this, other, alpha) : run('addScalar', this, other, alpha);
  }
  sub(other: TensorOrScalar, alpha = 1): Tensor {
    return other instanceof Tensor ? run('sub', this, other, alpha) : run('subScalar', this, other, alpha);
  }
  mul(other: TensorOrScalar): Tensor {
    return other instanceof Tensor ? run('mul', this, other) : run('mulScalar', this, other);
  }
  div(other: TensorOrScalar): Tensor {
    return other instanceof Tensor ? run('div', this, other) : run('divScalar', this, other);
  }
  pow(exponent: TensorOrScalar): Tensor {
    return exponent instanceof Tensor ? run('pow', this, exponent) : run('powScalar', this, exponent);
  }
  neg(): Tensor { return run('neg', this); }
  exp(): Tensor { return run('exp', this); }
  log(): Tensor { return run('log', this); }
  sqrt(): Tensor { return run('sqrt', this); }
  rsqrt(): Tensor { return run('rsqrt', this); }
  abs(): Tensor { return run('abs', this); }
  tanh(): Tensor { return run('tanh', this); }
  sigmoid(): Tensor { return run('sigmoid', this); }
  /** log(sigmoid(x)) without overflow for large |x| (DPO's loss). */
  logSigmoid(): Tensor { return run('logSigmoid', this); }
  relu(): Tensor { return run('relu', this); }
  /** approximate: 'none' (erf) or 'tanh' */
  gelu(approximate: 'none' | 'tanh' = 'none'): Tensor { return run('gelu', this, approximate); }
  silu(): Tensor { return run('silu', this); }
  sin(): Tensor { return run('sin', this); }
  cos(): Tensor { return run('cos', this); }
  reciprocal(): Tensor { return run('reciprocal', this); }
  sign(): Tensor { return run('sign', this); }
  square(): Tensor { return run('square', this); }
  /** this + value * t1 * t2, one pass (broadcasting). */
  addcmul(t1: Tensor, t2: Tensor, value = 1): Tensor { return run('addcmul', this, t1, t2, value); }
  maximum(other: Tensor): Tensor { return run('maximum', this, other); }
  minimum(other: Tensor): Tensor { return run('minimum', this, other); }
  softmax(dim: number): Tensor { return run('softmax', this, dim); }
  logSoftmax(dim: number): Tensor { return run('logSoftmax', this, dim); }

  // ---- comparison and selection
  eq(o: TensorOrScalar): Tensor { return o instanceof Tensor ? run('eq', this, o) : run('eqScalar', this, o); }
  ne(o: TensorOrScalar): Tensor { return o instanceof Tensor ? run('ne', this, o) : run('neScalar', this, o); }
  lt(o: TensorOrScalar): Tensor { return o instanceof Tensor ? run('lt', this, o) : run('ltScalar', this, o); }
  le(o: TensorOrScalar): Tensor { return o instanceof Tensor ? run('le', this, o) : run('leScalar', this, o); }
  gt(o: TensorOrScalar): Tensor { return o instanceof Tensor ? run('gt', this, o) : run('gtScalar', this, o); }
  ge(o: TensorOrScalar): Tensor { return o instanceof Tensor ? run('ge', this, o) : run('geScalar', this, o); }
  clamp(min?: number, max?: number): Tensor { return run('clamp', this, min, max); }
  isnan(): Tensor { return run('isnan', this); }
  isfinite(): Tensor { return run('isfinite', this); }
  logicalNot(): Tensor { return run('logicalNot', this); }
  logicalAnd(o: Tensor): Tensor { return run('logicalAnd', this, o); }
  logicalOr(o: Tensor): Tensor { return run('logicalOr', this, o); }
  any(): Tensor { return run('any', this); }
  all(): Tensor { return run('all', this); }
  maskedFill(mask: Tensor, value: number): Tensor { return run('maskedFill', this, mask, value); }

  // ---- linear algebra
  matmul(other: Tensor): Tensor { return run('matmul', this, other); }
  mm(other: Tensor): Tensor { return run('mm', this, other); }
  bmm(other: Tensor): Tensor { return run('bmm', this, other); }
  /** beta * this + alpha * (batch1 @ batch2), batched (torch.baddbmm); this broadcasts to the product's shape. */
  baddbmm(batch1: Tensor, batch2: Tensor, opts: { beta?: number; alpha?: number } = {}): Tensor { return run('baddbmm', this, batch1, batch2, opts.beta ?? 1, opts.alpha ?? 1); }

  // ---- reductions
  sum(dim?: number | number[], keepdim = false): Tensor {
    return dim === undefined ? run('sum', this) : run('sumDim', this, dim, keepdim);
  }
  mean(dim?: number | number[], keepdim = false): Tensor {
    return dim === undefined ? run('mean', this) : run('meanDim', this, dim, keepdim);
  }
  /** Without dim: the largest element. With dim: [values, indices]. */
  max(): Tensor;
  max(dim: number, keepdim?: boolean): [Tensor, Tensor];
  max(dim?: number, keepdim = false): Tensor | [Tensor, Tensor] {
    return dim === undefined ? run('max', this) : run('maxDim', this, dim, keepdim);
  }
  min(): Tensor;
  min(dim: number, keepdim?: boolean): [Tensor, Tensor];
  min(dim?: number, keepdim = false): Tensor | [Tensor, Tensor] {
    return dim === undefined ? run('min', this) : run('minDim', this, dim, keepdim);
  }
  amax(dim: number | number[], keepdim = false): Tensor { return run('amax', this, dim, keepdim); }
  amin(dim: number | number[], keepdim = false): Tensor { return run('amin', this, dim, keepdim); }
  argmax(dim?: number, keepdim = false): Tensor { return run('argmax', this, dim, keepdim); }
  argmin(dim?: number, keepdim = false): Tensor { return run('argmin', this, dim, keepdim); }
  /** Vector p-norm over dims (all elements by default); p = Infinity for the max-norm. */
  norm(p = 2, dim?: number | number[], keepdim = false): Tensor { return run('norm', this, p, dim, keepdim); }
  /** Variance with Bessel's correction unless unbiased = false. */
  var(dim?: number | number[], unbiased = true, keepdim = false): Tensor {
    return run('var', this, dim, unbiased ? 1 : 0, keepdim);
  }
  prod(): Tensor { return run('prod', this); }

  // ---- shape (views share storage with this tensor)
  view(shape: readonly number[]): Tensor;
  view(...shape: number[]): Tensor;
  view(...shape: DimsArgs): Tensor { return run('view', this, dimsOf(shape, 'view')); }
  /** A view of the same bytes as another dtype of equal element size (e.g. bfloat16 bits as float16). */
  viewAsDtype(dtype: DType): Tensor { return run('viewDtype', this, dtypeCode(dtype)); }
  /** True when the elements are dense and row-major. */
  isContiguous(): boolean {
    const [shape, , , , strides] = native.meta(this.handle);
    let expected = 1;
    for (let i = shape.length - 1; i >= 0; i--) {
      if (shape[i] !== 1 && strides[i] !== expected) return false;
      expected *= shape[i]!;
    }
    return true;
  }
  reshape(shape: readonly number[]): Tensor;
  reshape(...shape: number[]): Tensor;
  reshape(...shape: DimsArgs): Tensor { return run('reshape', this, dimsOf(shape, 'reshape')); }
  permute(dims: readonly number[]): Tensor;
  permute(...dims: number[]): Tensor;
  permute(...dims: DimsArgs): Tensor { return run('permute', this, dimsOf(dims, 'permute')); }
  transpose(dim0: number, dim1: number): Tensor { return run('transpose', this, dim0, dim1); }
  /** Transpose of a 2-D tensor. */
  t(): Tensor { return this.transpose(0, 1); }
  /** A view of `length` elements along dim starting at start. */
  narrow(dim: number, start: number, length: number): Tensor { return run('narrow', this, dim, start, length); }
  /** A view [start, end) along dim with a step, like x[start:end:step]. */
  slice(dim: number, start?: number, end?: number, step = 1): Tensor { return run('slice', this, dim, start, end, step); }
  select(dim: number, index: number): Tensor { return run('select', this, dim, index); }
  split(splitSize: number | number[], dim = 0): Tensor[] {
    return Array.isArray(splitSize) ? run('splitSizes', this, splitSize, dim) : run('split', this, splitSize, dim);
  }
  chunk(chunks: number, dim = 0): Tensor[] { return run('chunk', this, chunks, dim); }
  /** The slices along dim, as views (x.unbind(0) = [x[0], x[1], ...]). */
  unbind(dim = 0): Tensor[] { return run('unbind', this, dim); }
  flatten(startDim = 0, endDim = -1): Tensor { return run('flatten', this, startDim, endDim); }
  squeeze(dim?: number): Tensor { return dim === undefined ? run('squeeze', this) : run('squeezeDim', this, dim); }
  unsqueeze(dim: number): Tensor { return run('unsqueeze', this, dim); }
  expand(shape: readonly number[]): Tensor;
  expand(...shape: number[]): Tensor;
  expand(...shape: DimsArgs): Tensor { return run('expand', this, dimsOf(shape, 'expand')); }
  indexSelect(dim: number, index: Tensor): Tensor { return run('indexSelect', this, dim, index); }
  gather(dim: number, index: Tensor): Tensor { return run('gather', this, dim, index); }
  /** Sorted values and their indices along dim; stable, so equal values keep their order (lower index first). */
  sort(dim = -1, descending = false): [Tensor, Tensor] { return run('sortStable', this, true, dim, descending); }
  /** A copy of this with source's rows added at index along dim (rows of one index summed). */
  indexAdd(dim: number, index: Tensor, source: Tensor): Tensor { return run('indexAdd', this, dim, index, source, 1); }
  repeat(repeats: readonly number[]): Tensor;
  repeat(...repeats: number[]): Tensor;
  repeat(...repeats: DimsArgs): Tensor { return run('repeat', this, dimsOf(repeats, 'repeat')); }
  tril(diagonal = 0): Tensor { return run('tril', this, diagonal); }
  triu(diagonal = 0): Tensor { return run('triu', this, diagonal); }
  flip(dims: readonly number[]): Tensor;
  flip(...dims: number[]): Tensor;
  flip(...dims: DimsArgs): Tensor { return run('flip', this, dimsOf(dims, 'flip')); }

  // ---- in-place (named with a trailing underscore; they return this)
  add_(other: TensorOrScalar, alpha = 1): this {
    runInPlace(this, other instanceof Tensor ? 'add_' : 'addScalar_', other, alpha);
    return this;
  }
  sub_(other: Tensor, alpha = 1): this { runInPlace(this, 'sub_', other, alpha); return this; }
  mul_(other: TensorOrScalar): this { runInPlace(this, other instanceof Tensor ? 'mul_' : 'mulScalar_', other); return this; }
  div_(other: TensorOrScalar): this { runInPlace(this, other instanceof Tensor ? 'div_' : 'divScalar_', other); return this; }
  /** this += value * t1 * t2 */
  addcmul_(t1: Tensor, t2: Tensor, value = 1): this { runInPlace(this, 'addcmul_', t1, t2, value); return this; }
  /** this += value * t1 / t2 */
  addcdiv_(t1: Tensor, t2: Tensor, value = 1): this { runInPlace(this, 'addcdiv_', t1, t2, value); return this; }
  /** this += weight * (end - this) */
  lerp_(end: Tensor, weight: TensorOrScalar): this {
    runInPlace(this, weight instanceof Tensor ? 'lerpTensor_' : 'lerp_', end, weight);
    return this;
  }
  copy_(src: Tensor): this { runInPlace(this, 'copy_', src); return this; }
  zero_(): this { runInPlace(this, 'zero_'); return this; }
  fill_(value: number): this { runInPlace(this, 'fill_', value); return this; }
  clamp_(min?: number, max?: number): this { runInPlace(this, 'clamp_', min, max); return this; }
  sqrt_(): this { runInPlace(this, 'sqrt_'); return this; }
  maskedFill_(mask: Tensor, value: number): this { runInPlace(this, 'maskedFill_', mask, value); return this; }
  /** Fills with N(mean, std) from the global generator. */
  normal_(mean = 0, std = 1): this { runInPlace(this, 'normal_', mean, std); return this; }
  uniform_(from = 0, to = 1): this { runInPlace(this, 'uniform_', from, to); return this; }
  /**
   * Re-points this tensor at source's storage, sizes and strides (under noGrad for leaves). Flat
   * parameter buffers use it to make an existing parameter a view of one contiguous block.
   */
  set_(source: Tensor): this { runInPlace(this, 'set_', source); return this; }
}
