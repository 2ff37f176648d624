// The trainer's side of checkpoints: when to save, what a resume restores, and a stop request
// (Ctrl-C) that every rank honours at the same step boundary. The files themselves are
// src/checkpoint's business.
import { existsSync } from 'node:fs';
import { tensor } from '../tensor/index.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { ParamPlacement } from '../parallel/placement.js';
import { Checkpointer, removeInterruptedSaves, loadCheckpoint, loadWeights, type RankState, type RunInfo, type SaveReport } from '../checkpoint/checkpoint.js';
import { CheckpointError, readMeta, type CheckpointMeta } from '../checkpoint/format.js';
import { ConfigError } from '../config/error.js';
import { initFromHf, isHfDir } from '../checkpoint/hf.js';
import type { FlotillaConfig } from '../config/schema.js';
import { checkpointDirOf, resumeTarget } from './run_dir.js';
import { gatherNewest } from '../checkpoint/replicas.js';
import { regroupAsked } from '../distributed/launcher_channel.js';
import { launcherEnv, restarted } from '../distributed/launcher_env.js';
import { inSlurmJob } from '../distributed/slurm_vars.js';

/** A seed for step `step`'s random draws (dropout), so a resumed run draws what the straight run drew. */
export function stepSeed(seed: number, step: number): number {
  let z = (seed ^ Math.imul(step + 1, 0x9e3779b9)) >>> 0;
  z = Math.imul(z ^ (z >>> 16), 0x21f0aaad);
  z = Math.imul(z ^ (z >>> 15), 0x735a2d97);
  return (z ^ (z >>> 15)) >>> 0;
}

export interface RunCheckpointsOptions {
  world: ProcessGroup;
  /** Ranks per host (LOCAL_WORLD_SIZE): more than one host with replicas saves without shared storage. */
  ranksPerHost: number;
  log: (line: string) => void;
}

/**
 * [checkpoint] replicas resolved: -1 is 1 when the world spans several hosts, except in a Slurm job
 * (or with [slurm] requeue = true, whose checkpoint.dir is on storage every node sees): the nodes of
 * an allocation share the job's working directory, so every host writes into the one checkpoint
 * directory (replicas = 1 would refuse that at the first save).
 */
export function replicasOf(cfg: FlotillaConfig, worldSize: number, ranksPerHost: number): 0 | 1 {
  const r = cfg.checkpoint.replicas;
  return r === 1 || (r === -1 && !cfg.slurm.requeue && !inSlurmJob() && worldSize > ranksPerHost) ? 1 : 0;
}

/** Saving during a run: the schedule, and the save itself. */
export class RunCheckpoints {
  private checkpointer: Checkpointer | undefined;
  private readonly cfg: FlotillaConfig;
  private readonly opts: RunCheckpointsOptions;
  /** Blocked time of every save this run (the benchmark and the end-of-run line read it). */
  readonly saves: SaveReport[] = [];

  constructor(cfg: FlotillaConfig, opts: RunCheckpointsOptions) {
    this.cfg = cfg;
    this.opts = opts;
  }

  get dir(): string {
    return checkpointDirOf(this.cfg);
  }

  /** Rank 0 (each host's first rank with replicas), before the first step: clears saves an earlier run left unfinished. */
  prepare(): void {
    const { world, ranksPerHost } = this.opts;
    const replicated = replicasOf(this.cfg, world.size, ranksPerHost) === 1;
    if (replicated ? world.rank % ranksPerHost !== 0 : world.rank !== 0) return;
    const gone = removeInterruptedSaves(this.dir);
    if (gone.length > 0) this.opts.log(`[checkpoint] removed ${gone.length} unfinished save(s) of an earlier run: ${gone.join(', ')}`);
  }

