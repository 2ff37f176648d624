// Process groups: the world (from the launch contract in env.ts) and sub-groups of it, on c10d Gloo
// or Open MPI.
//
// Backend: initProcessGroup({ backend }), else FLOTILLA_BACKEND, else 'auto': 'mpi' when this process
// was started by mpirun (`flotilla run --backend mpi` does that) and the MPI addon is built, 'gloo'
// otherwise. Under MPI the world is MPI_COMM_WORLD and sub-groups are MPI_Comm_split of it (no
// store; see [Note: MPI launch] in mpi.ts); everything below about stores and Gloo devices is Gloo's.
//
// Rendezvous: through the store store.ts opens (a private FileStore when `flotilla run` starts every
// rank on one host; otherwise flotilla's own store, which rank 0 serves on MASTER_ADDR:MASTER_PORT
// and which admits only ranks that know the job secret). Each group meets under its own key prefix of that one store: the
// world under "world/", the n-th newGroup() call under "group/<n>/". That is why newGroup() must be
// called by every rank in the same order, members or not: the call count names the prefix.
//
// Gloo's network device: for a loopback MASTER_ADDR or a FileStore (all ranks on one host) Gloo binds
// to the loopback address; otherwise to this host's address on the interface that reaches MASTER_ADDR
// (route.ts: the interface holding it on rank 0's host, the route to it elsewhere), never to whatever
// the host's name resolves to (127.0.1.1 on a stock Debian host). FLOTILLA_GLOO_IFACE (or PyTorch's
// GLOO_SOCKET_IFNAME) picks an interface, FLOTILLA_GLOO_HOSTNAME an address, overriding both. The
// run header (describeBackend) names the choice.
//
// Timeout: every collective of a group fails (never hangs) once a peer has made no progress for the
// group's timeout: initProcessGroup({ timeoutMs }), else FLOTILLA_TIMEOUT_MS, else 300 s.
//
// Intra-op threads: when several ranks share this host and neither FLOTILLA_NUM_THREADS nor
// OMP_NUM_THREADS is set, initProcessGroup gives each rank floor(cores / LOCAL_WORLD_SIZE) threads
// (at least one), so ranks do not oversubscribe the cores. FLOTILLA_NUM_THREADS=n sets n exactly;
// with OMP_NUM_THREADS set, libtorch's own choice is left alone.
import { availableParallelism } from 'node:os';
import { native, type GroupHandle, type StoreHandle } from '../tensor/native.js';
import { setNumThreads, tensor, empty, type Tensor } from '../tensor/index.js';
import { readLaunchEnv, timeoutFromEnv, isLoopback, intVar, LaunchEnvError, type LaunchEnv } from './env.js';
import * as C from './collectives.js';
import { openStore, type RendezvousStore } from './store.js';
import { tellLauncher } from './launcher_channel.js';
import { Work, type ReduceOp, type GroupContext } from './collectives.js';
import { initMpiWorld, loadMpi, mpiAvailable, startedByMpirun, MpiGroupHandle, MPI_INSTALL_HINT, type MpiComm } from './mpi.js';
import { mpiInstalled } from './mpi_install.js';
import { routeTo } from './route.js';

export { Work, CollectiveError, CollectiveArgumentError, type ReduceOp } from './collectives.js';

export const DEFAULT_TIMEOUT_MS = 300_000;

export interface CollectiveStats {
  /** Collectives issued, by method name (allReduce, broadcast, ...). */
  issued: Record<string, number>;
  total: number;
}

/**
 * A set of ranks that run collectives together. Group ranks (`rank`, the src/dst arguments) count
 * 0..size-1 in the order of `ranks`, the members' global ranks (ascending).
 */
export class ProcessGroup {
  readonly rank: number;
  readonly size: number;
  /** Global ranks of the members, in group-rank order. */
  readonly ranks: readonly number[];
  readonly name: string;
  readonly timeoutMs: number;
  readonly stats: CollectiveStats = { issued: {}, total: 0 };
  private ctx: GroupContext | undefined;

