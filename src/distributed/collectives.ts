// Collectives over one native process group (Gloo or MPI), and the Work handle they return.
//
// The addon exposes c10d's primitives as they are; this file decides how each public collective is
// built from them:
//   - Gloo (libtorch 1.13) has no reduce_scatter / _reduce_scatter_base / _allgather_base. The native
//     op is tried once per group and, when the backend says it has no support, never again: then
//     reduce-scatter is all-to-all plus a local sum (each rank sends (size-1)/size of its input, the
//     same bytes a ring reduce-scatter moves) and all-gather-into is the list form into views of the
//     output.
//   - Gloo has no AVG: 'avg' scales by 1/size then sums (allReduce scales its input; reduceScatter
//     scales the chunks it received, so both compute sum_i(x_i / size)).
//   - Gloo 1.13 has no bfloat16 and no bool. Data movement (broadcast, gathers, all-to-all, send/recv)
//     sends bfloat16 as its bits viewed as float16 and bool as uint8, without a copy; reductions convert bfloat16
//     to float32 and back (more accurate than a bfloat16 ring), and bool reduces as uint8 (sum and
//     max = logical or; product and min = logical and).
//   - Gloo needs contiguous tensors: a non-contiguous argument is staged through a contiguous copy
//     and, when it is an output, copied back once the collective completes.
//   - The MPI backend (mpi.ts) has native reduce-scatter and all-gather-into, the same 'avg' by
//     scaling, and no float16 reduction type: float16 reduces in float32 there, like bfloat16. Its
//     buffers are contiguous too, so the same staging serves both backends.
// Every temporary is kept out of the caller's tidy() scope (the collective may outlive it) and is
// disposed when the Work completes.
import { native, type GroupHandle, type WorkHandle, type NativeReduceOp } from '../tensor/native.js';
import { Tensor, keep, empty, emptyMapped, elementSize, type DType, isFloating } from '../tensor/index.js';
import { dtypeCode, dtypeFromCode } from '../tensor/dtype.js';
import { tellLauncher } from './launcher_channel.js';

/** Staging at least this large is allocated on mapped pages (see reduceScatter). */
const MAPPED_STAGING_BYTES = 2 ** 20;

export type ReduceOp = 'sum' | 'avg' | 'max' | 'min' | 'product';
export const REDUCE_OPS: readonly ReduceOp[] = ['sum', 'avg', 'max', 'min', 'product'];

/** What a collective needs to know about its group. */
export interface GroupContext {
  readonly name: string;
  readonly rank: number;
  readonly size: number;
  /** Global ranks of the members, in group-rank order. */
  readonly ranks: readonly number[];
  readonly timeoutMs: number;
  /** The native group (Gloo, or MPI through mpi.ts); undefined for a group of one (collectives are local). */
  readonly handle: GroupHandle | undefined;
  /** Which backend runs the group's collectives. */
  readonly backend: 'gloo' | 'mpi' | 'local';
  /** Native ops found missing on this backend (probed once, on first use). */
  readonly unsupported: Set<string>;
}

/** A collective failed or timed out. Names the op, the group and its global ranks. */
export class CollectiveError extends Error {
  readonly op: string;
  readonly group: string;
  readonly ranks: readonly number[];
  constructor(op: string, ctx: GroupContext, detail: string, cause?: unknown) {
    super(`${op} on group '${ctx.name}' (global ranks [${ctx.ranks.join(', ')}]) failed: ${detail}`, cause === undefined ? undefined : { cause });
    this.name = 'CollectiveError';
    this.op = op;
    this.group = ctx.name;
    this.ranks = ctx.ranks;
  }
}

/** A bad argument to a collective, raised before anything is sent. */
export class CollectiveArgumentError extends Error {
  constructor(op: string, ctx: GroupContext, detail: string) {
    super(`${op} on group '${ctx.name}' (size ${ctx.size}): ${detail}`);
    this.name = 'CollectiveArgumentError';
  }
}

