// The trainer: one loop for every layout. The phases before it (world, mesh, data, model,
// parallelize, optimizer, checkpoint state) are phases.ts; what the run leaves in its directory
// (config, metrics, the lock) is the run record (run_record.ts); the report is drawn by the CLI.
import { liveTensors, manualSeed, releaseFreedMemory, releaseIdleMemory, tensorCacheStats, tidy } from '../tensor/index.js';
import { autocast } from '../nn/precision.js';
import { withActivationCheckpoint } from '../nn/checkpoint.js';
import { withKernels } from '../nn/kernels/choice.js';
import { withMoELossScale } from '../nn/moe.js';
import { readLaunchEnv } from '../distributed/env.js';
import { clippedStep } from '../optim/clipped_step.js';
import { processMemory, type MemoryReport } from '../parallel/data_parallel/memory.js';
import type { FlotillaConfig } from '../config/schema.js';
import { StopRequest, stepSeed } from './checkpointing.js';
import { tellLauncher } from '../distributed/launcher_channel.js';
import type { StepMetrics } from './metrics.js';
import type { StepResult } from '../parallel/parallel_model.js';
import { Progress, resolveProgressMode } from './progress.js';
import { openMfu, openRun, writeRankRecord, type RunParts } from './phases.js';
import { dpoMetrics } from './objective.js';
import { openRunRecord, memoryLine, type RunRecord } from './run_record.js';

export interface TrainOptions {
  /** Where the config came from, recorded in the saved config. */
  configPath?: string;
  /** Command-line overrides, recorded in the saved config. */
  overrides?: readonly string[];
  /** Rank 0's console sink (default: stdout). */
  print?: (line: string) => void;
  /** Called on every rank after each step (tests watch losses and live tensors through it). */
  onStep?: (m: StepMetrics & { liveTensors: number }) => void;
  /**
   * Every rank writes its own per-step loss and gradient norm (rank<r>.json) and, at the end, its
   * full parameters by model name (rank<r>.safetensors) here: `flotilla verify` compares them.
   */
  recordDir?: string;
  /**
   * Continue a run from a checkpoint: 'latest' (the newest in the run's checkpoint directory) or a
   * path. The run directory is reused and its metrics file continued.
   */
  resume?: string;
  /** Rank 0, once the run holds its directory (the CLI starts the report's watch there). */
  onRunDir?: (dir: string) => void | Promise<void>;
}

export interface TrainSummary {
  runDir: string;
  steps: number;
  worldSize: number;
  numParams: number;
  firstLoss: number;
  finalLoss: number;
  /** Validation loss at the last evaluation. */
  finalValLoss?: number;
  /** Mean tokens/s over the loop (evaluation excluded). */
  tokensPerSec: number;
  /** This rank's parameter, gradient and optimizer bytes after the last step, and the step peak (activations not counted). */
  memory?: MemoryReport;
  /** The step the run started from (0, or the resumed checkpoint's step). */
  startStep: number;
  /** Steps completed when the run ended (less than steps when it was stopped by Ctrl-C). */
  endStep: number;
  /** The newest checkpoint the run published, if any. */
  checkpoint?: string;
  /** Milliseconds training was blocked by each checkpoint save. */
  saveBlockedMs: number[];
}

/** Trains the model a config describes; every rank of the world calls it. */
/**
 * After step `done`: the checkpoint when it is due or a stop was asked for; true when the loop ends
 * here (a stop, or a host joining the job).
 */
async function endOfStep(run: RunParts, done: number, steps: number, stopRequest: StopRequest, log: (line: string) => void): Promise<boolean> {
  run.ckpts.poll();
  const { stop, regroup } = stopRequest.agreed(run.world);
  const due = run.ckpts.due(done);
  if (due || stop) await run.saveCheckpoint(done);
  if (stop) {
    log(`[stop] stopped after step ${done} of ${steps}; continue with --resume`);
    return true;
  }
  // [Note: elastic grow] A host joins: at the next checkpoint before the last step, stop so that
  // the launchers meet again with it; the larger world resumes from this checkpoint.
  if (regroup && due && done < steps) {
    await run.ckpts.finish();
    tellLauncher({ event: 'regroup', step: done });
    log(`[elastic] saved step ${done} for a host that joins; stopping to meet again`);
    return true;
  }
  return false;
}