  /**
   * The checkpoint this run resumes from (run_record's resumeTarget). Across hosts without shared
   * storage ([checkpoint] replicas), `latest` and a restarted group first gather the newest
   * checkpoint the hosts hold together, so every host's directory holds all of it (collective).
   */
  resumeTarget(resume: string | undefined): string | undefined {
    const { world, ranksPerHost } = this.opts;
    const latest = resume === undefined ? restarted() : resume === '' || resume === 'latest';
    if (!latest || replicasOf(this.cfg, world.size, ranksPerHost) === 0) return resumeTarget(this.cfg, resume);
    const g = gatherNewest(world, this.dir, ranksPerHost);
    if (g.path === undefined) {
      if (resume === undefined) return undefined;
      throw new CheckpointError(`--resume latest: no checkpoint whose files the ${world.size / ranksPerHost} hosts hold together in ${this.dir}; start the run without --resume, or name a checkpoint: --resume PATH`);
    }
    if (g.files > 0) this.opts.log(`[checkpoint] ${g.path} completed on every host: ${g.files} file(s), ${g.bytes.toLocaleString('en-US')} bytes sent between hosts`);
    return g.path;
  }

  /** Whether the schedule saves after `step` steps (the last step included when saving is on). */
  due(step: number): boolean {
    const every = this.cfg.checkpoint.every;
    return every > 0 && (step % every === 0 || step === this.cfg.train.steps);
  }

  async save(step: number, state: RankState, info: RunInfo): Promise<SaveReport> {
    this.checkpointer ??= new Checkpointer({
      dir: this.dir, keep: this.cfg.checkpoint.keep, async: this.cfg.checkpoint.async, world: this.opts.world, log: this.opts.log,
      ranksPerHost: this.opts.ranksPerHost, replicas: replicasOf(this.cfg, this.opts.world.size, this.opts.ranksPerHost),
    });
    const r = await this.checkpointer.save(step, state, info);
    this.saves.push(r);
    return r;
  }

  /** At every step boundary: publishes a finished background save (collective while one is pending). */
  poll(): void {
    this.checkpointer?.poll();
  }

  /** Waits for the last save and publishes it (collective). */
  async finish(): Promise<void> {
    if (!this.checkpointer) return;
    try {
      await this.checkpointer.finishPending();
    } finally {
      await this.checkpointer.close();
    }
  }

  /** The newest checkpoint this run published. */
  get lastSaved(): string | undefined {
    return this.checkpointer?.lastSaved;
  }
}

/**
 * Restores a resumed run's parameters and optimizer state (weights only for initFrom). numParams is
 * what the checkpoint must hold in all: the whole model's parameters, or a LoRA run's adapters'
 * (undefined: not checked, for a model that cannot count them before it is built).
 */
export function restore(target: string, state: RankState, numParams: number | undefined): CheckpointMeta {
  // Optimizer state is only meaningful to the optimizer that wrote it (AdamW's moments are not SGD's).
  const saved = state.optimizer && state.optimizerName ? readMeta(target).optimizer?.name : undefined;
  if (saved !== undefined && saved !== state.optimizerName) {
    throw new ConfigError([`the checkpoint ${target} holds ${saved} optimizer state, and optim.name chooses ${state.optimizerName}: set optim.name to the optimizer that saved it, or start a new run from its weights with train.initFrom (fresh optimizer state)`]);
  }
  return loadCheckpoint(target, state.placements, { ...(state.optimizer ? { optimizer: state.optimizer } : {}), ...(numParams !== undefined ? { numParams } : {}) });
}

/**
 * Loads train.initFrom's weights (a checkpoint directory, an exported .safetensors file, or a
 * Hugging Face directory, whose config must be the run's [model]); each rank reads its own ranges.
 */
export function initFrom(path: string, placements: readonly ParamPlacement[], numParams: number, model?: Record<string, unknown>): void {
  if (!existsSync(path)) throw new CheckpointError(`train.initFrom: ${path} does not exist; name a checkpoint directory, an exported .safetensors file or a Hugging Face model directory`);
  if (isHfDir(path)) initFromHf(path, placements, model, numParams);
  else loadWeights(path, placements, numParams);
}

/** Left on SIGUSR1 after a run in a Slurm job ([Note: slurm stop]). */
const ignoreSignal = (): void => {};

