// The one TypeScript declaration of what the native addon (native/*.cc) exports, and its loader.
import { createRequire } from 'node:module';
import { existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { type TensorCacheStats, tuneAllocator } from './allocator.js';

/**
 * An owned at::Tensor: a slot in the addon's handle table (index and generation packed in a
 * BigInt; see [Note: handle table] in native/common.h). release() frees it; a released handle is
 * rejected by every call.
 */
export type TensorHandle = bigint;

/** A collective in flight (c10d Work). */
export interface WorkHandle {
  /** Blocks until done; throws the collective's error. */
  wait(timeoutMs?: number): boolean;
  waitAsync(): Promise<void>;
  isCompleted(): boolean;
  /** Drops the native Work now (it pins the group's Gloo context); later calls throw. */
  release(): void;
}

export interface StoreHandle {
  set(key: string, value: Buffer): void;
  get(key: string): Buffer;
  add(key: string, delta: number): number;
  check(keys: string[]): boolean;
  wait(keys: string[], timeoutMs?: number): void;
  /** Drops this handle's reference at once; later calls throw. */
  release(): void;
}

export type NativeReduceOp = 'sum' | 'product' | 'min' | 'max';

export interface GroupHandle {
  allreduce(tensors: TensorHandle[], op: NativeReduceOp): WorkHandle;
  broadcast(tensors: TensorHandle[], root: number): WorkHandle;
  allgather(outputs: TensorHandle[][], inputs: TensorHandle[]): WorkHandle;
  allgatherBase(output: TensorHandle, input: TensorHandle): WorkHandle;
  reduceScatter(outputs: TensorHandle[], inputs: TensorHandle[][], op: NativeReduceOp): WorkHandle;
  reduceScatterBase(output: TensorHandle, input: TensorHandle, op: NativeReduceOp): WorkHandle;
  alltoallBase(output: TensorHandle, input: TensorHandle, outSplits: number[], inSplits: number[]): WorkHandle;
  send(tensors: TensorHandle[], dst: number, tag: number): WorkHandle;
  /** Destroys the native group at once (threads, sockets, listener); later calls throw. */
  release(): void;
  recv(tensors: TensorHandle[], src: number, tag: number): WorkHandle;
  barrier(): WorkHandle;
  backendName(): string;
}

/** What an op returns: tensors are BigInt handles, scalars are numbers or booleans. */
export type NativeValue = TensorHandle | number | boolean | undefined | NativeValue[];

export interface Native {
  lookupOp(name: string, overload: string): number;
  opSchema(id: number): string;
  callOp(id: number, args: unknown[]): NativeValue;
  fromBuffer(data: ArrayBufferView, shape: number[], scalarType: number): TensorHandle;
  toBuffer(t: TensorHandle): ArrayBuffer;
  /** Copies the tensor's bytes into the start of `into`; returns the byte count. */
  copyToBuffer(t: TensorHandle, into: Uint8Array): number;
  /** [shape, scalarType, requiresGrad, isLeaf, strides, storageOffset] */
  meta(t: TensorHandle): [number[], number, boolean, boolean, number[], number];
  shape(t: TensorHandle): number[];
  dtype(t: TensorHandle): number;
  dataPtr(t: TensorHandle): bigint;
  manualSeed(seed: number): void;
  /** The default CPU generator's state (a uint8 tensor), and setting it back. */
  rngState(): TensorHandle;
  setRngState(state: TensorHandle): void;
  setNumThreads(n: number): void;
  getNumThreads(): number;
  liveTensors(): number;
  /** Reports the tensor's storage bytes to V8 as external memory (once per handle; not views). */
  reportExternal(t: TensorHandle): boolean;
  /** Frees a handle's tensor now; false if it was already released. */
  release(t: TensorHandle): boolean;
  isLive(t: TensorHandle): boolean;
  version(): { torch: string; parallel: string };
  /** OpenBLAS's kernel choice for this CPU and its build line; undefined when libtorch uses another BLAS. */
  blasInfo(): { core: string; config: string } | undefined;
  /** glibc mallopt of M_MMAP_THRESHOLD and M_TRIM_THRESHOLD; false where not glibc or refused. */
  setMallocOptions(mmapThreshold: number, trimThreshold: number): boolean;
  /** glibc's malloc_trim(0): free memory of every arena back to the OS; false when nothing was returned or not glibc. */
  mallocTrim(): boolean;
  /** The tensor cache ([Note: tensor cache] in native/tensor_cache.cc): blocks from minBytes kept up to capBytes; cap 0 turns it off. */
  setTensorCache(minBytes: number, capBytes: number): void;
  /** Unmaps every cached block; returns the bytes given back. */
  emptyTensorCache(): number;
  /** Unmaps the cached blocks no request took since the previous call; returns the bytes given back. */
  trimTensorCache(): number;
  tensorCacheStats(): TensorCacheStats;
  /**
   * Fused causal attention ([Note: fused attention] in native/attention.cc): q (B, Hq, Tq, D), k and v
   * (B, Hkv, Tk, D); returns [out, lse (B, Hq, Tq)]. Document ids (B, T) int32/int64: both or neither.
   */
  attentionForward(q: TensorHandle, k: TensorHandle, v: TensorHandle, scale: number, offset: number, window: number,
    qDocs: TensorHandle | undefined, kDocs: TensorHandle | undefined): [TensorHandle, TensorHandle];
  /** Its backward from the forward's out and lse: [dq, dk, dv]. */
  attentionBackward(q: TensorHandle, k: TensorHandle, v: TensorHandle, out: TensorHandle, lse: TensorHandle, dOut: TensorHandle,
    scale: number, offset: number, window: number, qDocs: TensorHandle | undefined, kDocs: TensorHandle | undefined): [TensorHandle, TensorHandle, TensorHandle];
  /**
   * One AdamW update in place over flat contiguous ranges ([Note: fused optimizer] in native/optim.cc):
   * g = gradScale grad, m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g g, param = decay param - stepSize m / (sqrt(v) / bc2sqrt + eps).
   */
  adamwStep(param: TensorHandle, grad: TensorHandle, expAvg: TensorHandle, expAvgSq: TensorHandle,
    decay: number, beta1: number, beta2: number, eps: number, stepSize: number, bc2sqrt: number, gradScale: number): void;
  /**
   * One SGD update in place of the gradient times gradScale (torch.optim.SGD's, L2 decay into the
   * gradient; the first step copies into the buffer).
   */
  sgdStep(param: TensorHandle, grad: TensorHandle, momentumBuffer: TensorHandle | undefined, lr: number, momentum: number,
    dampening: number, weightDecay: number, nesterov: boolean, first: boolean, gradScale: number): void;
  /**
   * One-pass pointwise kernels ([Note: pointwise kernels] in native/pointwise.cc). Norms over the last
   * dim: [y, rstd, mean (LayerNorm: layer true)]; rstd and mean in float32 (float64 for float64 x).
   */
  normForward(x: TensorHandle, weight: TensorHandle, bias: TensorHandle | undefined, eps: number, layer: boolean): TensorHandle[];
  /** [dx, dweight, dbias (withBias)]; LayerNorm when mean is given. */
  normBackward(dy: TensorHandle, x: TensorHandle, weight: TensorHandle, withBias: boolean, rstd: TensorHandle, mean: TensorHandle | undefined): TensorHandle[];
  /** silu(gate) * up. */
  swigluForward(gate: TensorHandle, up: TensorHandle): TensorHandle;
  /** [dgate, dup]. */
  swigluBackward(dy: TensorHandle, gate: TensorHandle, up: TensorHandle): [TensorHandle, TensorHandle];
  /** gelu(x), exact or (tanh) the tanh approximation. */
  geluForward(x: TensorHandle, tanh: boolean): TensorHandle;
  geluBackward(dy: TensorHandle, x: TensorHandle, tanh: boolean): TensorHandle;
  /** x (B, T, H, D) * cos + swapHalves(x) * sinSigned, tables (T, D), (1, T, D) or (B, T, D); inverse: the rotation by -theta. */
  rotary(x: TensorHandle, cos: TensorHandle, sinSigned: TensorHandle, inverse: boolean): TensorHandle;
  /** Linux: deliver signo to this process when its parent exits (false elsewhere). */
  setParentDeathSignal(signo: number): boolean;

  /** inputs: accumulate into these tensors' .grad only (torch::autograd::backward's inputs). */
  /** Resizes the tensor's whole storage to nbytes (0 frees it; views keep their shape). */
  resizeStorage(t: TensorHandle, nbytes: number): void;
  /** Bytes the tensor's storage holds now. */
  storageNbytes(t: TensorHandle): number;
  /** An uninitialised tensor on pages mapped for it alone, unmapped when freed or resized ([Note: mapped storage]). */
  emptyMapped(shape: number[], scalarType: number): TensorHandle;
  /** PyTorch's .data: same storage, no autograd history, its own version counter. */
  variableData(t: TensorHandle): TensorHandle;
  /**
   * A custom autograd node whose backward is a JS function ([Note: native function node] in
   * native/autograd.cc): returns one alias per output (same storage) with the node as grad_fn and
   * edges to inputs. backward gets a gradient per output (undefined if unreached), per input whether
   * this pass computes it, the saved tensors' handles (released after the call) and whether the graph
   * is freed after it; it returns a handle or undefined per input, handles the node then owns.
   */
  functionNode(
    name: string, inputs: TensorHandle[], outputs: TensorHandle[], saved: TensorHandle[],
    backward: (grads: (TensorHandle | undefined)[], wanted: boolean[], saved: TensorHandle[], last: boolean) => (TensorHandle | undefined)[],
  ): TensorHandle[];
  /** From inside a backward hook: runs fn once the current backward pass has finished. */
  queueBackwardCallback(fn: () => void): void;

  backward(roots: TensorHandle[], grads?: TensorHandle[], retainGraph?: boolean, inputs?: TensorHandle[]): void;
  /** torch::autograd::grad: gradients of outputs w.r.t. inputs, returned; undefined for an unused input. */
  autogradGrad(outputs: TensorHandle[], inputs: TensorHandle[], gradOutputs?: TensorHandle[], retainGraph?: boolean, allowUnused?: boolean): (TensorHandle | undefined)[];
  getGrad(t: TensorHandle): TensorHandle | undefined;
  setGrad(t: TensorHandle, g: TensorHandle | undefined): void;
  setRequiresGrad(t: TensorHandle, flag: boolean): void;
  setGradEnabled(flag: boolean): boolean;
  isGradEnabled(): boolean;
  gradFnName(t: TensorHandle): string | undefined;
  registerHook(t: TensorHandle, fn: (grad: TensorHandle) => TensorHandle | undefined): number;
  removeHook(t: TensorHandle, id: number): void;
  registerAccumulateGradHook(t: TensorHandle, fn: () => void): number;
  removeAccumulateGradHook(id: number): void;

  /** A client of flotilla's own store (src/distributed/store_server.ts); prove answers its nonce. */
  createSocketStore(host: string, port: number, timeoutMs: number, maxFrameBytes: number, prove: (nonce: Buffer) => Buffer): StoreHandle;
  /** c10d's FileStore: rendezvous through a file, for ranks on one host. */
  createFileStore(path: string, worldSize: number, timeoutMs: number): StoreHandle;
  createPrefixStore(prefix: string, base: StoreHandle): StoreHandle;
  createGlooGroup(
    store: StoreHandle, rank: number, size: number, timeoutMs: number,
    opts?: { hostname?: string; iface?: string; threads?: number },
  ): GroupHandle;
}

/** How to (re)build the addon: a checkout through scripts/ensure.sh, an installed package through its install script. */
function buildCommand(root: string): string {
  return existsSync(join(root, 'scripts', 'ensure.sh'))
    ? '`bash scripts/ensure.sh` (or `npm run build:native`)'
    : `\`node ${join(root, 'scripts', 'install-addon.cjs')} --build\``;
}

function load(): Native {
  const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
  const file = join(root, 'native', 'build', 'Release', 'flotilla.node');
  if (!existsSync(file)) {
    throw new Error(`flotilla native addon not built (${file} missing): run ${buildCommand(root)}`);
  }
  let addon: Native;
  try {
    addon = createRequire(import.meta.url)(file) as Native;
  } catch (e) {
    // e.g. a packed addon built against a libtorch this machine does not have
    throw new Error(`flotilla native addon ${file} does not load (${(e as Error).message.split('\n')[0]}): rebuild it with ${buildCommand(root)}`);
  }
  // [Note: allocator tuning]
  tuneAllocator((mmap, trim) => addon.setMallocOptions(mmap, trim), (min, cap) => addon.setTensorCache(min, cap));
  return addon;
}

export const native: Native = load();

/**
 * Gives the memory freed so far back to the OS (malloc_trim). Training keeps freed memory for the
 * next step by design ([Note: allocator tuning]); once the model and optimizer are disposed, that
 * memory serves nothing, and whatever runs next (a run's report, a script's next phase) would add to
 * it. Returns false where nothing was given back.
 */
export function releaseFreedMemory(): boolean {
  // also the tensor cache's blocks ([Note: tensor cache])
  const cached = native.emptyTensorCache();
  return native.mallocTrim() || cached > 0;
}

/**
 * Gives back the freed tensor memory that nothing has reused since the previous call: the tensor
 * cache's blocks of shapes the run no longer makes ([Note: tensor cache]). Call it once per training
 * step (the trainer does, after the optimizer step): blocks a step reuses stay, while those left by
 * construction or an evaluation pass go back at the next call. Returns the bytes given back.
 */
export function releaseIdleMemory(): number {
  return native.trimTensorCache();
}

/** What the tensor cache holds and how it served requests ([Note: tensor cache]); `on` false when another allocator mode runs. */
export function tensorCacheStats(): TensorCacheStats {
  return native.tensorCacheStats();
}