  /** @internal Use initProcessGroup() and newGroup(). */
  constructor(opts: {
    name: string; rank: number; ranks: readonly number[]; timeoutMs: number; handle: GroupHandle | undefined; backend?: Backend;
  }) {
    this.name = opts.name;
    this.rank = opts.rank;
    this.ranks = Object.freeze([...opts.ranks]);
    this.size = opts.ranks.length;
    this.timeoutMs = opts.timeoutMs;
    this.ctx = {
      name: opts.name, rank: opts.rank, size: this.size, ranks: this.ranks, timeoutMs: opts.timeoutMs,
      handle: opts.handle, unsupported: new Set(), backend: opts.handle === undefined ? 'local' : opts.backend ?? 'gloo',
    };
  }

  /** 'gloo' or 'mpi', or 'local' for a group of one (collectives complete at once, without a network). */
  get backend(): Backend | 'local' {
    return this.context('backend').backend;
  }

  /** The global rank of a group rank. */
  globalRank(groupRank: number): number {
    const g = this.ranks[groupRank];
    if (g === undefined) throw new RangeError(`group '${this.name}' has no group rank ${groupRank} (size ${this.size})`);
    return g;
  }

  /** The group rank of a global rank, or -1 when it is not a member. */
  groupRank(globalRank: number): number {
    return this.ranks.indexOf(globalRank);
  }

  private context(op: string): GroupContext {
    if (this.ctx === undefined) {
      throw new Error(`${op} on group '${this.name}': the group was destroyed (destroyProcessGroup() was called)`);
    }
    return this.ctx;
  }

  /** Runs a collective and counts it once it was issued (a call rejected for its arguments is not). */
  private issue(op: string, start: (ctx: GroupContext) => Work): Work {
    const w = start(this.context(op));
    this.stats.issued[op] = (this.stats.issued[op] ?? 0) + 1;
    this.stats.total++;
    return w;
  }

  /** Reduces t across the group, in place. 'avg' scales by 1/size, then sums (Gloo has no AVG). */
  allReduce(t: Tensor, op: ReduceOp = 'sum'): Work {
    return this.issue('allReduce', (c) => C.allReduce(c, t, op));
  }
  /** Copies t from group rank src to every member, in place. */
  broadcast(t: Tensor, src: number): Work {
    return this.issue('broadcast', (c) => C.broadcast(c, t, src));
  }
  /** outputs[i] receives group rank i's input (one output per member, each shaped like input). */
  allGather(outputs: Tensor[], input: Tensor): Work {
    return this.issue('allGather', (c) => C.allGather(c, outputs, input));
  }
  /** Gathers every member's input into one tensor of size × input.numel() elements, in group-rank order. */
  allGatherInto(output: Tensor, input: Tensor): Work {
    return this.issue('allGatherInto', (c) => C.allGatherInto(c, output, input));
  }
  /**
   * Reduces input (size × output.numel() elements, flat order) across the group; group rank i
   * receives the i-th chunk of the reduction in output.
   */
  reduceScatter(output: Tensor, input: Tensor, op: 'sum' | 'avg' = 'sum'): Work {
    return this.issue('reduceScatter', (c) => C.reduceScatter(c, output, input, op));
  }
  /** Splits input along dim 0 (equal parts, or inSplits), sends part i to group rank i, and fills output likewise. */
  allToAll(output: Tensor, input: Tensor, outSplits?: number[], inSplits?: number[]): Work {
    return this.issue('allToAll', (c) => C.allToAll(c, output, input, outSplits, inSplits));
  }
  /** Sends t to group rank dst; pair with recv(·, thisRank, tag) there. */
  send(t: Tensor, dst: number, tag = 0): Work {
    return this.issue('send', (c) => C.send(c, t, dst, tag));
  }
  /** Receives into t from group rank src. */
  recv(t: Tensor, src: number, tag = 0): Work {
    return this.issue('recv', (c) => C.recv(c, t, src, tag));
  }
  barrier(): Work {
    return this.issue('barrier', (c) => C.barrier(c));
  }