/**
 * One optimizer step: forward and backward of every micro-batch, gradients finished as the layout
 * says, clipped, and the optimizer's step, unless the global batch trains nothing or the norm is not
 * finite (both the same on every rank, so every rank skips alike). The loss and its count are the layout's.
 */
function trainStep(run: RunParts, cfg: FlotillaConfig): StepResult & { norm: number } {
  const { model, optimizer, loader } = run;
  const M = run.microBatches, o = cfg.optim; // M: the config's, or more on fewer ranks than the start ([Note: elastic micro-batches])
  return tidy(() => {
    optimizer.zeroGrad();
    // One autocast scope per step: bf16 parameter copies are made once and dropped before the
    // optimizer changes the float32 masters (src/nn/precision.ts). MoE auxiliary losses are scaled
    // 1 / micro-batches ([Note: moe auxiliary loss] in src/nn/moe.ts); the loss is the sum over the
    // global batch's trained tokens over their count ([Note: global loss reduction]).
    const r = autocast(cfg.train.precision, () => withActivationCheckpoint(cfg.train.activationCheckpoint, () => withKernels(cfg.train.kernels, () =>
      withMoELossScale(1 / M, () => {
        const mbs = Array.from({ length: M }, () => loader.next());
        return model.step(run.dpo ? run.dpo.logps(mbs) : mbs); // DPO: the reference's log-probabilities first
      }))));
    // No trained token in the whole global batch: no gradient was made, and the step is not applied.
    if (r.count === 0) return { ...r, norm: 0 };
    // [train] kernels picks the update's too (and whether clipping's factor folds into it)
    const norm = withKernels(cfg.train.kernels, () => clippedStep(model.grads, optimizer, o.gradClip));
    return { ...r, norm };
  });
}

