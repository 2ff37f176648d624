// What `flotilla run` tells its ranks beyond the rank variables of the launch contract (env.ts):
// the attempt, the restart budget, where the rank's line to the launcher goes (launcher_channel.ts),
// the launcher's terminal, the job's identity, and after an elastic meeting what happened. The
// launcher writes these variables with launcherVars and a rank reads them with launcherEnv, so each
// name is written down here once.
import { createHmac, randomBytes } from 'node:crypto';

type Env = Record<string, string | undefined>;

const NAMES = {
  attempt: 'FLOTILLA_RESTART_COUNT',
  maxRestarts: 'FLOTILLA_MAX_RESTARTS',
  job: 'FLOTILLA_JOB',
  statusFile: 'FLOTILLA_STATUS_FILE',
  regroupFile: 'FLOTILLA_REGROUP_FILE',
  terminal: 'FLOTILLA_LAUNCHER_TTY',
  elastic: 'FLOTILLA_ELASTIC',
  firstWorld: 'FLOTILLA_ELASTIC_WORLD',
} as const;

/** The launcher's word to one attempt's ranks. */
export interface LauncherEnv {
  /** The attempt: 0 for the first start, more for a restarted group or a later elastic meeting (FLOTILLA_RESTART_COUNT). */
  attempt: number;
  /** --max-restarts. */
  maxRestarts: number;
  /**
   * The job, the same for every attempt on every host of one job and different between jobs
   * ([Note: run lock]: a rank takes over the lock its own job's earlier attempt left).
   */
  job: string;
  /** Where a rank appends its events for the launcher (launcher_channel.ts). */
  statusFile: string;
  /** The file whose presence asks the ranks to stop at their next checkpoint ([Note: elastic grow]). */
  regroupFile: string;
  /** The launcher's terminal (a device path), or '0' when its stdout is none (progress.ts). */
  terminal: string;
  /** After an elastic meeting: what happened, for rank 0's [elastic] line ([Note: elastic shrink]). */
  elastic?: string;
  /** An elastic job: the world size of its first meeting ([Note: elastic micro-batches]). */
  firstWorld?: number;
}

/** The variables that tell `v` to an attempt's ranks. */
export function launcherVars(v: LauncherEnv): Record<string, string> {
  return {
    [NAMES.attempt]: String(v.attempt), [NAMES.maxRestarts]: String(v.maxRestarts), [NAMES.job]: v.job,
    [NAMES.statusFile]: v.statusFile, [NAMES.regroupFile]: v.regroupFile, [NAMES.terminal]: v.terminal,
    ...(v.elastic !== undefined ? { [NAMES.elastic]: v.elastic } : {}),
    ...(v.firstWorld !== undefined ? { [NAMES.firstWorld]: String(v.firstWorld) } : {}),
  };
}

const text = (s: string | undefined): string | undefined => (s?.trim() ? s.trim() : undefined);
const count = (s: string | undefined): number | undefined => {
  const n = Number(text(s) ?? NaN);
  return Number.isInteger(n) && n >= 0 ? n : undefined;
};

/** What this process's launcher said; every field undefined when `flotilla run` did not start it. */
export function launcherEnv(env: Env = process.env): Partial<LauncherEnv> {
  const out: Partial<LauncherEnv> = {};
  const attempt = count(env[NAMES.attempt]);
  if (attempt !== undefined) out.attempt = attempt;
  const maxRestarts = count(env[NAMES.maxRestarts]);
  if (maxRestarts !== undefined) out.maxRestarts = maxRestarts;
  const firstWorld = count(env[NAMES.firstWorld]);
  if (firstWorld !== undefined && firstWorld > 0) out.firstWorld = firstWorld;
  for (const k of ['job', 'statusFile', 'regroupFile', 'terminal', 'elastic'] as const) {
    const v = text(env[NAMES[k]]);
    if (v !== undefined) out[k] = v;
  }
  return out;
}

/** Whether this process belongs to a group `flotilla run` restarted, or to a later elastic meeting. */
export function restarted(env: Env = process.env): boolean {
  return (launcherEnv(env).attempt ?? 0) > 0;
}

/** Removes the launcher's line files from `env`, so that processes a rank starts do not write to them. */
export function forgetLauncherFiles(env: Env = process.env): void {
  delete env[NAMES.statusFile];
  delete env[NAMES.regroupFile];
}

/**
 * The job's identity as its launchers agree on it without talking: on several nodes, from what every
 * host's command gives (the job secret, the address and port of the first meeting's node 0, none
 * of which an elastic meeting changes), keyed so the lock shows no secret; on one node, the launcher's own.
 */
export function jobIdentity(o: { nnodes: number; masterAddr: string; masterPort: number | undefined; secret: string }): string {
  if (o.nnodes === 1) return randomBytes(16).toString('hex');
  return createHmac('sha256', o.secret).update(`flotilla-job:${o.masterAddr}:${o.masterPort ?? ''}`).digest('hex').slice(0, 32);
}