  /** @internal Makes every later call throw and frees the native group now (destroyProcessGroup). */
  destroy(): void {
    this.ctx?.handle?.release();
    this.ctx = undefined;
  }

  toString(): string {
    return `ProcessGroup(${this.name}, rank ${this.rank} of ${this.size}, global ranks [${this.ranks.join(', ')}])`;
  }
}

// ---------------------------------------------------------------------------------------------
// The world

/** The collective engines: c10d Gloo (TCP) and Open MPI (shared memory within a host). */
export type Backend = 'gloo' | 'mpi';
export const BACKENDS: readonly (Backend | 'auto')[] = ['auto', 'gloo', 'mpi'];

interface WorldState {
  world: ProcessGroup;
  backend: Backend;
  /** The MPI world communicator (backend 'mpi' with more than one rank). */
  mpi?: MpiComm;
  env: LaunchEnv;
  store: StoreHandle | undefined;
  rendezvous: RendezvousStore | undefined;
  deviceOpts: { hostname?: string; iface?: string };
  /** Where Gloo binds, for the run header and messages. */
  deviceLabel: string;
  groupsCreated: number;
  groups: ProcessGroup[];
}

let state: WorldState | undefined;
/** Worlds this process has joined so far: each meets in a store of its own ([Note: store cycles]). */
let cycles = 0;

/** Where Gloo binds (see the top of this file), and a label for it. */
function glooDevice(env: LaunchEnv): { opts: { hostname?: string; iface?: string }; label: string } {
  const e = process.env;
  const ifaceVar = e.FLOTILLA_GLOO_IFACE?.trim() ? 'FLOTILLA_GLOO_IFACE' : 'GLOO_SOCKET_IFNAME';
  const iface = e.FLOTILLA_GLOO_IFACE?.trim() || e.GLOO_SOCKET_IFNAME?.trim();
  if (iface) return { opts: { iface }, label: `interface ${iface} (${ifaceVar})` };
  const hostname = e.FLOTILLA_GLOO_HOSTNAME?.trim();
  if (hostname) return { opts: { hostname }, label: `address ${hostname} (FLOTILLA_GLOO_HOSTNAME)` };
  if (e.FLOTILLA_STORE_FILE?.trim()) return { opts: { hostname: '127.0.0.1' }, label: 'loopback 127.0.0.1' };
  if (isLoopback(env.masterAddr)) {
    const a = env.masterAddr === 'localhost' ? '127.0.0.1' : env.masterAddr;
    return { opts: { hostname: a }, label: `loopback ${a}` };
  }
  const r = routeTo(env.masterAddr);
  if (typeof r === 'string') {
    throw new LaunchEnvError(
      `rank ${env.rank}: cannot choose the interface Gloo binds: ${r}. Set FLOTILLA_GLOO_IFACE to the interface that reaches the other hosts ` +
        '(or FLOTILLA_GLOO_HOSTNAME to this host\'s address on it)',
    );
  }
  return { opts: { hostname: r.address }, label: `${r.iface} ${r.address} (the route to MASTER_ADDR ${env.masterAddr})` };
}

function configureThreads(env: LaunchEnv): void {
  if (process.env.FLOTILLA_NUM_THREADS?.trim()) {
    setNumThreads(intVar(process.env, 'FLOTILLA_NUM_THREADS', { positive: true }));
    return;
  }
  if (process.env.OMP_NUM_THREADS?.trim()) return;
  if (env.localWorldSize > 1) setNumThreads(Math.max(1, Math.floor(availableParallelism() / env.localWorldSize)));
}


/**
 * Joins the world described by the launch contract (env.ts) and returns it. Every rank must call it
 * once, at start-up. Without launch variables this is a world of one (collectives are local no-ops).
 */
/**
 * A rank started by `flotilla run` ends when its launcher does (even if the launcher was killed
 * with SIGKILL and could not stop it), instead of lingering as an orphan holding ports and cores.
 */