export async function train(cfg: FlotillaConfig, opts: TrainOptions = {}): Promise<TrainSummary> {
  const print = opts.print ?? ((l: string) => process.stdout.write(`${l}\n`));
  const env = readLaunchEnv();
  const isRank0 = env.rank === 0;
  const mode = isRank0 ? resolveProgressMode(cfg.log.progress) : 'off';
  let progress: Progress | undefined;
  const out = {
    header: (phase: string, text: string) => { if (mode !== 'off') print(`[${phase}] ${text}`); },
    log: (line: string) => { if (isRank0) (progress ? progress.log(line) : print(line)); },
  };
  const run = await openRun(cfg, env, opts, out);
  const { model, optimizer, startStep } = run;
  const steps = run.steps; // train.steps, or what train.epochs makes of the examples
  const o = cfg.optim;
  // ---- the run directory (rank 0): the resolved config first, then metrics as they come
  let record: RunRecord | undefined;
  const stepsSeen: { step: number; loss: number; gradNorm: number }[] = [];
  let firstLoss = NaN, lastLoss = NaN, lastVal: number | undefined, loopSeconds = 0, endStep = startStep;
  let memory: MemoryReport | undefined;
  let stopRequest: StopRequest | undefined;
  try {
    record = openRunRecord(cfg, run.world, env, { resume: run.resumedFrom !== undefined, startStep, worldSize: env.worldSize, ...(opts.configPath ? { configPath: opts.configPath } : {}), ...(opts.overrides ? { overrides: opts.overrides } : {}) });
    if (isRank0) await opts.onRunDir?.(record!.dir);
    out.header('train', `${steps} steps, eval every ${cfg.train.evalEvery || steps} on ${cfg.train.evalBatches} val batch(es); run dir ${record?.dir ?? '(rank 0)'}`);
    if (run.dpo) out.header('dpo', run.dpo.prepare(record?.dir)); // dpo.precompute: before step 0, every rank
    const mfu = openMfu(cfg, run.world, out);
    progress = new Progress(steps, mode, cfg.log.every, print);
    stopRequest = new StopRequest(out.log);
    run.ckpts.prepare();
    for (const part of model.parts) part.train();
    const moe = run.moe;
    const loopStart = performance.now();
    // What building the run freed (the model's first weights, copied into flat buckets; a checkpoint's
    // staging) goes back now, not after the first step: the cache's trim returns only blocks that stayed
    // unused for a whole step, so they used to sit beside the first step's own memory, and that step
    // set the run's peak (a 25M GPT on 4 ranks: 98 MiB of them). From here, freed memory the steps do
    // not reuse goes back after each step (releaseIdleMemory below).
    releaseFreedMemory();
    for (let step = startStep; step < steps; step++) {
      manualSeed(stepSeed(cfg.train.seed, step)); // dropout draws: a function of the step, so a resume draws the same
      const lr = run.schedule(step);
      optimizer.lr = lr;
      const t0 = performance.now();
      const { loss, norm, count, metrics } = trainStep(run, cfg);
      if (count === 0) out.log(`[step ${step + 1}] the global batch holds no trained token: optimizer step skipped`);
      // Expert counts over every rank; balance = "bias" moves the selection biases after the step.
      const moeRow = moe?.finishStep(run.world, count > 0 && Number.isFinite(norm));
      releaseIdleMemory(); // freed tensor memory this step did not reuse (construction's, an evaluation's) goes back
      const dt = (performance.now() - t0) / 1000;
      loopSeconds += dt;
      memory = model.memory(optimizer.stateBytes());
      if (step === startStep) firstLoss = loss;
      // After the second step: the first also learns gradient readiness, so its peak is not the steady state.
      if (step === Math.min(1, steps - 1) && isRank0 && mode !== 'off') progress.log(memoryLine(memory, run.numParams, processMemory(), tensorCacheStats()));
      lastLoss = loss;
      stepsSeen.push({ step: step + 1, loss, gradNorm: norm });
      const evalNow = step === steps - 1 || (cfg.train.evalEvery > 0 && (step + 1) % cfg.train.evalEvery === 0);
      const valLoss = evalNow ? run.evaluate() : undefined;
      if (valLoss !== undefined) lastVal = valLoss;
      const rss = processMemory()?.rssBytes, tokensPerSec = run.tokensPerStep / dt;
      const row: StepMetrics = {
        step: step + 1, loss, lr, tokensPerSec, ...(rss !== undefined ? { rssMiB: rss / 2 ** 20 } : {}),
        ...mfu(tokensPerSec), ...(run.dpo ? {} : { trainedTokens: count }), gradNorm: norm, ...(valLoss !== undefined ? { valLoss } : {}),
        elapsedS: (performance.now() - loopStart) / 1000, ...(run.dpo ? dpoMetrics(count, metrics) : metrics ? { criterion: metrics } : {}), ...moeRow,
      };
      record?.step(row);
      progress.update(row);
      opts.onStep?.({ ...row, liveTensors: liveTensors() });
      if (!Number.isFinite(loss)) throw new Error(`step ${step + 1}: the training loss is ${loss}; lower optim.lr or set optim.gradClip (now ${o.gradClip})`);
      // Let timers, signal handlers and the checkpoint writer run between steps (the step itself is synchronous).
      await new Promise<void>((resolve) => setImmediate(resolve));
      endStep = step + 1;
      if (await endOfStep(run, step + 1, steps, stopRequest, (l) => progress!.log(l))) break;
    }
    await run.ckpts.finish();
    // [Note: slurm stop] Stopped for SIGUSR1 with [slurm] requeue: the checkpoint is published; rank 0 requeues the job.
    if (stopRequest.stoppedBy === 'SIGUSR1' && cfg.slurm.requeue && isRank0) {
      const { requeueJob } = await import('../launch/slurm.js');
      progress.log(requeueJob());
    }
    if (opts.recordDir) writeRankRecord(opts.recordDir, env.rank, stepsSeen, run);
  } finally {
    progress?.stop();
    stopRequest?.dispose();
    record?.close();
    run.close();
    releaseFreedMemory(); // the report and the caller's next phase start from a trimmed heap
  }
  const tokensPerSec = ((endStep - startStep) * run.tokensPerStep) / loopSeconds;
  out.header('done', `loss ${firstLoss.toFixed(4)} -> ${lastLoss.toFixed(4)}` + (lastVal !== undefined ? `, val loss ${lastVal.toFixed(4)}` : '') +
    `, ${Math.round(tokensPerSec).toLocaleString('en-US')} tokens/s; metrics in ${record?.metricsPath ?? '(off)'}`);
  return {
    runDir: record?.dir ?? '', steps, worldSize: env.worldSize, numParams: run.numParams, firstLoss, finalLoss: lastLoss, ...(lastVal !== undefined ? { finalValLoss: lastVal } : {}),
    tokensPerSec, ...(memory ? { memory } : {}), startStep, endStep, saveBlockedMs: run.ckpts.saves.map((r) => r.blockedMs), ...(run.ckpts.lastSaved ? { checkpoint: run.ckpts.lastSaved } : {}),
  };
}
