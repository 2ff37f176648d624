// Slurm: where a `flotilla train` started by `srun` (one task per node) stands in its allocation,
// read from Slurm's variables, and the requeue of a job that was told to stop.
//
// [Note: slurm geometry] Inside an allocation whose tasks are one per node (SLURM_NTASKS equals
// SLURM_NNODES, e.g. `srun --ntasks-per-node=1 flotilla train CONFIG --nproc K`), each task is this
// node's launcher: nodes = SLURM_NNODES (or SLURM_JOB_NUM_NODES), node rank = SLURM_NODEID, master
// address = the first host of SLURM_JOB_NODELIST (expanded here as `scontrol show hostnames` does,
// without scontrol), and the master port derived from SLURM_JOB_ID (slurmPort). With one task per
// rank (more tasks than nodes, or no --nproc), each task is a rank and env.ts reads SLURM_PROCID /
// SLURM_NTASKS / SLURM_LOCALID. A --nnodes, --node-rank or --master-addr that disagrees with the
// allocation is one usage error; --nnodes MIN:MAX whose MAX is the allocation's node count keeps
// the elastic meaning (a node lost under `srun --no-kill`: the others carry on while MIN remain).
import { spawnSync } from 'node:child_process';
import { intVar, LaunchEnvError, slurmFirstHost } from '../distributed/env.js';
import { slurmPort } from '../distributed/slurm_vars.js';

type Env = Record<string, string | undefined>;

/** Where this node stands in a job of several nodes (flotilla train's --nnodes and companions). */
export interface SlurmHosts {
  nnodes: number;
  minNodes?: number;
  nodeRank: number;
  masterAddr?: string;
  masterPort?: number;
}

/** A Slurm count variable, undefined when unset (intVar's error when malformed). */
function num(env: Env, name: string): number | undefined {
  return env[name]?.trim() ? intVar(env, name) : undefined;
}

/** Slurm's node count: SLURM_NNODES, else SLURM_JOB_NUM_NODES. */
export function slurmNodes(env: Env = process.env): number | undefined {
  return num(env, 'SLURM_NNODES') ?? num(env, 'SLURM_JOB_NUM_NODES');
}

/**
 * This node's place in the job when `flotilla train` runs as one task per node of a Slurm
 * allocation ([Note: slurm geometry]): `hosts` for several nodes, none on one node (the launcher
 * runs there alone); undefined outside an allocation or with one task per rank (env.ts reads those
 * tasks). `given`: the command line's --nnodes and companions, checked against the allocation.
 */
export function slurmNodeTask(env: Env, nproc: number | undefined, given: SlurmHosts | undefined): { hosts?: SlurmHosts } | undefined {
  if (!env.SLURM_PROCID?.trim()) return undefined;
  const nodes = slurmNodes(env), tasks = num(env, 'SLURM_NTASKS');
  if (nodes === undefined || tasks === undefined || tasks !== nodes) return undefined; // one task per rank: env.ts
  if (nproc === undefined && given === undefined) return undefined; // one rank per task and node: env.ts too
  const nodeRank = num(env, 'SLURM_NODEID') ?? 0;
  const where = `inside a Slurm allocation of ${nodes} node${nodes === 1 ? '' : 's'} (job ${env.SLURM_JOB_ID ?? '?'})`;
  if (given !== undefined) {
    if (given.nnodes !== nodes) {
      throw new LaunchEnvError(`train: --nnodes ${given.minNodes !== undefined ? `${given.minNodes}:` : ''}${given.nnodes} ${where}: drop --nnodes (flotilla takes the allocation's nodes), or give MIN:${nodes} to carry on without a lost node`);
    }
    if (given.nodeRank !== nodeRank) throw new LaunchEnvError(`train: --node-rank ${given.nodeRank} ${where}, on the node Slurm numbers ${nodeRank} (SLURM_NODEID): drop --node-rank`);
  }
  if (nodes === 1) return {};
  const masterAddr = slurmFirstHost(env);
  if (masterAddr === undefined) throw new LaunchEnvError(`train: ${where} without SLURM_JOB_NODELIST: start flotilla train through srun`);
  if (given?.masterAddr !== undefined && given.masterAddr !== masterAddr) {
    throw new LaunchEnvError(`train: --master-addr ${given.masterAddr} ${where}, whose first node is ${masterAddr}: drop --master-addr`);
  }
  const jobId = num(env, 'SLURM_JOB_ID');
  const fromEnv = num(env, 'MASTER_PORT');
  const masterPort = given?.masterPort ?? fromEnv ?? (jobId !== undefined ? slurmPort(jobId) : undefined);
  return { hosts: { nnodes: nodes, nodeRank, masterAddr, ...(given?.minNodes !== undefined ? { minNodes: given.minNodes } : {}), ...(masterPort !== undefined ? { masterPort } : {}) } };
}

/**
 * `scontrol requeue $SLURM_JOB_ID` after the save a SIGUSR1 asked for ([slurm] requeue = true):
 * Slurm ends this job and queues it again; the new one resumes from the checkpoint. Returns the
 * line to log.
 */
export function requeueJob(env: Env = process.env): string {
  const id = env.SLURM_JOB_ID?.trim();
  if (!id) return '[slurm] requeue = true, but SLURM_JOB_ID is not set: not in a Slurm job, nothing to requeue';
  const r = spawnSync('scontrol', ['requeue', id], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  if (r.error) return `[slurm] could not run scontrol requeue ${id}: ${r.error.message}; requeue the job by hand (scontrol requeue ${id})`;
  if (r.status !== 0) return `[slurm] scontrol requeue ${id} failed (exit ${r.status}): ${(r.stderr || r.stdout).trim()}`;
  return `[slurm] requeued job ${id}: it resumes from this checkpoint when it starts again`;
}