function exitWithLauncher(): void {
  const launcher = Number(process.env.FLOTILLA_LAUNCHER_PID);
  delete process.env.FLOTILLA_LAUNCHER_PID; // processes this rank starts are not the launcher's children
  if (!Number.isInteger(launcher) || launcher <= 0) return;
  native.setParentDeathSignal(15 /* SIGTERM */);
  if (process.ppid !== launcher) {
    // The launcher died before the signal was armed.
    process.stderr.write(`flotilla: launcher (pid ${launcher}) is gone; rank exits\n`);
    process.exit(1);
  }
}

/**
 * The backend a rank uses: the option, else FLOTILLA_BACKEND, else 'auto' ('mpi' under mpirun when
 * the MPI addon is built, 'gloo' otherwise). An explicit 'mpi' that cannot work throws naming the fix.
 */
export function resolveBackend(requested?: string): Backend {
  const raw = (requested ?? process.env.FLOTILLA_BACKEND?.trim()) || 'auto';
  if (!(BACKENDS as readonly string[]).includes(raw)) {
    const from = requested !== undefined ? 'backend' : 'FLOTILLA_BACKEND';
    throw new Error(`initProcessGroup(): unknown ${from} '${raw}' (expected ${BACKENDS.join(', ')})`);
  }
  if (raw === 'gloo') return 'gloo';
  if (raw === 'auto') return startedByMpirun() && mpiAvailable() ? 'mpi' : 'gloo';
  loadMpi(); // throws naming the install line when the addon is missing
  return 'mpi';
}

/**
 * The fastest backend this machine can run for ranks on one host: 'mpi' when the MPI addon is
 * built and mpirun is installed, else 'gloo'. Launchers (flotilla run/train) use it for 'auto'.
 */
export function fastestBackend(): Backend {
  return mpiInstalled() ? 'mpi' : 'gloo';
}

/** One line naming the world's backend, for the start of a run's output. */
export function describeBackend(group: ProcessGroup = getWorld()): string {
  const b = group.backend;
  if (b === 'mpi') return `backend mpi (${loadMpi().info().library.split(',')[0]}; shared memory within a host), ${group.size} ranks`;
  if (b === 'gloo') return `backend gloo (c10d Gloo over TCP on ${state?.deviceLabel ?? 'loopback'}), ${group.size} ranks`;
  return 'backend local (one process, no collectives)';
}

export function initProcessGroup(opts: { timeoutMs?: number; backend?: Backend | 'auto' } = {}): ProcessGroup {
  if (state !== undefined) {
    throw new Error('initProcessGroup(): the process group is already initialised in this process (call destroyProcessGroup() first)');
  }
  const backend = resolveBackend(opts.backend);
  const env = readLaunchEnv();
  exitWithLauncher();
  const timeoutMs = opts.timeoutMs ?? timeoutFromEnv(DEFAULT_TIMEOUT_MS);
  if (!Number.isInteger(timeoutMs) || timeoutMs <= 0) throw new Error(`initProcessGroup(): timeoutMs must be a positive integer, got ${timeoutMs}`);
  configureThreads(env);
  const ranks = Array.from({ length: env.worldSize }, (_, i) => i);

  if (env.worldSize === 1) {
    const world = new ProcessGroup({ name: 'world', rank: 0, ranks, timeoutMs, handle: undefined });
    state = { world, backend, env, store: undefined, rendezvous: undefined, deviceOpts: {}, deviceLabel: 'none', groupsCreated: 0, groups: [world] };
    return world;
  }
  if (backend === 'mpi') return initMpi(env, ranks, timeoutMs);
  const device = glooDevice(env);
  const deviceOpts = device.opts;

  const rendezvous = openStore(env, timeoutMs, cycles++);
  const store = rendezvous.handle;
  const where = rendezvous.kind === 'file' ? rendezvous.where : `${env.masterAddr}:${env.masterPort}`;
  let handle: GroupHandle;
  try {
    claimRank(store, env);
    const worldStore = native.createPrefixStore('world/', store);
    try {
      handle = native.createGlooGroup(worldStore, env.rank, env.worldSize, timeoutMs, deviceOpts);
    } finally {
      worldStore.release(); // the group holds its own reference
    }
  } catch (e) {
    const why = (e as Error).name === 'LaunchEnvError' ? '' : missingRanks(store, env);
    if (/timed out/i.test((e as Error).message)) tellLauncher({ event: 'timeout', op: 'initProcessGroup', group: 'world' });
    rendezvous.close();
    if ((e as Error).name === 'LaunchEnvError') throw e;
    throw new Error(
      `rank ${env.rank}: could not connect the world of ${env.worldSize} ranks through ${where} within ${timeoutMs} ms ` +
        `(Gloo on ${device.label}): ${(e as Error).message}.${why} Did every rank start with the same WORLD_SIZE/MASTER_PORT? ` +
        'Set FLOTILLA_GLOO_IFACE or FLOTILLA_GLOO_HOSTNAME if ranks cannot reach each other on that interface.',
      { cause: e },
    );
  }
  const world = new ProcessGroup({ name: 'world', rank: env.rank, ranks, timeoutMs, handle });
  state = { world, backend, env, store, rendezvous, deviceOpts, deviceLabel: device.label, groupsCreated: 0, groups: [world] };
  return world;
}

