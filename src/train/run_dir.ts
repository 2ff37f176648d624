// A run's directory, as the launcher and every rank see it: where it is, whether a new run may
// take it (an earlier run's directory is refused unless resumed), the lock of the run that holds it,
// and which checkpoint a resume reads. Loads no tensor code: the launcher checks a directory
// before any rank starts without loading the addon.
//
// [Note: run lock] RUN/.lock names the live run holding the directory (pid, host, the process's
// start time, since when, and under `flotilla run` its job and attempt). A second run is refused
// before it starts, naming the holder; a lock whose process is gone (same host: no such pid, a new
// process under a reused pid, or a zombie: killed, not yet reaped) is stale and taken over. A rank of
// a later attempt of the same job (a restarted group, or an elastic meeting after its rank 0's host
// was lost) takes over the lock of an earlier one on any host: that rank is gone or going. The lock
// goes when the holder ends, by close() or from its exit handler; a killed holder leaves a stale
// lock, which the next run takes over. Any other lock from another host cannot be checked from
// here: it is refused and the message says how to remove it.
import { randomBytes } from 'node:crypto';
import { closeSync, existsSync, mkdirSync, openSync, readdirSync, readFileSync, statSync, unlinkSync, writeFileSync, writeSync } from 'node:fs';
import { hostname } from 'node:os';
import { join, resolve } from 'node:path';
import { launcherEnv, restarted } from '../distributed/launcher_env.js';
import { CheckpointError, listCheckpoints, resolveCheckpoint } from '../checkpoint/format.js';
import { ConfigError } from '../config/error.js';
import type { FlotillaConfig } from '../config/schema.js';

/** The run directory: train.runDir, or runs/<train.name>. */
export function runDirOf(c: FlotillaConfig): string {
  return c.train.runDir !== '' ? c.train.runDir : `runs/${c.train.name}`;
}

/** True when `dir` (or its checkpoints/ subdirectory) holds a safetensors checkpoint. */
function hasCheckpoints(dir: string): boolean {
  for (const d of [dir, join(dir, 'checkpoints')]) {
    try {
      if (readdirSync(d).some((f) => f.endsWith('.safetensors') || (/^step-\d+$/.test(f) && existsSync(join(d, f, 'meta.json'))))) return true;
    } catch {
      // no such directory
    }
  }
  return false;
}

/** The lock file's name inside a run directory ([Note: run lock]). */
export const LOCK_FILE = '.lock';

interface LockHolder {
  pid: number;
  host: string;
  /** The process's start time (/proc/PID/stat field 22), so a reused pid is not taken for the holder. */
  startTicks: string;
  since: string;
  /** Random, per lock: whether another host's rank sees this very lock (a shared directory). */
  token?: string;
  /** Under `flotilla run`: the job (the same on every host and attempt) and the attempt that took the lock. */
  job?: string;
  attempt?: number;
}

/** A live process's start time (/proc/PID/stat field 22); undefined when there is no such process, or only its zombie. */
function startTicksOf(pid: number): string | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return fields[0] === 'Z' || fields[0] === 'X' ? undefined : fields[19];
  } catch {
    return undefined;
  }
}

/** Whether `h` was taken by an earlier attempt of this process's own job ([Note: run lock]). */
function ownEarlierAttempt(h: LockHolder): boolean {
  const me = launcherEnv();
  return me.job !== undefined && h.job === me.job && me.attempt !== undefined && typeof h.attempt === 'number' && h.attempt < me.attempt;
}

function readHolder(path: string): LockHolder | undefined {
  try {
    const h = JSON.parse(readFileSync(path, 'utf8')) as LockHolder;
    return typeof h.pid === 'number' && typeof h.host === 'string' ? h : undefined;
  } catch {
    return undefined; // cut short while written, or not ours: stale
  }
}

/** The live run holding `dir`, or undefined when the directory is free or its lock is stale. */
function liveHolder(dir: string): LockHolder | undefined {
  const h = readHolder(join(dir, LOCK_FILE));
  if (!h || ownEarlierAttempt(h)) return undefined;
  if (h.host !== hostname()) return h; // cannot be checked from here
  if (h.pid === process.pid) return undefined;
  const ticks = startTicksOf(h.pid);
  return ticks !== undefined && ticks === h.startTicks ? h : undefined;
}

function lockMessage(dir: string, h: LockHolder): string {
  const where = h.host === hostname() ? `pid ${h.pid}` : `pid ${h.pid} on host ${h.host}`;
  const fix = h.host === hostname()
    ? `wait for it to end or stop it (kill ${h.pid})`
    : `wait for it to end, or, if that run is gone, delete ${join(dir, LOCK_FILE)}`;
  return `the run directory ${dir} is in use by a live run (${where}, since ${h.since}); ${fix}, or pick another --train.runDir / --train.name`;
}

/**
 * Why the run directory cannot be used, or undefined when it can: a live run holds it; a new run
 * refuses a directory that already has files (an earlier run's), so nothing is overwritten
 * silently; `resume` accepts one. Changes nothing on disk.
 */
