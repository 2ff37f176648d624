// The Open MPI backend: loads the optional flotilla_mpi addon (native/mpi.cc) and presents an MPI
// communicator as the same GroupHandle the Gloo backend gives collectives.ts, so every collective
// (argument checks, dtype staging, 'avg', Work, CollectiveError) is shared by both backends.
//
// The MPI addon takes raw buffers: this file reads each tensor's address, element count and dtype
// from the main addon, and holds an alias of every tensor it hands over (a second handle on the same
// storage) until the operation completes, so a tensor disposed while its collective is in flight
// keeps its memory, as it does with Gloo.
//
// [Note: MPI launch] MPI ranks must be started by mpirun (`flotilla run --backend mpi` does that):
// Open MPI joins its ranks through mpirun's daemon, not through MASTER_ADDR/MASTER_PORT. The process
// finalizes MPI when it exits (Open MPI treats a rank that exits without MPI_Finalize as failed and
// aborts the job); a rank with a timed-out collective skips that, since its communicator is stuck.
import { createRequire } from 'node:module';
import { existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { native, type GroupHandle, type NativeReduceOp, type TensorHandle, type WorkHandle } from '../tensor/native.js';
import { dtypeFromCode, elementSize } from '../tensor/dtype.js';
import { MPI_INSTALL_HINT } from './mpi_install.js';

/** A communicator of the MPI addon; buffers are addresses (BigInt), sizes are counts or bytes. */
export interface MpiComm {
  rank(): number;
  size(): number;
  allreduce(ptr: bigint, count: number, dtype: string, op: NativeReduceOp): WorkHandle;
  broadcast(ptr: bigint, bytes: number, root: number): WorkHandle;
  allgather(out: bigint, input: bigint, bytes: number): WorkHandle;
  allgatherList(outs: bigint[], input: bigint, bytes: number): WorkHandle;
  reduceScatter(out: bigint, input: bigint, count: number, dtype: string, op: NativeReduceOp): WorkHandle;
  alltoall(out: bigint, input: bigint, sendBytes: number[], recvBytes: number[]): WorkHandle;
  send(ptr: bigint, bytes: number, dst: number, tag: number): WorkHandle;
  recv(ptr: bigint, bytes: number, src: number, tag: number): WorkHandle;
  barrier(): WorkHandle;
  /** MPI_Comm_split: every member calls it; color < 0 stays out (undefined). */
  split(color: number, key: number, timeoutMs: number): MpiComm | undefined;
  /**
   * Stops the communicator's worker thread and calls MPI_Comm_free; false (nothing freed) when an
   * operation is stuck on it or the thread did not stop within limitMs.
   */
  free(limitMs: number): boolean;
}

export interface MpiAddon {
  init(timeoutMs: number): MpiComm;
  finalize(limitMs?: number): boolean;
  info(): { library: string; initialized: boolean; finalized: boolean; threadLevel: number };
}

export { MPI_INSTALL_HINT };

let loaded: MpiAddon | undefined;
let loadError: string | undefined;

function addonPath(): string {
  const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
  return join(root, 'native', 'build', 'Release', 'flotilla_mpi.node');
}

/** The MPI addon, or undefined when it was not built (no Open MPI on this machine). */
export function tryLoadMpi(): MpiAddon | undefined {
  if (loaded !== undefined || loadError !== undefined) return loaded;
  const file = addonPath();
  if (!existsSync(file)) {
    loadError = `the Open MPI addon is not built (${file} is missing; it is built only where Open MPI is installed)`;
    return undefined;
  }
  try {
    loaded = createRequire(import.meta.url)(file) as MpiAddon;
  } catch (e) {
    loadError = `the Open MPI addon ${file} does not load: ${(e as Error).message}`;
  }
  return loaded;
}

/** True when the MPI backend can be used on this machine (addon built and loadable). */
export function mpiAvailable(): boolean {
  return tryLoadMpi() !== undefined;
}

/** The MPI addon; throws one message naming the fix when it is not there. */
export function loadMpi(): MpiAddon {
  const m = tryLoadMpi();
  if (m === undefined) throw new Error(`backend 'mpi': ${loadError} (${MPI_INSTALL_HINT})`);
  return m;
}

/**
 * True when this process was started by Open MPI's mpirun (so MPI_Init can join its world): besides
 * OMPI_COMM_WORLD_* (which anyone can set, and env.ts reads as a launch contract for Gloo too), mpirun
 * gives each rank the address of its daemon (OMPI_MCA_orte_hnp_uri or a PMIx server).
 */
export function startedByMpirun(env: Record<string, string | undefined> = process.env): boolean {
  if (env.OMPI_COMM_WORLD_SIZE === undefined || env.OMPI_COMM_WORLD_RANK === undefined) return false;
  return env.OMPI_MCA_orte_hnp_uri !== undefined || env.PMIX_NAMESPACE !== undefined || env.PMIX_SERVER_URI3 !== undefined || env.PMIX_SERVER_URI2 !== undefined;
}

let exitHook = false;

/** Joins MPI_COMM_WORLD (MPI_Init_thread on first use) and finalizes MPI when the process exits. */
export function initMpiWorld(timeoutMs: number): MpiComm {
  const m = loadMpi();
  const comm = m.init(timeoutMs);
  if (!exitHook) {
    exitHook = true;
    // Only a rank that succeeds finalizes: MPI_Finalize waits for every rank to get there, and a
    // failing rank's job is being torn down anyway (it must not sit in that wait while the
    // launcher waits for its exit).
    process.on('exit', (code) => {
      if (code === 0) m.finalize(Math.min(timeoutMs, 30_000));
    });
  }
  return comm;
}

// ---------------------------------------------------------------------------------------------
// The GroupHandle adapter

/** How long releasing a group waits for its communicator's thread to finish what was issued. */
const FREE_LIMIT_MS = 5000;

const ALIAS = (): number => (aliasId ??= native.lookupOp('aten::alias', ''));
let aliasId: number | undefined;

interface Buf {
  ptr: bigint;
  numel: number;
  bytes: number;
  dtype: string;
}

/** A Work of the MPI addon that releases the tensor aliases it holds once it has finished. */
class HeldWork implements WorkHandle {
  private released = false;
  constructor(private readonly inner: WorkHandle, private readonly held: TensorHandle[], private readonly open: Set<HeldWork>) {
    open.add(this);
  }
  release(): void {
    if (this.released) return;
    this.released = true;
    this.open.delete(this);
    for (const h of this.held) native.release(h);
  }
  wait(timeoutMs?: number): boolean {
    let done = false;
    try {
      done = timeoutMs === undefined ? this.inner.wait() : this.inner.wait(timeoutMs);
      return done;
    } catch (e) {
      done = true;
      throw e;
    } finally {
      if (done) this.release();
    }
  }
  waitAsync(): Promise<void> {
    return this.inner.waitAsync().finally(() => this.release());
  }
  isCompleted(): boolean {
    const done = this.inner.isCompleted();
    if (done) this.release();
    return done;
  }
}

/**
 * An MPI communicator as a GroupHandle. collectives.ts hands it contiguous tensors in dtypes MPI
 * can reduce (see reductionDtype there), as it does for Gloo.
 */
export class MpiGroupHandle implements GroupHandle {
  constructor(readonly comm: MpiComm) {}

  private buf(h: TensorHandle, held: TensorHandle[]): Buf {
    const [shape, code] = native.meta(h);
    const dtype = dtypeFromCode(code);
    const numel = shape.reduce((a, b) => a * b, 1);
    held.push(native.callOp(ALIAS(), [h]) as TensorHandle);
    return { ptr: native.dataPtr(h), numel, bytes: numel * elementSize(dtype), dtype };
  }

  private run(handles: TensorHandle[], start: (bufs: Buf[]) => WorkHandle): WorkHandle {
    if (this.released) throw new Error('the MPI group was destroyed');
    const held: TensorHandle[] = [];
    try {
      const bufs = handles.map((h) => this.buf(h, held));
      return new HeldWork(start(bufs), held, this.open);
    } catch (e) {
      for (const h of held) native.release(h);
      throw e;
    }
  }

  private one(tensors: TensorHandle[], what: string): TensorHandle {
    if (tensors.length !== 1) throw new Error(`${what}: the MPI backend takes one tensor per call, got ${tensors.length}`);
    return tensors[0]!;
  }

  allreduce(tensors: TensorHandle[], op: NativeReduceOp): WorkHandle {
    return this.run([this.one(tensors, 'allreduce')], ([b]) => this.comm.allreduce(b!.ptr, b!.numel, b!.dtype, op));
  }
  broadcast(tensors: TensorHandle[], root: number): WorkHandle {
    return this.run([this.one(tensors, 'broadcast')], ([b]) => this.comm.broadcast(b!.ptr, b!.bytes, root));
  }
  allgather(outputs: TensorHandle[][], inputs: TensorHandle[]): WorkHandle {
    const outs = outputs.length === 1 ? outputs[0]! : [];
    if (outs.length !== this.comm.size()) throw new Error(`allgather: need ${this.comm.size()} outputs`);
    return this.run([this.one(inputs, 'allgather'), ...outs], ([i, ...o]) => this.comm.allgatherList(o.map((x) => x.ptr), i!.ptr, i!.bytes));
  }
  allgatherBase(output: TensorHandle, input: TensorHandle): WorkHandle {
    return this.run([output, input], ([o, i]) => this.comm.allgather(o!.ptr, i!.ptr, i!.bytes));
  }
  reduceScatter(): WorkHandle {
    throw new Error('reduceScatter (list form): not supported by the MPI backend; use reduceScatterBase');
  }
  reduceScatterBase(output: TensorHandle, input: TensorHandle, op: NativeReduceOp): WorkHandle {
    return this.run([output, input], ([o, i]) => this.comm.reduceScatter(o!.ptr, i!.ptr, o!.numel, o!.dtype, op));
  }
  alltoallBase(output: TensorHandle, input: TensorHandle, outSplits: number[], inSplits: number[]): WorkHandle {
    return this.run([output, input], ([o, i]) => {
      const n = this.comm.size();
      const rowBytes = (b: Buf, h: TensorHandle): number => {
        const dim0 = native.meta(h)[0][0] ?? 1;
        return dim0 === 0 ? 0 : b.bytes / dim0;
      };
      const bytes = (splits: number[], b: Buf, h: TensorHandle): number[] =>
        splits.length === 0 ? new Array<number>(n).fill(b.bytes / n) : splits.map((s) => s * rowBytes(b, h));
      return this.comm.alltoall(o!.ptr, i!.ptr, bytes(inSplits, i!, input), bytes(outSplits, o!, output));
    });
  }
  send(tensors: TensorHandle[], dst: number, tag: number): WorkHandle {
    return this.run([this.one(tensors, 'send')], ([b]) => this.comm.send(b!.ptr, b!.bytes, dst, tag));
  }
  recv(tensors: TensorHandle[], src: number, tag: number): WorkHandle {
    return this.run([this.one(tensors, 'recv')], ([b]) => this.comm.recv(b!.ptr, b!.bytes, src, tag));
  }
  barrier(): WorkHandle {
    return this.run([], () => this.comm.barrier());
  }
  backendName(): string {
    return 'mpi';
  }
  /**
   * Later calls throw, and the communicator is freed with its worker thread (destroyProcessGroup).
   * A communicator stuck in a timed-out operation cannot be freed: it stays until the process exits.
   */
  release(): void {
    if (this.released) return;
    this.released = true;
    // With an operation still unfinished (a rank leaving in the middle of a step), do not wait for
    // it: the communicator is left as it is, and the process is about to end anyway.
    this.comm.free(this.open.size > 0 ? 0 : FREE_LIMIT_MS);
  }
  private released = false;
  /** Operations issued and not yet waited for or completed. */
  private readonly open = new Set<HeldWork>();
}