/** The MPI world: MPI_COMM_WORLD of the mpirun job, checked against the launch contract. */
function initMpi(env: LaunchEnv, ranks: number[], timeoutMs: number): ProcessGroup {
  if (!startedByMpirun()) {
    throw new Error(
      `rank ${env.rank}: backend 'mpi' needs ranks started by mpirun (flotilla run --backend mpi --nproc N script.ts, ` +
        `or mpirun -np N); this process was started by ${env.source === 'torchrun' ? 'a torchrun-style launcher' : env.source}. ` +
        "Use backend 'gloo' (or 'auto') here.",
    );
  }
  let comm: MpiComm;
  try {
    comm = initMpiWorld(timeoutMs);
  } catch (e) {
    throw new Error(`rank ${env.rank}: could not start MPI: ${(e as Error).message} (${MPI_INSTALL_HINT})`, { cause: e });
  }
  if (comm.rank() !== env.rank || comm.size() !== env.worldSize) {
    throw new LaunchEnvError(
      `rank ${env.rank} of ${env.worldSize} by the launch variables is MPI rank ${comm.rank()} of ${comm.size()}; ` +
        'unset RANK/WORLD_SIZE under mpirun (it sets OMPI_COMM_WORLD_RANK/SIZE)',
    );
  }
  const world = new ProcessGroup({ name: 'world', rank: env.rank, ranks, timeoutMs, handle: new MpiGroupHandle(comm), backend: 'mpi' });
  state = { world, backend: 'mpi', mpi: comm, env, store: undefined, rendezvous: undefined, deviceOpts: {}, deviceLabel: 'none', groupsCreated: 0, groups: [world] };
  return world;
}

/**
 * Registers this process as its RANK in the store; a second process with the same RANK fails here,
 * naming it, and leaves a mark the others name if they time out.
 */
function claimRank(store: StoreHandle, env: LaunchEnv): void {
  if (store.add(`join/rank/${env.rank}`, 1) > 1) {
    store.set(`join/duplicate/${env.rank}`, Buffer.from('1'));
    throw new LaunchEnvError(
      `RANK=${env.rank} was given to two processes of this job (this one joined second); every process needs its own RANK in 0..${env.worldSize - 1}`,
    );
  }
}