/** The signals that stop a run, weakest first ([Note: slurm stop]). */
const STOP_SIGNALS: readonly NodeJS.Signals[] = ['SIGINT', 'SIGUSR1', 'SIGTERM'];

/**
 * Ctrl-C: the first SIGINT asks the run to stop after the current step, with a checkpoint; a second one in a process without a launcher exits at once. Under `flotilla run` the
 * terminal's SIGINT and the launcher's forwarded one arrive together, so a rank leaves the second
 * to the launcher, which kills the ranks when its user presses Ctrl-C again.
 *
 * [Note: slurm stop] In a Slurm job SIGUSR1 (sbatch --signal=USR1@90: the time limit is near) and
 * SIGTERM (scancel, preemption) ask the same: a checkpoint at the end of the step every rank agrees
 * on, then a clean exit; a repeated one changes nothing (Slurm's SIGKILL ends what must end). Which
 * signal stopped the run is agreed too (SIGTERM over SIGUSR1 over SIGINT, as one max): only a stop
 * for SIGUSR1 requeues the job ([slurm] requeue, the trainer). Outside Slurm, SIGTERM keeps its
 * default (the process ends) and SIGUSR1 is left alone. After the run (dispose) a SIGUSR1 is
 * ignored in a Slurm job: a real job's time-limit warning that came after the last step (Slurm
 * signals every process of the step, the ranks besides their launcher's forwarding) otherwise
 * killed the finished ranks (exit 138) and failed the job.
 */
export class StopRequest {
  /** 0: none; else the strongest signal seen here (STOP_SIGNALS' order). */
  private requested = 0;
  private readonly handler: (sig: NodeJS.Signals) => void;
  private readonly launched = launcherEnv().attempt !== undefined;
  private readonly signals: NodeJS.Signals[] = inSlurmJob() ? ['SIGINT', 'SIGUSR1', 'SIGTERM'] : ['SIGINT'];
  /** The signal the world agreed stopped it, once it did. */
  stoppedBy: NodeJS.Signals | undefined;

  constructor(private readonly log: (line: string) => void) {
    this.handler = (sig) => {
      if (sig === 'SIGINT' && this.requested > 0 && !this.launched) {
        process.stderr.write(`flotilla: second ${sig}; exiting now without saving\n`);
        process.exit(130);
      }
      if (this.requested === 0) this.log(`[stop] ${sig}: stopping after this step with a checkpoint${sig === 'SIGINT' ? ' (press Ctrl-C again to exit at once)' : ''}`);
      this.requested = Math.max(this.requested, STOP_SIGNALS.indexOf(sig) + 1);
    };
    for (const s of this.signals) process.on(s, this.handler);
  }

  /**
   * Whether any rank was asked to stop now (a signal), and whether any was asked to stop at its next
   * checkpoint for a host that joins (collective over the world: every rank learns the same).
   */
  agreed(world: ProcessGroup): { stop: boolean; regroup: boolean } {
    const regroup = regroupAsked(); // a host joins: stop at the next checkpoint ([Note: elastic grow])
    let stop = this.requested;
    if (world.size > 1) {
      const t = tensor([this.requested, regroup ? 1 : 0], { dtype: 'float64' });
      try {
        world.allReduce(t, 'max').wait();
        const [s, r] = t.toNumbers() as [number, number];
        stop = s;
        if (stop > 0) this.stoppedBy = STOP_SIGNALS[stop - 1];
        return { stop: stop > 0, regroup: r > 0 };
      } finally {
        t.dispose();
      }
    }
    if (stop > 0) this.stoppedBy = STOP_SIGNALS[stop - 1];
    return { stop: stop > 0, regroup };
  }

  dispose(): void {
    for (const s of this.signals) process.off(s, this.handler);
    if (this.signals.includes('SIGUSR1') && !process.listeners('SIGUSR1').includes(ignoreSignal)) process.on('SIGUSR1', ignoreSignal);
  }
}