export function runDirProblem(c: FlotillaConfig, opts: { resume?: boolean } = {}): string | undefined {
  const dir = runDirOf(c);
  const which = c.train.runDir !== '' ? `--train.runDir=${c.train.runDir}` : `--train.name=${c.train.name}`;
  if (!existsSync(dir)) return opts.resume ? `cannot resume: the run directory ${dir} does not exist (check ${which})` : undefined;
  if (!statSync(dir).isDirectory()) return `the run directory ${dir} exists and is not a directory; pick another --train.name (or --train.runDir)`;
  const holder = liveHolder(dir);
  if (holder) return lockMessage(dir, holder);
  const files = readdirSync(dir).filter((f) => f !== LOCK_FILE);
  if (opts.resume || files.length === 0) return undefined;
  const fix = c.train.runDir !== ''
    ? 'pick another --train.runDir'
    : `pick another --train.name (e.g. --train.name=${c.train.name}-2)`;
  if (hasCheckpoints(dir)) {
    return `the run directory ${dir} holds checkpoints of an earlier run: resume that run from them, ${fix}, or delete ${dir} to start over`;
  }
  return `the run directory ${dir} already holds an earlier run (${which}); ${fix}, or delete ${dir} to start over`;
}

/**
 * Checks the run directory (runDirProblem) and creates it; throws ConfigError naming the fix.
 * Returns its path. A group restarted by `flotilla run --max-restarts` (FLOTILLA_RESTART_COUNT > 0)
 * reuses the directory its first attempt created.
 */
export function prepareRunDir(c: FlotillaConfig, opts: { resume?: boolean } = {}): string {
  const dir = runDirOf(c);
  const problem = runDirProblem(c, { resume: opts.resume });
  if (problem !== undefined && !(restarted() && existsSync(dir) && !liveHolder(dir))) throw new ConfigError([problem]);
  mkdirSync(dir, { recursive: true });
  return dir;
}

/**
 * Takes the directory's lock for this process ([Note: run lock]); throws ConfigError naming a live
 * holder. Returns the release function (also run at process exit).
 */
export function lockRunDir(dir: string): { release: () => void; token: string } {
  const path = join(dir, LOCK_FILE);
  const token = randomBytes(16).toString('hex');
  const run = launcherEnv();
  const me: LockHolder = {
    pid: process.pid, host: hostname(), startTicks: startTicksOf(process.pid) ?? '', since: new Date().toISOString(), token,
    ...(run.job !== undefined && run.attempt !== undefined ? { job: run.job, attempt: run.attempt } : {}),
  };
  for (let attempt = 0; ; attempt++) {
    try {
      const fd = openSync(path, 'wx'); // atomic: of two runs starting together, one gets it
      writeSync(fd, JSON.stringify(me));
      closeSync(fd);
      break;
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== 'EEXIST' || attempt > 0) {
        const h = readHolder(path);
        throw new ConfigError([h ? lockMessage(dir, h) : `cannot lock the run directory ${dir}: ${(e as Error).message}`]);
      }
      const h = liveHolder(dir);
      if (h) throw new ConfigError([lockMessage(dir, h)]);
      unlinkSync(path); // stale: its run is gone, or its job's earlier attempt
    }
  }
  let held = true;
  const release = (): void => {
    if (!held) return;
    held = false;
    process.off('exit', release);
    try {
      if (readHolder(path)?.token === token) unlinkSync(path); // not one a later attempt took over
    } catch {
      // already gone
    }
  };
  process.on('exit', release);
  return { release, token };
}

/** Whether `dir`'s lock is the one with `token` (the directory is rank 0's, seen from here). */
export function lockedBy(dir: string, token: string): boolean {
  return readHolder(join(dir, LOCK_FILE))?.token === token;
}

/** The checkpoints directory of a run's config. */
export function checkpointDirOf(cfg: FlotillaConfig): string {
  return cfg.checkpoint.dir !== '' ? resolve(cfg.checkpoint.dir) : join(runDirOf(cfg), 'checkpoints');
}

/**
 * Which checkpoint a run resumes from: `--resume latest` (or no path) means the newest complete one
 * in the run's checkpoint directory; a path names a checkpoint, a checkpoints directory or a run
 * directory. A group restarted by `--max-restarts` resumes from the latest one when there is one.
 */
export function resumeTarget(cfg: FlotillaConfig, resume: string | undefined): string | undefined {
  const dir = checkpointDirOf(cfg);
  if (resume === undefined) return restarted() && listCheckpoints(dir).length > 0 ? resolveCheckpoint(dir) : undefined;
  if (resume === '' || resume === 'latest') {
    if (listCheckpoints(dir).length === 0) {
      throw new CheckpointError(`--resume latest: no complete checkpoint in ${dir}; start the run without --resume, or name a checkpoint: --resume PATH`);
    }
    return resolveCheckpoint(dir);
  }
  return resolveCheckpoint(resume);
}