/** After a failed rendezvous: which ranks never joined, and which RANK was given twice. */
function missingRanks(store: StoreHandle, env: LaunchEnv): string {
  try {
    const missing: number[] = [];
    const dup: number[] = [];
    for (let r = 0; r < env.worldSize; r++) {
      if (!store.check([`join/rank/${r}`])) missing.push(r);
      if (store.check([`join/duplicate/${r}`])) dup.push(r);
    }
    const parts = [];
    if (dup.length > 0) parts.push(`RANK ${dup.join(', ')} was given to two processes`);
    if (missing.length > 0) parts.push(`rank${missing.length > 1 ? 's' : ''} ${missing.join(', ')} never joined`);
    return parts.length > 0 ? ` ${parts.join('; ')}.` : '';
  } catch {
    return '';
  }
}

/** True once initProcessGroup() has run (and destroyProcessGroup() has not). */
export function isInitialized(): boolean {
  return state !== undefined;
}

/** The world group; throws if initProcessGroup() has not run. */
export function getWorld(): ProcessGroup {
  if (state === undefined) {
    throw new Error('the process group is not initialised: call initProcessGroup() on every rank at start-up (flotilla run sets the environment it reads)');
  }
  return state.world;
}

/** The launch contract the world was built from. */
export function getLaunchEnv(): LaunchEnv {
  getWorld();
  return state!.env;
}

/**
 * A group of the given global ranks (group ranks follow ascending global rank). Every rank of the
 * world must call newGroup with the same ranks, in the same order of calls, members or not; returns
 * undefined on non-members. A member whose peers asked for other ranks gets an error naming both.
 */
export function newGroup(ranks: number[], opts: { timeoutMs?: number; name?: string } = {}): ProcessGroup | undefined {
  const world = getWorld();
  const s = state!;
  const id = s.groupsCreated++;
  const label = opts.name ?? `group${id}`;
  if (!Array.isArray(ranks) || ranks.length === 0) throw new Error(`newGroup(${label}): ranks must be a non-empty array of global ranks`);
  for (const r of ranks) {
    if (!Number.isInteger(r) || r < 0 || r >= world.size) {
      throw new Error(`newGroup(${label}): ${String(r)} is not a global rank (world size ${world.size})`);
    }
  }
  const sorted = [...ranks].sort((a, b) => a - b);
  if (sorted.some((r, i) => i > 0 && r === sorted[i - 1])) throw new Error(`newGroup(${label}): ranks [${ranks.join(', ')}] repeat a rank`);
  const timeoutMs = opts.timeoutMs ?? world.timeoutMs;
  const rank = sorted.indexOf(world.rank);
  if (s.mpi !== undefined && sorted.length > 1) return splitGroup(s, s.mpi, label, id, sorted, rank, timeoutMs);
  if (rank < 0) return undefined;
  if (sorted.length === 1 || s.store === undefined) {
    const g = new ProcessGroup({ name: label, rank, ranks: sorted, timeoutMs, handle: undefined });
    s.groups.push(g);
    return g;
  }

  const store = native.createPrefixStore(`group/${id}/`, s.store);
  try {
    return joinGroup(store, s, world, label, id, sorted, rank, timeoutMs);
  } finally {
    store.release(); // the native group holds its own reference
  }
}

/**
 * An MPI sub-group: MPI_Comm_split of the world, which every world rank joins (members or not).
 * First every rank shares the ranks it asked for (a world all-gather), so ranks that called newGroup
 * in different orders get the same error Gloo gives (naming what the group's lowest rank asked for)
 * instead of a cross-wired group; the split colour is the request itself, so differing requests
 * never land in one communicator.
 */
