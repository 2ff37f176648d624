// What a run leaves in its directory, kept by rank 0: the directory itself (refused when an earlier
// run's, held by a lock while the run lives), the resolved config, metrics.jsonl, and the [memory]
// line. The trainer only hands it steps; the CLI draws the report from metrics.jsonl.
//
// [Note: run lock] RUN/.lock names the live run holding the directory (pid, host, the process's
// start time, since when). A second run is refused before it starts, naming the holder; a lock
// whose process is gone (same host: no such pid, or a new process under a reused pid) is stale
// and taken over. The lock goes when the holder ends, by close() or from its exit handler; a
// killed holder leaves a stale lock, which the next run takes over. A lock from another host
// cannot be checked from here: it is refused and the message says how to remove it.
//
// [Note: run record on every host] Across hosts the run directory may be local to each host (as
// checkpoints may be, [Note: checkpoint replicas]). Rank 0 opens its record first and tells every
// rank its lock's token and its metrics up to the start step; the first rank of each other host
// whose run directory shows another lock (not rank 0's: the directory is not shared) keeps a record
// of its own there: its lock, its resolved config, and metrics.jsonl, rank 0's lines so far then
// the same rows as rank 0 (loss, gradient norm, validation loss and learning rate are the same on
// every rank; tokens/s and elapsed time are that host's). So whichever host becomes node 0 after a
// loss finds its lock free and a complete metrics.jsonl on its own disk, continued from the
// resumed step. On one host, or a shared directory, only rank 0 keeps it, as before.
import { randomBytes } from 'node:crypto';
import { closeSync, existsSync, mkdirSync, openSync, readdirSync, readFileSync, statSync, unlinkSync, writeFileSync, writeSync } from 'node:fs';
import { hostname } from 'node:os';
import { join, resolve } from 'node:path';
import { CheckpointError, listCheckpoints, resolveCheckpoint } from '../checkpoint/format.js';
import { ConfigError } from '../config/error.js';
import { configToToml } from '../config/parse.js';
import type { FlotillaConfig } from '../config/schema.js';
import type { MemoryReport } from '../parallel/memory.js';
import type { TensorCacheStats } from '../tensor/allocator.js';
import { MetricsWriter, type StepMetrics } from './metrics.js';
import { broadcastJson } from '../checkpoint/replicas.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { LaunchEnv } from '../distributed/env.js';

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
}

