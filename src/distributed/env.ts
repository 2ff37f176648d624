// The launch contract: which rank this process is, how many there are, and where to meet.
//
// Read in this order (the first family whose rank variable is present wins):
//   1. torchrun / `flotilla run`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   2. mpirun (Open MPI):         OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   3. srun (Slurm):              SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE
//   4. nothing set:               a single process, rank 0 of 1
// Under mpirun and srun, MASTER_ADDR / MASTER_PORT still come from the environment when set
// (default 127.0.0.1:29500): neither launcher says where rank 0 listens. A Slurm job on several
// nodes without them meets at the first host of SLURM_JOB_NODELIST on a port derived from
// SLURM_JOB_ID ([Note: slurm port] in slurm_vars.ts).
import { networkInterfaces } from 'node:os';
import { allocatorChoice } from '../tensor/allocator.js';
import { expandHostlist, slurmPort } from './slurm_vars.js';

export type LaunchSource = 'torchrun' | 'mpirun' | 'srun' | 'single';

export interface LaunchEnv {
  rank: number;
  worldSize: number;
  localRank: number;
  localWorldSize: number;
  masterAddr: string;
  masterPort: number;
  /** Which family of variables described this process. */
  source: LaunchSource;
}

export const DEFAULT_MASTER_ADDR = '127.0.0.1';
export const DEFAULT_MASTER_PORT = 29500;

type Env = Record<string, string | undefined>;

/** Thrown for a launch variable that is present but malformed; names the variable. */
export class LaunchEnvError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'LaunchEnvError';
  }
}

function present(env: Env, name: string): boolean {
  const v = env[name];
  return v !== undefined && v.trim() !== '';
}

/** A non-negative integer (min 1 when `positive`), or a LaunchEnvError naming the variable. */
export function intVar(env: Env, name: string, opts: { positive?: boolean } = {}): number {
  const raw = (env[name] ?? '').trim();
  if (!/^\d+$/.test(raw)) {
    throw new LaunchEnvError(`${name}=${JSON.stringify(env[name] ?? '')} is not a ${opts.positive ? 'positive' : 'non-negative'} integer`);
  }
  const v = Number(raw);
  if (!Number.isSafeInteger(v) || (opts.positive && v < 1)) {
    throw new LaunchEnvError(`${name}=${JSON.stringify(env[name])} is not a ${opts.positive ? 'positive' : 'non-negative'} integer`);
  }
  return v;
}

function portVar(env: Env, name: string): number {
  if (!present(env, name)) return DEFAULT_MASTER_PORT;
  const p = intVar(env, name);
  if (p < 1 || p > 65535) throw new LaunchEnvError(`${name}=${env[name]} is not a TCP port (1-65535)`);
  return p;
}

function addrVar(env: Env): string {
  if (!present(env, 'MASTER_ADDR')) return DEFAULT_MASTER_ADDR;
  const a = env.MASTER_ADDR!.trim();
  if (/\s/.test(a)) throw new LaunchEnvError(`MASTER_ADDR=${JSON.stringify(env.MASTER_ADDR)} is not a host name or address`);
  return a;
}

/** Slurm writes tasks per node as "4", "4(x2)" or "4(x2),3": the first count is this layout's. */
function slurmTasksPerNode(env: Env): number | undefined {
  const raw = env.SLURM_NTASKS_PER_NODE ?? env.SLURM_TASKS_PER_NODE;
  if (raw === undefined || raw.trim() === '') return undefined;
  const m = /^\s*(\d+)/.exec(raw);
  if (!m) throw new LaunchEnvError(`SLURM_TASKS_PER_NODE=${JSON.stringify(raw)} does not start with a task count`);
  return Number(m[1]);
}

/**
 * Where the ranks of a Slurm job on several nodes meet when MASTER_ADDR / MASTER_PORT are not set:
 * the first host of SLURM_JOB_NODELIST, on the job's port ([Note: slurm port] in slurm_vars.ts).
 * On one node the defaults (loopback) stand.
 */