function splitGroup(s: WorldState, worldComm: MpiComm, label: string, id: number, sorted: number[], rank: number, timeoutMs: number): ProcessGroup | undefined {
  const fail = (detail: string, cause?: unknown): Error => new Error(
    `newGroup(${label}) call #${id} on global rank ${s.world.rank} for ranks [${sorted.join(', ')}]: ${detail}. ` +
      'Every rank must call newGroup with the same ranks, in the same order.', cause === undefined ? undefined : { cause });
  const asked = worldRequests(new MpiGroupHandle(worldComm), s.world.size, sorted);
  let comm: MpiComm | undefined;
  try {
    comm = worldComm.split(rank < 0 ? -1 : specHash(sorted), rank, timeoutMs);
  } catch (e) {
    throw fail(`MPI_Comm_split failed: ${(e as Error).message}`, e);
  }
  if (comm === undefined) return undefined;
  const lead = JSON.stringify(asked[sorted[0]!]);
  if (lead !== JSON.stringify(sorted)) throw fail(`global rank ${sorted[0]} asked for ranks ${lead} in the same call`);
  if (comm.size() !== sorted.length) throw fail(`${comm.size()} ranks joined instead of ${sorted.length}`);
  const g = new ProcessGroup({ name: label, rank, ranks: sorted, timeoutMs, handle: new MpiGroupHandle(comm), backend: 'mpi' });
  s.groups.push(g);
  return g;
}

/** The rank list every world rank passed to this newGroup call (two world collectives). */
function worldRequests(world: MpiGroupHandle, worldSize: number, sorted: number[]): number[][] {
  const len = tensor(Float64Array.from([sorted.length]), { dtype: 'int64' });
  let mine: Tensor | undefined;
  let all: Tensor | undefined;
  try {
    world.allreduce([len.handle], 'max').wait();
    const width = len.toNumbers()[0]!;
    mine = tensor(Float64Array.from({ length: width }, (_, i) => sorted[i] ?? -1), { dtype: 'int64' });
    all = empty([worldSize * width], { dtype: 'int64' });
    world.allgatherBase(all.handle, mine.handle).wait();
    const flat = all.toNumbers();
    return Array.from({ length: worldSize }, (_, r) => flat.slice(r * width, (r + 1) * width).filter((x) => x >= 0));
  } finally {
    len.dispose();
    mine?.dispose();
    all?.dispose();
  }
}

/** A split colour that names a rank list (equal lists, equal colours; 0..2^30). */
function specHash(ranks: number[]): number {
  let h = ranks.length;
  for (const r of ranks) h = (Math.imul(h, 31) + r + 1) >>> 0;
  return h % 1073741824;
}

function joinGroup(
  store: StoreHandle, s: WorldState, world: ProcessGroup, label: string, id: number, sorted: number[], rank: number, timeoutMs: number,
): ProcessGroup {
  // Every member checks that the group's lowest rank asked for the same ranks (a mismatch means
  // ranks called newGroup in different orders, which would otherwise hang or cross-wire groups).
  const spec = JSON.stringify(sorted);
  try {
    store.set(`spec/${world.rank}`, Buffer.from(spec));
    const lead = store.get(`spec/${sorted[0]}`).toString();
    if (lead !== spec) {
      throw new Error(`global rank ${sorted[0]} asked for ranks ${lead} in the same call`);
    }
  } catch (e) {
    throw new Error(
      `newGroup(${label}) call #${id} on global rank ${world.rank} for ranks [${sorted.join(', ')}]: ${(e as Error).message}. ` +
        'Every rank must call newGroup with the same ranks, in the same order.',
      { cause: e },
    );
  }
  let handle: GroupHandle;
  try {
    handle = native.createGlooGroup(store, rank, sorted.length, timeoutMs, s.deviceOpts);
  } catch (e) {
    throw new Error(`newGroup(${label}) for global ranks [${sorted.join(', ')}]: could not connect within ${timeoutMs} ms: ${(e as Error).message}`, { cause: e });
  }
  const g = new ProcessGroup({ name: label, rank, ranks: sorted, timeoutMs, handle });
  s.groups.push(g);
  return g;
}

/**
 * Forgets the world and every group made from it; using them afterwards throws. The native groups
 * (their threads, sockets and listeners) and the store (on rank 0 its server) are released at once,
 * so a new initProcessGroup() in the same process may reuse MASTER_PORT.
 */
export function destroyProcessGroup(): void {
  if (state === undefined) return;
  const s = state;
  state = undefined;
  for (const g of s.groups) g.destroy();
  s.rendezvous?.close();
}