function startTicksOf(pid: number): string | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2).split(' ')[19];
  } catch {
    return undefined;
  }
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
  if (!h) return undefined;
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
  const restarted = Number(process.env.FLOTILLA_RESTART_COUNT ?? 0) > 0;
  const dir = runDirOf(c);
  const problem = runDirProblem(c, { resume: opts.resume });
  if (problem !== undefined && !(restarted && existsSync(dir) && !liveHolder(dir))) throw new ConfigError([problem]);
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
  const me: LockHolder = { pid: process.pid, host: hostname(), startTicks: startTicksOf(process.pid) ?? '', since: new Date().toISOString(), token };
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
      unlinkSync(path); // stale: its run is gone
    }
  }
  let held = true;
  const release = (): void => {
    if (!held) return;
    held = false;
    process.off('exit', release);
    try {
      if (readHolder(path)?.pid === process.pid) unlinkSync(path);
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

const MiB = 2 ** 20;

/**
 * The [memory] line: what the layout's buffers hold per parameter, beside the process's own
 * resident size (`proc`, processMemory()) and the freed tensor memory its cache keeps (`cache`).
 */
export function memoryLine(memory: MemoryReport, numParams: number, proc: { rssBytes: number; peakBytes: number } | undefined, cache: TensorCacheStats): string {
  const per = (b: number) => `${(b / MiB).toFixed(2)} MiB (${(b / numParams).toFixed(2)} B/param)`;
  // The buffers are what a layout changes; the process also holds activations, staging, the
  // allocator's cache and the runtime, so its own resident size is printed beside them.
  const kept = cache.on ? `; ${(cache.cachedBytes / MiB).toFixed(0)} MiB of it is freed tensor memory the cache keeps` : '';
  const whole = proc
    ? `; the process: resident ${(proc.rssBytes / MiB).toFixed(0)} MiB, peak ${(proc.peakBytes / MiB).toFixed(0)} MiB (also activations, collective staging, freed memory kept for the next step, and the runtime${kept})`
    : ' (activations, collective staging and the runtime not counted)';
  return `[memory] rank 0 holds parameters ${per(memory.paramBytes)}, gradients ${per(memory.gradBytes)}, optimizer state ${per(memory.optimizerBytes)}; step peak ${per(memory.peakBytes)} of these buffers${whole}`;
}

export interface RunRecordOptions {
  /** Resuming a run whose directory exists (it is reused and its metrics continued). */
  resume: boolean;
  /** The step training starts from (0, or the resumed checkpoint's). */
  startStep: number;
  worldSize: number;
  /** Where the config came from and the command-line overrides, recorded in the saved config. */
  configPath?: string;
  overrides?: readonly string[];
  /** Another host's record ([Note: run record on every host]): rank 0's metrics lines up to startStep, written first. */
  history?: string;
}

/** Rank 0's record of a run in its directory. */
export class RunRecord {
  readonly dir: string;
  private readonly metrics: MetricsWriter | undefined;
  private readonly unlock: () => void;
  /** The lock's token ([Note: run record on every host]). */
  readonly token: string;

  constructor(cfg: FlotillaConfig, opts: RunRecordOptions) {
    // Refuses an earlier run's directory (ConfigError naming --train.name) unless resuming it.
    // Resuming from a checkpoint PATH may start a new directory.
    this.dir = prepareRunDir(cfg, { resume: opts.resume && existsSync(runDirOf(cfg)) });
    const lock = lockRunDir(this.dir);
    this.unlock = lock.release;
    this.token = lock.token;
    try {
      const from = [opts.configPath ? `from ${opts.configPath}` : 'from defaults', ...(opts.overrides ?? [])].join(' ');
      const s = opts.startStep;
      // A resumed run keeps the first config.toml and records its own next to it.
      const file = s > 0 ? `config.resumed-${s}.toml` : 'config.toml';
      const header = `Resolved config of run "${cfg.train.name}" (${from}), world size ${opts.worldSize}${s > 0 ? `, resumed at step ${s}` : ''}.`;
      writeFileSync(join(this.dir, file), configToToml(cfg, { header }));
      if (cfg.log.metrics !== '' && opts.history !== undefined) writeFileSync(join(this.dir, cfg.log.metrics), opts.history);
      if (cfg.log.metrics !== '') this.metrics = new MetricsWriter(join(this.dir, cfg.log.metrics), s > 0 ? { continueAfter: s } : {});
    } catch (e) {
      this.unlock();
      throw e;
    }
  }

  /** Its metrics lines so far (after a resume: up to the start step), or '' when it keeps none. */
  history(): string {
    return this.metrics !== undefined && existsSync(this.metrics.path) ? readFileSync(this.metrics.path, 'utf8') : '';
  }

  /** The metrics file, when the run keeps one. */
  get metricsPath(): string | undefined {
    return this.metrics?.path;
  }

  step(row: StepMetrics): void {
    this.metrics?.write(row);
  }

  close(): void {
    this.metrics?.close();
    this.unlock();
  }
}

/**
 * This rank's record of the run: rank 0's, and across hosts that of each other host's first rank
 * whose run directory is not rank 0's ([Note: run record on every host]). A collective when the
 * world spans hosts; undefined on the ranks that keep none.
 */
export function openRunRecord(cfg: FlotillaConfig, world: ProcessGroup, env: LaunchEnv, opts: RunRecordOptions): RunRecord | undefined {
  const rank0 = env.rank === 0 ? new RunRecord(cfg, opts) : undefined;
  if (env.worldSize === env.localWorldSize) return rank0;
  const told = broadcastJson<{ token: string; history: string }>(world, rank0 ? { token: rank0.token, history: rank0.history() } : undefined);
  if (rank0 || env.localRank !== 0 || lockedBy(runDirOf(cfg), told.token)) return rank0;
  return new RunRecord(cfg, { ...opts, history: told.history });
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
  const restarted = Number(process.env.FLOTILLA_RESTART_COUNT ?? 0) > 0;
  const dir = checkpointDirOf(cfg);
  if (resume === undefined) return restarted && listCheckpoints(dir).length > 0 ? resolveCheckpoint(dir) : undefined;
  if (resume === '' || resume === 'latest') {
    if (listCheckpoints(dir).length === 0) {
      throw new CheckpointError(`--resume latest: no complete checkpoint in ${dir}; start the run without --resume, or name a checkpoint: --resume PATH`);
    }
    return resolveCheckpoint(dir);
  }
  return resolveCheckpoint(resume);
}