function messageOf(e: unknown): string {
  return e instanceof Error ? e.message : String(e);
}

// ---------------------------------------------------------------------------------------------
// Temporaries

/** Tensors a collective created for itself: kept out of tidy() scopes, disposed when it completes. */
class Temps {
  private readonly list: Tensor[] = [];
  add(t: Tensor): Tensor {
    keep(t);
    this.list.push(t);
    return t;
  }
  dispose(): void {
    for (const t of this.list) t.dispose();
    this.list.length = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// Work

/**
 * One collective in flight. wait() blocks until it is done; waitAsync() does not block the event
 * loop; isCompleted() polls. Whichever sees completion first finishes the collective's local part
 * (copy-back, the local sum of a reduce-scatter), so the output is ready whenever any of them says so.
 * On failure or timeout each of them throws a CollectiveError naming op, group and global ranks.
 */
export class Work {
  private state: 'pending' | 'done' | 'failed' = 'pending';
  private error: CollectiveError | undefined;
  private asyncWait: Promise<void> | undefined;

  /** @internal Collectives construct Work; user code receives it. */
  constructor(
    private readonly op: string,
    private readonly ctx: GroupContext,
    private readonly handle: WorkHandle | undefined,
    private readonly finishFn: (() => void) | undefined,
    private readonly temps: Temps | undefined,
  ) {
    if (handle === undefined) this.complete();
  }

  /** A Work that is already complete (local collectives of a one-rank group). */
  static done(op: string, ctx: GroupContext): Work {
    return new Work(op, ctx, undefined, undefined, undefined);
  }

  /** Blocks until the collective is done; throws CollectiveError on failure or timeout. */
  wait(): void {
    if (this.state === 'pending') {
      try {
        // Gloo's own timeout (the group's) fires first when a peer stops; this bound is a backstop.
        this.handle!.wait(2 * this.ctx.timeoutMs + 5000);
      } catch (e) {
        this.fail(e);
      }
      if (this.state === 'pending') this.complete();
    }
    if (this.state === 'failed') throw this.error!;
  }

  /** Resolves when the collective is done (without blocking the event loop); rejects like wait(). */
  waitAsync(): Promise<void> {
    if (this.state !== 'pending') return this.state === 'done' ? Promise.resolve() : Promise.reject(this.error!);
    this.asyncWait ??= this.handle!.waitAsync().then(
      () => {
        if (this.state === 'pending') this.complete();
        if (this.state === 'failed') throw this.error!;
      },
      (e: unknown) => {
        if (this.state === 'pending') this.fail(e);
        if (this.state === 'failed') throw this.error!;
      },
    );
    return this.asyncWait;
  }

  /** True once the collective has finished (successfully or not); wait() then returns or throws at once. */
  isCompleted(): boolean {
    if (this.state !== 'pending') return true;
    let finished: boolean;
    try {
      finished = this.handle!.isCompleted();
    } catch (e) {
      this.fail(e);
      return true;
    }
    if (!finished) return false;
    try {
      this.handle!.wait(0); // returns at once; rethrows the collective's error, if any
    } catch (e) {
      this.fail(e);
      return true;
    }
    if (this.state === 'pending') this.complete();
    return true;
  }

  private complete(): void {
    this.handle?.release(); // the native Work pins the group's Gloo context until released
    try {
      this.finishFn?.();
      this.state = 'done';
    } catch (e) {
      this.state = 'failed';
      this.error = new CollectiveError(this.op, this.ctx, `finishing locally: ${messageOf(e)}`, e);
    } finally {
      this.temps?.dispose();
    }
  }

  private fail(e: unknown): void {
    this.state = 'failed';
    let detail = messageOf(e);
    if (/Operation timed out|Timed out/i.test(detail)) {
      detail = `timed out (process-group timeout ${this.ctx.timeoutMs} ms): ${detail}`;
      tellLauncher({ event: 'timeout', op: this.op, group: this.ctx.name }); // so it names the rank waited for
    }
    this.error = new CollectiveError(this.op, this.ctx, detail, e);
    this.handle?.release();
    this.temps?.dispose();
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor plumbing

/** A view of t's bytes as another dtype of the same element size. */
function viewAs(t: Tensor, dtype: DType): Tensor {
  return t.viewAsDtype(dtype);
}

/** True when t's elements are dense and row-major (what Gloo requires). */
export function isContiguous(t: Tensor): boolean {
  return t.isContiguous();
}

/**
 * The dtype bytes travel as in data-movement collectives. Gloo 1.13 moves neither bfloat16 nor
 * int16, so bfloat16 travels as float16 bits (a pure copy: no arithmetic touches them).
 */
function movementDtype(d: DType): DType {
  return d === 'bfloat16' ? 'float16' : d === 'bool' ? 'uint8' : d;
}

/**
 * The dtype a reduction runs in, and whether it needs a converting copy (vs. a bit view). MPI has no
 * float16 reduction type either, so there float16 reduces in float32 too.
 */
function reductionDtype(d: DType, backend: GroupContext['backend']): { dtype: DType; convert: boolean } {
  if (d === 'bfloat16' || (d === 'float16' && backend === 'mpi')) return { dtype: 'float32', convert: true };
  if (d === 'bool') return { dtype: 'uint8', convert: false };
  return { dtype: d, convert: false };
}

interface Staging {
  temps: Temps;
  backend: GroupContext['backend'];
  /** (destination, staged) pairs copied back when the collective completes. */
  copyBack: [Tensor, Tensor][];
}

function newStaging(ctx: GroupContext): Staging {
  return { temps: new Temps(), copyBack: [], backend: ctx.backend };
}

/**
 * The tensor handed to Gloo for `t`: t itself when Gloo takes it as it is, else a bit view or a
 * contiguous copy. Outputs staged through a copy are copied back on completion.
 */
function wireFor(t: Tensor, kind: 'movement' | 'reduction', role: 'input' | 'output' | 'inout', s: Staging): Tensor {
  const [shape, code, , , strides] = native.meta(t.handle); // one native call: this runs per collective
  const d = dtypeFromCode(code);
  let wire = t;
  if (kind === 'reduction' && reductionDtype(d, s.backend).convert) {
    wire = s.temps.add(t.to(reductionDtype(d, s.backend).dtype));
    if (!isContiguous(wire)) wire = s.temps.add(wire.contiguous());
    if (role !== 'input') s.copyBack.push([t, wire]);
    return wire;
  }
  const wd = kind === 'movement' ? movementDtype(d) : reductionDtype(d, s.backend).dtype;
  if (wd !== d) wire = s.temps.add(viewAs(t, wd));
  if (!wire.isContiguous()) {
    const staged = s.temps.add(wire.contiguous());
    if (role !== 'input') s.copyBack.push([wire, staged]);
    wire = staged;
  }
  return wire;
}

function finishStaging(s: Staging, extra?: () => void): () => void {
  return () => {
    extra?.();
    for (const [dst, src] of s.copyBack) dst.copy_(src);
  };
}

/** Copies src's elements, in row-major order, into dst (same numel, any shapes and strides). */
function copyInto(dst: Tensor, src: Tensor): void {
  const flat = src.reshape(-1);
  const shaped = flat.view(...dst.shape);
  dst.copy_(shaped);
  shaped.dispose();
  flat.dispose();
}

/** Issues a native collective; a synchronous native error becomes a CollectiveError. */
function issue(op: string, ctx: GroupContext, s: Staging, start: () => WorkHandle, extra?: () => void): Work {
  let h: WorkHandle;
  try {
    h = start();
  } catch (e) {
    s.temps.dispose();
    throw new CollectiveError(op, ctx, messageOf(e), e);
  }
  return new Work(op, ctx, h, finishFn(s, extra), s.temps);
}

function finishFn(s: Staging, extra?: () => void): (() => void) | undefined {
  return s.copyBack.length === 0 && extra === undefined ? undefined : finishStaging(s, extra);
}

/** Calls a native op the backend may lack; remembers a "no support" answer for the group. */
function tryNative(ctx: GroupContext, key: string, start: () => WorkHandle): WorkHandle | undefined {
  if (ctx.unsupported.has(key)) return undefined;
  try {
    return start();
  } catch (e) {
    if (/support/i.test(messageOf(e))) {
      ctx.unsupported.add(key);
      return undefined;
    }
    throw e;
  }
}

// ---------------------------------------------------------------------------------------------
// Argument checks

function checkTensor(op: string, ctx: GroupContext, t: unknown, what: string): asserts t is Tensor {
  if (!(t instanceof Tensor)) throw new CollectiveArgumentError(op, ctx, `${what} must be a Tensor`);
  if (t.isDisposed) throw new CollectiveArgumentError(op, ctx, `${what} was disposed`);
}

function checkPeer(op: string, ctx: GroupContext, r: unknown, what: string): number {
  if (typeof r !== 'number' || !Number.isInteger(r) || r < 0 || r >= ctx.size) {
    throw new CollectiveArgumentError(op, ctx, `${what} ${String(r)} is not a group rank (0..${ctx.size - 1}; group ranks, not global ranks)`);
  }
  return r;
}

function checkSameDtype(op: string, ctx: GroupContext, a: Tensor, b: Tensor, what: string): void {
  if (a.dtype !== b.dtype) throw new CollectiveArgumentError(op, ctx, `${what} dtype ${b.dtype} differs from input dtype ${a.dtype}`);
}

function checkReduceOp(op: string, ctx: GroupContext, r: unknown, allowed: readonly ReduceOp[]): ReduceOp {
  if (!allowed.includes(r as ReduceOp)) {
    throw new CollectiveArgumentError(op, ctx, `unknown reduce op '${String(r)}' (expected ${allowed.join(', ')})`);
  }
  return r as ReduceOp;
}

function checkAvg(op: string, ctx: GroupContext, t: Tensor): void {
  if (!isFloating(t.dtype)) {
    throw new CollectiveArgumentError(op, ctx, `'avg' needs a floating-point tensor, got ${t.dtype} (scaling integers by 1/size would truncate; reduce with 'sum' and divide)`);
  }
}

// ---------------------------------------------------------------------------------------------
// The collectives

export function allReduce(ctx: GroupContext, t: Tensor, op: ReduceOp = 'sum'): Work {
  const name = 'allReduce';
  checkTensor(name, ctx, t, 'tensor');
  checkReduceOp(name, ctx, op, REDUCE_OPS);
  if (op === 'avg') checkAvg(name, ctx, t);
  if (ctx.handle === undefined) return Work.done(name, ctx);
  let nativeOp: NativeReduceOp = op === 'avg' ? 'sum' : op;
  if (t.dtype === 'bool') nativeOp = op === 'sum' || op === 'max' ? 'max' : 'min';
  const s = newStaging(ctx);
  const wire = wireFor(t, 'reduction', 'inout', s);
  if (op === 'avg') wire.mul_(1 / ctx.size);
  const handle = ctx.handle;
  return issue(name, ctx, s, () => handle.allreduce([wire.handle], nativeOp));
}

export function broadcast(ctx: GroupContext, t: Tensor, src: number): Work {
  const name = 'broadcast';
  checkTensor(name, ctx, t, 'tensor');
  checkPeer(name, ctx, src, 'src');
  if (ctx.handle === undefined) return Work.done(name, ctx);
  const s = newStaging(ctx);
  const wire = wireFor(t, 'movement', ctx.rank === src ? 'input' : 'output', s);
  const handle = ctx.handle;
  return issue(name, ctx, s, () => handle.broadcast([wire.handle], src));
}

export function allGather(ctx: GroupContext, outputs: Tensor[], input: Tensor): Work {
  const name = 'allGather';
  checkTensor(name, ctx, input, 'input');
  if (!Array.isArray(outputs) || outputs.length !== ctx.size) {
    throw new CollectiveArgumentError(name, ctx, `needs one output tensor per group rank (${ctx.size}), got ${Array.isArray(outputs) ? outputs.length : typeof outputs}`);
  }
  const shape = input.shape;
  outputs.forEach((o, i) => {
    checkTensor(name, ctx, o, `outputs[${i}]`);
    checkSameDtype(name, ctx, input, o, `outputs[${i}]`);
    const os = o.shape;
    if (os.length !== shape.length || os.some((n, k) => n !== shape[k])) {
      throw new CollectiveArgumentError(name, ctx, `outputs[${i}] has shape [${os.join(', ')}], input has [${shape.join(', ')}]; they must match`);
    }
  });
  if (ctx.handle === undefined) {
    outputs[0]!.copy_(input);
    return Work.done(name, ctx);
  }
  const s = newStaging(ctx);
  const inWire = wireFor(input, 'movement', 'input', s);
  const outWires = outputs.map((o) => wireFor(o, 'movement', 'output', s));
  const handle = ctx.handle;
  return issue(name, ctx, s, () => handle.allgather([outWires.map((w) => w.handle)], [inWire.handle]));
}

export function allGatherInto(ctx: GroupContext, output: Tensor, input: Tensor): Work {
  const name = 'allGatherInto';
  checkTensor(name, ctx, input, 'input');
  checkTensor(name, ctx, output, 'output');
  checkSameDtype(name, ctx, input, output, 'output');
  const n = input.numel();
  if (output.numel() !== ctx.size * n) {
    throw new CollectiveArgumentError(name, ctx, `output has ${output.numel()} elements but needs size × input.numel() = ${ctx.size} × ${n} = ${ctx.size * n}`);
  }
  if (ctx.handle === undefined) {
    copyInto(output, input);
    return Work.done(name, ctx);
  }
  const s = newStaging(ctx);
  const inFlat = s.temps.add(wireFor(input, 'movement', 'input', s).reshape(-1));
  const outFlat = s.temps.add(wireFor(output, 'movement', 'output', s).reshape(-1));
  const handle = ctx.handle;
  return issue(name, ctx, s, () => {
    const h = tryNative(ctx, 'allgatherBase', () => handle.allgatherBase(outFlat.handle, inFlat.handle));
    if (h) return h;
    const views = Array.from({ length: ctx.size }, (_, i) => s.temps.add(outFlat.narrow(0, i * n, n)));
    return handle.allgather([views.map((v) => v.handle)], [inFlat.handle]);
  });
}

export function reduceScatter(ctx: GroupContext, output: Tensor, input: Tensor, op: 'sum' | 'avg' = 'sum'): Work {
  const name = 'reduceScatter';
  checkTensor(name, ctx, input, 'input');
  checkTensor(name, ctx, output, 'output');
  checkReduceOp(name, ctx, op, ['sum', 'avg']);
  checkSameDtype(name, ctx, input, output, 'output');
  if (op === 'avg') checkAvg(name, ctx, input);
  if (input.dtype === 'bool') throw new CollectiveArgumentError(name, ctx, 'bool tensors cannot be reduce-scattered; use uint8');
  const n = output.numel();
  const total = input.numel();
  if (total !== ctx.size * n) {
    const hint = total % ctx.size === 0
      ? `output must have input.numel() / size = ${total / ctx.size} elements`
      : `${total} does not divide into ${ctx.size} equal shards: pad the input to ${Math.ceil(total / ctx.size) * ctx.size} elements`;
    throw new CollectiveArgumentError(name, ctx, `input has ${total} elements but the output has ${n}, and the input must hold size × output.numel() = ${ctx.size * n}; ${hint}`);
  }
  if (ctx.handle === undefined) {
    copyInto(output, input);
    return Work.done(name, ctx);
  }
  const handle = ctx.handle;
  const size = ctx.size;

  // Native path (backends that have it): reduce a flat wire copy of the input into the output.
  if (!ctx.unsupported.has('reduceScatterBase')) {
    const s = newStaging(ctx);
    let inWire = wireFor(input, 'reduction', 'input', s);
    if (op === 'avg') inWire = s.temps.add(inWire.mul(1 / size));
    const inFlat = s.temps.add(inWire.reshape(-1));
    const outFlat = s.temps.add(wireFor(output, 'reduction', 'output', s).reshape(-1));
    let h: WorkHandle | undefined;
    try {
      h = tryNative(ctx, 'reduceScatterBase', () => handle.reduceScatterBase(outFlat.handle, inFlat.handle, 'sum'));
    } catch (e) {
      s.temps.dispose();
      throw new CollectiveError(name, ctx, messageOf(e), e);
    }
    if (h) return new Work(name, ctx, h, finishFn(s), s.temps);
    s.temps.dispose();
  }

  // Two ranks, a float sum: each rank sends the chunk the other owns and receives the other's part of
  // its own chunk straight into the output, then adds its own part: no staging, where the general
  // path below stages the whole input (ZeRO-2/3's reduce-scatters are in flight while backward
  // runs, so that staging was peak memory). Two addends, so the result has the same bits as the
  // general path's sum in rank order (IEEE addition is commutative).
  const dtype = input.dtype;
  if (size === 2 && op === 'sum' && (dtype === 'float32' || dtype === 'float64') && output.dtype === dtype && output.isContiguous() && input.isContiguous()) {
    const s = newStaging(ctx);
    const flat = s.temps.add(input.reshape(-1));
    const own = s.temps.add(flat.narrow(0, ctx.rank * n, n));
    const theirs = s.temps.add(flat.narrow(0, (1 - ctx.rank) * n, n));
    const out = s.temps.add(output.view(-1));
    // alltoallv with nothing sent to or received from oneself.
    const splits = ctx.rank === 0 ? [0, n] : [n, 0];
    return issue(name, ctx, s, () => handle.alltoallBase(out.handle, theirs.handle, splits, splits), () => {
      out.add_(own);
    });
  }

  // All-to-all then a local sum: chunk j of every rank's input lands on rank j.
  const s = newStaging(ctx);
  const inFlat = s.temps.add(wireFor(input, 'movement', 'input', s).reshape(-1));
  // Bucket-sized staging that lives for one collective: on mapped pages, so it goes back to the OS
  // when the collective completes ([Note: mapped storage] in native/tensor.cc).
  const recv = s.temps.add(total * elementSize(inFlat.dtype) >= MAPPED_STAGING_BYTES ? emptyMapped([total], { dtype: inFlat.dtype }) : empty([total], { dtype: inFlat.dtype }));
  const finishLocal = (): void => {
    let chunks = s.temps.add(movementDtype(dtype) === dtype ? recv.view(size, n) : s.temps.add(viewAs(recv, dtype)).view(size, n));
    // Half-precision chunks are summed in float32, then rounded once.
    if (dtype === 'bfloat16' || dtype === 'float16') chunks = s.temps.add(chunks.to('float32'));
    if (op === 'avg') chunks.mul_(1 / size);
    if (chunks.dtype === output.dtype && output.isContiguous()) {
      const out = s.temps.add(output.view(-1));
      // Summed into the output in place, in rank order (as sum(0) adds them): no shard-sized
      // temporary left behind on the heap.
      out.copy_(s.temps.add(chunks.select(0, 0)));
      for (let k = 1; k < size; k++) out.add_(s.temps.add(chunks.select(0, k)));
      return;
    }
    const sum = s.temps.add(chunks.sum(0));
    output.copy_(s.temps.add(sum.view(...output.shape)));
  };
  return issue(name, ctx, s, () => handle.alltoallBase(recv.handle, inFlat.handle, [], []), finishLocal);
}

function checkSplits(op: string, ctx: GroupContext, splits: number[] | undefined, dim0: number, what: string): number[] {
  if (splits === undefined || splits.length === 0) {
    if (dim0 % ctx.size !== 0) {
      throw new CollectiveArgumentError(op, ctx, `${what} dim 0 (${dim0}) does not divide into ${ctx.size} equal splits; pass ${what === 'output' ? 'outSplits' : 'inSplits'}`);
    }
    return [];
  }
  if (splits.length !== ctx.size || splits.some((x) => !Number.isInteger(x) || x < 0)) {
    throw new CollectiveArgumentError(op, ctx, `${what} splits [${splits.join(', ')}] must be ${ctx.size} non-negative integers`);
  }
  const sum = splits.reduce((a, b) => a + b, 0);
  if (sum !== dim0) throw new CollectiveArgumentError(op, ctx, `${what} splits sum to ${sum} but ${what} dim 0 is ${dim0}`);
  return splits;
}

export function allToAll(ctx: GroupContext, output: Tensor, input: Tensor, outSplits?: number[], inSplits?: number[]): Work {
  const name = 'allToAll';
  checkTensor(name, ctx, input, 'input');
  checkTensor(name, ctx, output, 'output');
  checkSameDtype(name, ctx, input, output, 'output');
  if (input.ndim === 0 || output.ndim === 0) throw new CollectiveArgumentError(name, ctx, 'input and output need at least one dim (splits are along dim 0)');
  const outS = checkSplits(name, ctx, outSplits, output.shape[0]!, 'output');
  const inS = checkSplits(name, ctx, inSplits, input.shape[0]!, 'input');
  if (ctx.handle === undefined) {
    if (output.numel() !== input.numel()) throw new CollectiveArgumentError(name, ctx, `output has ${output.numel()} elements, input ${input.numel()}; a group of one keeps them all`);
    copyInto(output, input);
    return Work.done(name, ctx);
  }
  const s = newStaging(ctx);
  const inWire = wireFor(input, 'movement', 'input', s);
  const outWire = wireFor(output, 'movement', 'output', s);
  const handle = ctx.handle;
  return issue(name, ctx, s, () => handle.alltoallBase(outWire.handle, inWire.handle, outS, inS));
}

function checkTag(op: string, ctx: GroupContext, tag: number): void {
  if (!Number.isInteger(tag) || tag < 0) throw new CollectiveArgumentError(op, ctx, `tag ${tag} must be a non-negative integer`);
}

export function send(ctx: GroupContext, t: Tensor, dst: number, tag = 0): Work {
  return pointToPoint('send', ctx, t, dst, tag);
}

export function recv(ctx: GroupContext, t: Tensor, src: number, tag = 0): Work {
  return pointToPoint('recv', ctx, t, src, tag);
}

/** send and recv: the same checks, then t (staged if needed) goes to or comes from one peer. */
function pointToPoint(name: 'send' | 'recv', ctx: GroupContext, t: Tensor, peer: number, tag: number): Work {
  const [what, self] = name === 'send' ? ['dst', 'send to'] : ['src', 'receive from'];
  checkTensor(name, ctx, t, 'tensor');
  checkPeer(name, ctx, peer, what);
  checkTag(name, ctx, tag);
  if (peer === ctx.rank) throw new CollectiveArgumentError(name, ctx, `cannot ${self} itself (group rank ${peer})`);
  const handle = ctx.handle!;
  const s = newStaging(ctx);
  const wire = wireFor(t, 'movement', name === 'send' ? 'input' : 'output', s);
  return issue(name, ctx, s, () => handle[name]([wire.handle], peer, tag));
}

export function barrier(ctx: GroupContext): Work {
  if (ctx.handle === undefined) return Work.done('barrier', ctx);
  const handle = ctx.handle;
  return issue('barrier', ctx, newStaging(ctx), () => handle.barrier());
}
