// What a run leaves in its directory, kept by rank 0: the directory itself (run_dir.ts: refused when
// an earlier run's, held by a lock while the run lives, [Note: run lock]), the resolved config,
// metrics.jsonl, and the [memory] line. The trainer only hands it steps; the CLI draws the report
// from metrics.jsonl.
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
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { configToToml } from '../config/parse.js';
import type { FlotillaConfig } from '../config/schema.js';
import type { MemoryReport } from '../parallel/data_parallel/memory.js';
import type { TensorCacheStats } from '../tensor/allocator.js';
import { MetricsWriter, type StepMetrics } from './metrics.js';
import { TensorBoardWriter } from './tensorboard.js';
import { broadcastJson } from '../checkpoint/replicas.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { LaunchEnv } from '../distributed/env.js';
import { lockedBy, lockRunDir, prepareRunDir, runDirOf } from './run_dir.js';

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
  private readonly tb: TensorBoardWriter | undefined;
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
      const toml = configToToml(cfg, { header });
      writeFileSync(join(this.dir, file), toml);
      if (cfg.log.metrics !== '' && opts.history !== undefined) writeFileSync(join(this.dir, cfg.log.metrics), opts.history);
      if (cfg.log.metrics !== '') this.metrics = new MetricsWriter(join(this.dir, cfg.log.metrics), s > 0 ? { continueAfter: s } : {});
      if (cfg.log.tensorboard) {
        this.tb = new TensorBoardWriter(join(this.dir, 'tb'), s > 0 ? { continueAfter: s } : {});
        this.tb.text('config', `\`\`\`toml\n${toml}\`\`\``, s);
      }
    } catch (e) {
      this.metrics?.close();
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
    this.tb?.step(row);
  }

  close(): void {
    this.metrics?.close();
    this.tb?.close();
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