function slurmMaster(env: Env): { masterAddr?: string; masterPort?: number } {
  const nodes = Number((env.SLURM_NNODES ?? env.SLURM_JOB_NUM_NODES ?? '1').trim() || 1);
  if (!(nodes > 1)) return {};
  const out: { masterAddr?: string; masterPort?: number } = {};
  const first = present(env, 'MASTER_ADDR') ? undefined : slurmFirstHost(env);
  if (first !== undefined) out.masterAddr = first;
  if (!present(env, 'MASTER_PORT') && present(env, 'SLURM_JOB_ID')) out.masterPort = slurmPort(intVar(env, 'SLURM_JOB_ID'));
  return out;
}

/** The first host of SLURM_JOB_NODELIST (or SLURM_NODELIST), where a Slurm job's node 0 runs; undefined without one. */
export function slurmFirstHost(env: Env = process.env): string | undefined {
  const list = env.SLURM_JOB_NODELIST?.trim() || env.SLURM_NODELIST?.trim();
  if (!list) return undefined;
  try {
    return expandHostlist(list)[0];
  } catch (e) {
    throw new LaunchEnvError(`SLURM_JOB_NODELIST: ${(e as Error).message}`);
  }
}

function check(e: LaunchEnv, names: { rank: string; size: string; localRank: string; localSize: string }): LaunchEnv {
  if (e.rank >= e.worldSize) {
    throw new LaunchEnvError(`${names.rank}=${e.rank} is not below ${names.size}=${e.worldSize}`);
  }
  if (e.localWorldSize > e.worldSize) {
    throw new LaunchEnvError(`${names.localSize}=${e.localWorldSize} is larger than ${names.size}=${e.worldSize}`);
  }
  if (e.localRank >= e.localWorldSize) {
    throw new LaunchEnvError(`${names.localRank}=${e.localRank} is not below ${names.localSize}=${e.localWorldSize}`);
  }
  return e;
}

/**
 * Reads the launch contract from `env` (default: process.env). Throws LaunchEnvError naming the
 * variable when one is present but malformed, or when a family is only partly set.
 */
export function readLaunchEnv(env: Env = process.env): LaunchEnv {
  if (present(env, 'RANK') || present(env, 'WORLD_SIZE')) {
    for (const n of ['RANK', 'WORLD_SIZE']) {
      if (!present(env, n)) throw new LaunchEnvError(`${n} is not set, but ${n === 'RANK' ? 'WORLD_SIZE' : 'RANK'} is: set both (a launcher such as \`flotilla run\` sets them)`);
    }
    // Without LOCAL_* every rank is taken to be on one host (the common hand-started case).
    return fromVars(env, 'torchrun', { rank: 'RANK', size: 'WORLD_SIZE', localRank: 'LOCAL_RANK', localSize: 'LOCAL_WORLD_SIZE' });
  }
  if (present(env, 'OMPI_COMM_WORLD_RANK')) {
    if (!present(env, 'OMPI_COMM_WORLD_SIZE')) throw new LaunchEnvError('OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not');
    return fromVars(env, 'mpirun', {
      rank: 'OMPI_COMM_WORLD_RANK', size: 'OMPI_COMM_WORLD_SIZE', localRank: 'OMPI_COMM_WORLD_LOCAL_RANK', localSize: 'OMPI_COMM_WORLD_LOCAL_SIZE',
    });
  }
  if (present(env, 'SLURM_PROCID')) {
    if (!present(env, 'SLURM_NTASKS')) throw new LaunchEnvError('SLURM_PROCID is set but SLURM_NTASKS is not');
    // Slurm gives the tasks per node as a list ("2(x3),1"), not a number: read its first count.
    const e = fromVars(env, 'srun', { rank: 'SLURM_PROCID', size: 'SLURM_NTASKS', localRank: 'SLURM_LOCALID', localSize: 'SLURM_TASKS_PER_NODE' },
      (e) => (present(e, 'SLURM_LOCALID') ? slurmTasksPerNode(e) : undefined));
    return { ...e, ...slurmMaster(env) };
  }
  return {
    rank: 0, worldSize: 1, localRank: 0, localWorldSize: 1,
    masterAddr: addrVar(env), masterPort: portVar(env, 'MASTER_PORT'), source: 'single',
  };
}

