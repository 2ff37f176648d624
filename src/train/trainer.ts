// The trainer, built in phases, each announced by a one-line header on rank 0:
//   world -> mesh -> data -> model -> parallelize -> optimizer -> train loop -> done.
// Parallelism is applied from outside the model, in one place (src/parallel/parallelize.ts), so a
// layout is a choice of config: plain data parallel, ZeRO-1/2/3, HSDP, or a pipeline. The optimizer
// is built after parallelisms because they re-point parameters into flat buffers ([Note: flat
// buffers] in src/parallel/grad_buffer.ts) and hand it the ranges this rank updates.
import { existsSync, mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { type Tensor, describeBlas, liveTensors, manualSeed, releaseFreedMemory, releaseIdleMemory, setNumThreads, tensorCacheStats, tidy, torchVersion } from '../tensor/index.js';
import { GPT, gptNumParams } from '../models/gpt.js';
import { autocast } from '../nn/precision.js';
import { withActivationCheckpoint } from '../nn/checkpoint.js';
import { TensorParallelModel } from '../parallel/tensor_parallel/model.js';
import { gptCriterion, gptPipeline, gptTensorPlan, gptUnits } from '../models/gpt_parallel.js';
import { AdamW, warmupCosine, constant } from '../optim/index.js';
import { initProcessGroup, destroyProcessGroup, describeBackend, getWorld, isInitialized } from '../distributed/process_group.js';
import { readLaunchEnv } from '../distributed/env.js';
import { verifyDataPartition } from '../distributed/partition.js';
import { clipGradNorm, gradNorm } from '../parallel/grads.js';
import { buildMesh, describeLayout, parallelize, resolveLayout } from '../parallel/parallelize.js';
import type { MemoryReport } from '../parallel/data_parallel.js';
import { processMemory } from '../parallel/memory.js';
import { saveSafetensors } from '../checkpoint/safetensors.js';
import { placementsOf, type ParamPlacement } from '../parallel/placement.js';
import { RunCheckpoints, StopRequest, initFrom, restore, resumeTarget, stepSeed } from './checkpointing.js';
import { DataLoader, loadTrainData } from '../data/index.js';
import { ConfigError, checkRunnable, configToToml, prepareRunDir, runDirOf, type FlotillaConfig } from './config.js';
import { MetricsWriter, type StepMetrics } from './metrics.js';
import { Progress, resolveProgressMode } from './progress.js';
import { watchRun, type RunWatch } from '../report/watch.js';

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

const MiB = 2 ** 20;

/** Trains the model a config describes; every rank of the world calls it. */
export async function train(cfg: FlotillaConfig, opts: TrainOptions = {}): Promise<TrainSummary> {
  const print = opts.print ?? ((l: string) => process.stdout.write(`${l}\n`));
  const env = readLaunchEnv();
  const isRank0 = env.rank === 0;
  const mode = isRank0 ? resolveProgressMode(cfg.log.progress) : 'off';
  const header = (phase: string, text: string): void => {
    if (isRank0 && mode !== 'off') print(`[${phase}] ${text}`);
  };

  // ---- world
  const problems = checkRunnable(cfg, env.worldSize);
  if (problems.length > 0) throw new ConfigError(problems, opts.configPath);
  // A caller that already joined the world keeps it; otherwise the trainer joins and leaves it.
  const ownsWorld = !isInitialized();
  const world = ownsWorld ? initProcessGroup({ backend: cfg.parallel.backend }) : getWorld();
  let report: RunWatch | undefined; // rank 0: RUN/report.html when the run ends, however it ends
  try {
    setNumThreads(cfg.train.threads);
    const how = { torchrun: 'RANK/WORLD_SIZE (flotilla run, torchrun)', mpirun: 'mpirun', srun: 'srun', single: 'a single process' }[env.source];
    header('world', `${describeBackend(world)}, started by ${how}, ${cfg.train.threads} thread(s) per rank, libtorch ${torchVersion()}, ${describeBlas()}`);

    // ---- mesh: pp x dpReplicate x dpShard; the data-parallel rank decides what a rank reads
    const layout = resolveLayout(cfg.parallel, env.worldSize);
    const mesh = buildMesh(layout, world);
    header('mesh', `${describeLayout(layout)}; mesh pp ${layout.pp} x dpReplicate ${layout.dpReplicate} x dpShard ${layout.dpShard} x tp ${layout.tp ?? 1}`);

    // ---- data: the tokenizer and the sources of [data] (src/data/sources.ts); shards are read by
    // byte range, never whole, and a worker thread prepares the next batches (data.prefetch).
    const data = await loadTrainData(cfg.data, { modelVocab: cfg.model.vocabSize, rank: env.rank, worldSize: env.worldSize });
    const geometry = { seqLen: cfg.data.seqLen, globalBatch: cfg.data.globalBatch, dpRank: mesh.dpRank, dpSize: layout.dp, microBatches: cfg.data.microBatches };
    const loader = new DataLoader({ sources: data.train, seed: cfg.train.seed, prefetch: cfg.data.prefetch, ...geometry });
    // Validation reads fixed batches (steps 0..evalBatches-1 of its own stream) so evaluations compare.
    const evalLoader = new DataLoader({ sources: data.val, seed: (cfg.train.seed + 1) >>> 0, ...geometry });
    // Lingua's lesson: check that the data-parallel ranks' samples partition the global batch.
    verifyDataPartition(mesh.dp, loader.localSampleIds(0), cfg.data.globalBatch);
    const tokensPerStep = cfg.data.globalBatch * cfg.data.seqLen;
    header(
      'data',
      `${data.describe}; global batch ${cfg.data.globalBatch} x ${cfg.data.seqLen} = ` +
        `${tokensPerStep.toLocaleString('en-US')} tokens/step = ${layout.dp} data-parallel rank(s) x ${cfg.data.microBatches} micro-batch(es) x ${loader.microBatchSize} samples`,
    );

    // ---- model: weights are drawn per parameter from the seed and its name, so every layout (a
    // pipeline stage included) starts from the same whole-model weights. A pipeline rank builds
    // only its stages (the GPT's split, src/models/gpt_parallel.ts), never the whole model; under
    // ZeRO-3 the model is built without memory and each rank makes only its shards, a unit at a
    // time ([Note: deferred init] in src/nn/module.ts).
    const m = cfg.model;
    const numParams = gptNumParams(m);
    const gpt = layout.pp > 1
      ? gptPipeline({ ...m }, { initSeed: cfg.train.seed })
      : new GPT({ ...m }, { initSeed: cfg.train.seed, deferInit: layout.zero === 3 && layout.tp === 1 });

    // ---- parallelize: pipeline, then sharding or replication (src/parallel/parallelize.ts)
    const model = parallelize(gpt, mesh, {
      layout, micro: cfg.data.microBatches, loss: gptCriterion, units: gptUnits,
      ...(cfg.parallel.bucketSizeMb > 0 ? { bucketSizeMb: cfg.parallel.bucketSizeMb } : {}), reduceDtype: cfg.parallel.reduceDtype, overlap: cfg.parallel.overlap, reshardAfterForward: cfg.parallel.reshardAfterForward,
      ...((layout.tp ?? 1) > 1 ? { tensorParallel: gptTensorPlan(layout) } : {}),
    });
    const named = model.namedParameters();
    header('model', `GPT ${m.nLayer} layers, ${m.nHead} heads, width ${m.nEmbd}, context ${m.blockSize}: ${numParams.toLocaleString('en-US')} parameters; this rank holds ${named.reduce((a, [, p]) => a + p.numel(), 0).toLocaleString('en-US')}`);
    header('parallelize', model.summary());

    // ---- optimizer + schedule (weight decay on matrices only, as nanoGPT/GPT-2)
    const o = cfg.optim;
    const decay = named.filter(([, p]) => p.ndim >= 2).map(([, p]) => p);
    const noDecay = named.filter(([, p]) => p.ndim < 2).map(([, p]) => p);
    const optimizer = new AdamW(
      [{ params: decay, options: { weightDecay: o.weightDecay } }, { params: noDecay, options: { weightDecay: 0 } }].filter((g) => g.params.length > 0),
      { lr: o.lr, betas: [o.beta1, o.beta2], eps: o.eps, weightDecay: o.weightDecay },
      model.optimizerGrads ? { grads: model.optimizerGrads } : {},
    );
    const steps = cfg.train.steps;
    const schedule = o.schedule === 'cosine'
      ? warmupCosine({ warmupSteps: o.warmupSteps, maxSteps: steps, maxLr: o.lr, minLr: o.minLr })
      : constant(o.lr);
    header(
      'optimizer',
      `AdamW betas (${o.beta1}, ${o.beta2}), weight decay ${o.weightDecay} on ${decay.length} matrices; lr ${o.lr} ` +
        (o.schedule === 'cosine' ? `warmup ${o.warmupSteps} steps, cosine to ${o.minLr}` : 'constant') +
        (o.gradClip > 0 ? `; clip grad norm at ${o.gradClip}` : '') +
        (layout.zero >= 1 ? `; state sharded over ${layout.dpShard} rank(s)` : ''),
    );

    // ---- checkpoint: where each parameter lives ([Note: placement]), then resume or initFrom
    const placements = (): ParamPlacement[] =>
      placementsOf(named, { ...(model.dataParallel ? { dp: model.dataParallel } : {}), silent: model.tiedCopiesLeftOutOfNorm });
    const ckpts = new RunCheckpoints(cfg, { world, log: (l) => { if (isRank0) progress?.log(l); } });
    const resumeFrom = resumeTarget(cfg, opts.resume);
    let startStep = 0;
    if (resumeFrom !== undefined) {
      const meta = restore(resumeFrom, { placements: placements(), optimizer }, numParams);
      startStep = meta.step;
      if (startStep >= steps) throw new ConfigError([`the checkpoint ${resumeFrom} is at step ${startStep}, and train.steps is ${steps}: nothing is left to train; raise --train.steps`]);
      loader.loadStateDict(meta.data);
      // Lingua's lesson again, at the resumed position and under this run's data-parallel layout.
      verifyDataPartition(mesh.dp, loader.localSampleIds(startStep), cfg.data.globalBatch);
      header('resume', `resumed from step ${startStep} (${resumeFrom}; saved by ${meta.layout.worldSize} rank(s), ${meta.layout.description})`);
    } else if (cfg.train.initFrom !== '') {
      initFrom(cfg.train.initFrom, placements(), numParams);
      header('init', `weights from ${cfg.train.initFrom}; step 0, fresh optimizer state`);
    }
    const runInfo = (step: number) => ({
      layout: {
        worldSize: env.worldSize, description: describeLayout(layout), pp: layout.pp, dpReplicate: layout.dpReplicate, dpShard: layout.dpShard,
        zero: layout.zero, ppSchedule: cfg.parallel.ppSchedule, ppVirtualStages: cfg.parallel.ppVirtualStages, tp: layout.tp ?? 1,
      },
      config: cfg as unknown as Record<string, Record<string, unknown>>,
      data: loader.stateDict(),
      rng: { kind: 'seed-per-step' as const, seed: cfg.train.seed },
      schedule: { step },
    });
    const saveCheckpoint = async (step: number): Promise<void> => {
      model.dataParallel?.waitParams(); // ZeRO-1/2: the last step's parameter gathers land first
      await ckpts.save(step, { placements: placements(), optimizer, optimizerName: 'AdamW' }, runInfo(step));
    };

    // ---- the run directory (rank 0): the resolved config first, then metrics as they come
    const runDir = runDirOf(cfg);
    let metrics: MetricsWriter | undefined;
    if (isRank0) {
      // Refuses an earlier run's directory (ConfigError naming --train.name) unless resuming it.
      prepareRunDir(cfg, { resume: resumeFrom !== undefined && existsSync(runDir) });
      const from = [opts.configPath ? `from ${opts.configPath}` : 'from defaults', ...(opts.overrides ?? [])].join(' ');
      // A resumed run keeps the first config.toml and records its own next to it.
      const configFile = startStep > 0 ? `config.resumed-${startStep}.toml` : 'config.toml';
      writeFileSync(join(runDir, configFile), configToToml(cfg, { header: `Resolved config of run "${cfg.train.name}" (${from}), world size ${env.worldSize}${startStep > 0 ? `, resumed at step ${startStep}` : ''}.` }));
      if (cfg.log.metrics !== '') metrics = new MetricsWriter(join(runDir, cfg.log.metrics), startStep > 0 ? { continueAfter: startStep } : {});
      report = watchRun(runDir, (l) => header('report', l));
    }
    const record: { step: number; loss: number; gradNorm: number }[] = [];

    // ---- train loop
    const M = cfg.data.microBatches;
    const evaluate = (): number => {
      // Forward only; each call returns the global batch's mean on every rank.
      let sum = 0;
      for (let k = 0; k < cfg.train.evalBatches; k++) {
        sum += tidy(() => autocast(cfg.train.precision, () => model.evaluate(Array.from({ length: M }, (_, mb) => evalLoader.batch(k, mb)))));
      }
      return sum / cfg.train.evalBatches;
    };

    header('train', `${steps} steps, eval every ${cfg.train.evalEvery || steps} on ${cfg.train.evalBatches} val batch(es); run dir ${runDir}`);
    const progress = new Progress(steps, mode, cfg.log.every, print);
    const stopRequest = new StopRequest((l) => { if (isRank0) progress.log(l); });
    ckpts.prepare();
    let endStep = startStep;
    for (const part of model.parts) part.train();
    let firstLoss = NaN;
    let lastLoss = NaN;
    let lastVal: number | undefined;
    let loopSeconds = 0;
    let memory: MemoryReport | undefined;
    const loopStart = performance.now();
    releaseIdleMemory(); // from here, freed memory the steps do not reuse goes back after each step
    try {
      for (let step = startStep; step < steps; step++) {
        manualSeed(stepSeed(cfg.train.seed, step)); // dropout draws: a function of the step, so a resume draws the same
        const lr = schedule(step);
        optimizer.lr = lr;
        const t0 = performance.now();
        const { loss, norm } = tidy(() => {
          optimizer.zeroGrad();
          // Forward and backward of every micro-batch, gradients finished as the layout says.
          // One autocast scope per step: bf16 parameter copies are made once and dropped before
          // the optimizer changes the float32 masters (src/nn/precision.ts).
          const { loss } = autocast(cfg.train.precision, () => withActivationCheckpoint(cfg.train.activationCheckpoint, () => model.step(Array.from({ length: M }, () => loader.next()))));
          const norm = o.gradClip > 0 ? clipGradNorm(model.grads, o.gradClip).norm : gradNorm(model.grads);
          // A non-finite norm is the same on every rank (grads.ts), so every rank skips alike.
          if (Number.isFinite(norm)) optimizer.step();
          return { loss, norm };
        });
        // Freed tensor memory this step did not reuse (construction's, an evaluation's) goes back.
        releaseIdleMemory();
        const dt = (performance.now() - t0) / 1000;
        loopSeconds += dt;
        memory = model.memory(optimizer.stateBytes());
        if (step === startStep) firstLoss = loss;
        // Memory after the second step: the first one also learns gradient readiness (everything
        // is reduced after backward), so its peak is not the steady state.
        if (step === Math.min(1, steps - 1) && memory && isRank0 && mode !== 'off') {
          const per = (b: number) => `${(b / MiB).toFixed(2)} MiB (${(b / numParams).toFixed(2)} B/param)`;
          // The buffers are what a layout changes; the process also holds activations, staging, the
          // allocator's cache and the runtime, so its own resident size is printed beside them.
          const proc = processMemory();
          const cache = tensorCacheStats();
          const kept = cache.on ? `; ${(cache.cachedBytes / MiB).toFixed(0)} MiB of it is freed tensor memory the cache keeps` : '';
          const whole = proc
            ? `; the process: resident ${(proc.rssBytes / MiB).toFixed(0)} MiB, peak ${(proc.peakBytes / MiB).toFixed(0)} MiB (also activations, collective staging, freed memory kept for the next step, and the runtime${kept})`
            : ' (activations, collective staging and the runtime not counted)';
          progress.log(`[memory] rank 0 holds parameters ${per(memory.paramBytes)}, gradients ${per(memory.gradBytes)}, optimizer state ${per(memory.optimizerBytes)}; step peak ${per(memory.peakBytes)} of these buffers${whole}`);
        }
        lastLoss = loss;
        record.push({ step: step + 1, loss, gradNorm: norm });
        const isLast = step === steps - 1;
        const evalNow = isLast || (cfg.train.evalEvery > 0 && (step + 1) % cfg.train.evalEvery === 0);
        const valLoss = evalNow ? evaluate() : undefined;
        if (valLoss !== undefined) lastVal = valLoss;
        const row: StepMetrics = {
          step: step + 1, loss, lr, tokensPerSec: tokensPerStep / dt, gradNorm: norm,
          ...(valLoss !== undefined ? { valLoss } : {}),
          elapsedS: (performance.now() - loopStart) / 1000,
        };
        metrics?.write(row);
        progress.update(row);
        opts.onStep?.({ ...row, liveTensors: liveTensors() });
        if (!Number.isFinite(loss)) {
          throw new Error(`step ${step + 1}: the training loss is ${loss}; lower optim.lr or set optim.gradClip (now ${o.gradClip})`);
        }
        // Let timers, signal handlers and the checkpoint writer run between steps (the step itself is synchronous).
        await new Promise<void>((resolve) => setImmediate(resolve));
        endStep = step + 1;
        ckpts.poll();
        const stop = stopRequest.agreed(world);
        if (ckpts.due(step + 1) || stop) await saveCheckpoint(step + 1);
        if (stop) {
          progress.log(`[stop] stopped after step ${step + 1} of ${steps}; continue with --resume`);
          break;
        }
      }
      await ckpts.finish();
      if (opts.recordDir) {
        mkdirSync(opts.recordDir, { recursive: true });
        writeFileSync(join(opts.recordDir, `rank${env.rank}.json`), JSON.stringify({ rank: env.rank, steps: record }));
        // Whole parameters: tensor-parallel slices are gathered (every tp rank records the same tensors).
        const whole = (p: Tensor) => (model instanceof TensorParallelModel ? model.whole(p) : p);
        const save = () => tidy(() => saveSafetensors(join(opts.recordDir!, `rank${env.rank}.safetensors`), Object.fromEntries(named.map(([n, p]) => [n, whole(p)])), { format: 'pt' }));
        model.withFullParameters(save);
      }
    } finally {
      progress.stop();
      stopRequest.dispose();
      metrics?.close();
      loader.close(); // the prefetch worker
      evalLoader.close();
      data.close();
      // Native memory goes back now, not whenever the GC gets to the wrappers.
      model.dispose();
      optimizer.dispose();
      releaseFreedMemory(); // the report and the caller's next phase start from a trimmed heap
    }
    const tokensPerSec = ((endStep - startStep) * tokensPerStep) / loopSeconds;
    header(
      'done',
      `loss ${firstLoss.toFixed(4)} -> ${lastLoss.toFixed(4)}` + (lastVal !== undefined ? `, val loss ${lastVal.toFixed(4)}` : '') +
        `, ${Math.round(tokensPerSec).toLocaleString('en-US')} tokens/s; metrics in ${metrics ? metrics.path : '(off)'}`,
    );
    return {
      runDir, steps, worldSize: env.worldSize, numParams, firstLoss, finalLoss: lastLoss,
      ...(lastVal !== undefined ? { finalValLoss: lastVal } : {}), tokensPerSec,
      ...(memory ? { memory } : {}),
      startStep, endStep, saveBlockedMs: ckpts.saves.map((r) => r.blockedMs),
      ...(ckpts.lastSaved ? { checkpoint: ckpts.lastSaved } : {}),
    };
  } finally {
    if (ownsWorld) destroyProcessGroup();
    await report?.finish(); // never throws: a report that cannot be written is one printed line
  }
}