/**
 * One launcher's variables read into a LaunchEnv. A missing local rank means one host (local rank =
 * rank); a missing local size means all ranks on it. readLocalSize replaces the plain integer read
 * where a launcher spells the local size differently (srun).
 */
function fromVars(
  env: Env, source: LaunchSource,
  names: { rank: string; size: string; localRank: string; localSize: string },
  readLocalSize = (e: Env): number | undefined => (present(e, names.localSize) ? intVar(e, names.localSize, { positive: true }) : undefined),
): LaunchEnv {
  const rank = intVar(env, names.rank);
  const worldSize = intVar(env, names.size, { positive: true });
  const localRank = present(env, names.localRank) ? intVar(env, names.localRank) : rank;
  const localWorldSize = readLocalSize(env) ?? worldSize;
  return check({ rank, worldSize, localRank, localWorldSize, masterAddr: addrVar(env), masterPort: portVar(env, 'MASTER_PORT'), source }, names);
}

/** The process-group timeout: FLOTILLA_TIMEOUT_MS, else `fallback`. */
export function timeoutFromEnv(fallback: number, env: Env = process.env): number {
  if (!present(env, 'FLOTILLA_TIMEOUT_MS')) return fallback;
  return intVar(env, 'FLOTILLA_TIMEOUT_MS', { positive: true });
}

/** True for 127.0.0.0/8, ::1 and localhost: every rank is then on this host. */
export function isLoopback(addr: string): boolean {
  return addr === 'localhost' || addr === '::1' || /^127\.\d+\.\d+\.\d+$/.test(addr);
}

/**
 * Checks the FLOTILLA_* variables that tune a run, so that a bad value is one message from the
 * command that starts the run instead of a failure inside every rank. Throws LaunchEnvError naming
 * the variable and what it accepts.
 */
export function checkFlotillaEnv(env: Env = process.env, interfaces: () => string[] = () => Object.keys(networkInterfaces())): void {
  for (const name of ['FLOTILLA_TIMEOUT_MS', 'FLOTILLA_NUM_THREADS']) {
    if (present(env, name)) intVar(env, name, { positive: true });
  }
  if (present(env, 'FLOTILLA_KILL_GRACE_MS')) intVar(env, 'FLOTILLA_KILL_GRACE_MS');
  for (const name of ['FLOTILLA_HEARTBEAT_MS', 'FLOTILLA_HEARTBEAT_TIMEOUT_MS']) {
    if (present(env, name)) intVar(env, name, { positive: true });
  }
  if (present(env, 'FLOTILLA_HEARTBEAT_PORT')) portVar(env, 'FLOTILLA_HEARTBEAT_PORT');
  if (present(env, 'FLOTILLA_MPI_NETNS') && !['0', '1'].includes(env.FLOTILLA_MPI_NETNS!.trim())) {
    throw new LaunchEnvError(`FLOTILLA_MPI_NETNS=${JSON.stringify(env.FLOTILLA_MPI_NETNS)} must be 1 (mpirun in a loopback-only network namespace, the default) or 0 (the host's network)`);
  }
  try {
    allocatorChoice(env);
  } catch (e) {
    throw new LaunchEnvError((e as Error).message);
  }
  for (const name of ['FLOTILLA_GLOO_IFACE', 'GLOO_SOCKET_IFNAME']) {
    const iface = env[name]?.trim();
    if (!iface) continue;
    const known = interfaces();
    if (!known.includes(iface)) {
      throw new LaunchEnvError(`${name}=${JSON.stringify(env[name])} is not a network interface of this host (it has ${known.join(', ')})`);
    }
  }
  const host = env.FLOTILLA_GLOO_HOSTNAME;
  if (host !== undefined && host.trim() !== '' && /\s/.test(host.trim())) {
    throw new LaunchEnvError(`FLOTILLA_GLOO_HOSTNAME=${JSON.stringify(host)} is not a host name or address`);
  }
  const secret = env.FLOTILLA_JOB_SECRET;
  if (secret !== undefined && secret !== '' && secret.length < 16) {
    throw new LaunchEnvError(`FLOTILLA_JOB_SECRET is ${secret.length} characters long; use at least 16 random ones (e.g. \`openssl rand -hex 32\`)`);
  }
}
