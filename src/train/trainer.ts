// The trainer, built in phases, each announced by a one-line header on rank 0:
//   world -> mesh -> data -> model -> parallelize -> optimizer -> train loop -> done.
// Parallelism is applied from outside the model, in one place (src/parallel/parallelize.ts), so a
// layout is a choice of config: plain data parallel, ZeRO-1/2/3, HSDP, or a pipeline. The optimizer
// is built after parallelisms because they re-point parameters into flat buffers ([Note: flat
// buffers] in src/parallel/grad_buffer.ts) and hand it the ranges this rank updates.
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { describeBlas, liveTensors, manualSeed, noGrad, setNumThreads, tensor, tidy, torchVersion, type Tensor } from '../tensor/index.js';
import { GPT, gptNumParams } from '../models/gpt.js';
import { gptPipeline, gptUnits } from '../models/gpt_parallel.js';
import { AdamW, warmupCosine, constant } from '../optim/index.js';
import { initProcessGroup, destroyProcessGroup, describeBackend, getWorld, isInitialized, type ProcessGroup } from '../distributed/process_group.js';
import { readLaunchEnv } from '../distributed/env.js';
import { verifyDataPartition } from '../distributed/partition.js';
import { clipGradNorm, gradNorm, type GradientSource } from '../parallel/grads.js';
import { buildMesh, describeLayout, parallelize, resolveLayout } from '../parallel/parallelize.js';
import type { DataParallel, MemoryReport } from '../parallel/data_parallel.js';
import { PipelineParallel } from '../parallel/pipeline/pipeline_parallel.js';
import { saveSafetensors } from '../checkpoint/safetensors.js';
import { DataLoader, loadTextDataset } from '../data/index.js';
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
}

/** The mean of a per-rank scalar over the group (no collective for one rank). */
function meanOverRanks(group: ProcessGroup, v: number): number {
  if (group.size === 1) return v;
  const t = tensor(new Float64Array([v]));
  try {
    group.allReduce(t, 'avg').wait();
    return t.item();
  } finally {
    t.dispose();
  }
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
    if (layout.pp > 1) layout.accumulate = 'reduceLast'; // a pipeline reduces once per step
    const mesh = buildMesh(layout, world);
    header('mesh', `${describeLayout(layout)}; mesh pp ${layout.pp} x dpReplicate ${layout.dpReplicate} x dpShard ${layout.dpShard}`);

    // ---- data
    const ds = loadTextDataset({ source: cfg.data.source, valFraction: cfg.data.valFraction, seqLen: cfg.data.seqLen });
    const geometry = { seqLen: cfg.data.seqLen, globalBatch: cfg.data.globalBatch, dpRank: mesh.dpRank, dpSize: layout.dp, microBatches: cfg.data.microBatches };
    const loader = new DataLoader({ tokens: ds.train, seed: cfg.train.seed, ...geometry });
    // Validation reads fixed batches (steps 0..evalBatches-1 of its own stream) so evaluations compare.
    const evalLoader = new DataLoader({ tokens: ds.val, seed: (cfg.train.seed + 1) >>> 0, ...geometry });
    // Lingua's lesson: check that the data-parallel ranks' samples partition the global batch.
    verifyDataPartition(mesh.dp, loader.localSampleIds(0), cfg.data.globalBatch);
    const tokensPerStep = cfg.data.globalBatch * cfg.data.seqLen;
    header(
      'data',
      `${ds.source}: ${ds.tokens.length.toLocaleString('en-US')} byte tokens (train ${ds.train.length.toLocaleString('en-US')}, ` +
        `val ${ds.val.length.toLocaleString('en-US')}); global batch ${cfg.data.globalBatch} x ${cfg.data.seqLen} = ` +
        `${tokensPerStep.toLocaleString('en-US')} tokens/step = ${layout.dp} data-parallel rank(s) x ${cfg.data.microBatches} micro-batch(es) x ${loader.microBatchSize} samples`,
    );

    // ---- model and parallelize. Weights are drawn per parameter from the seed and its name, so
    // every layout (a pipeline stage included) starts from the same whole-model weights.
    const m = cfg.model;
    let model: GPT | undefined;
    let dp: DataParallel<GPT> | undefined;
    let pipe: PipelineParallel | undefined;
    let named: [string, Tensor][];
    let grads: GradientSource;
    let numParams: number;
    if (layout.pp > 1) {
      pipe = new PipelineParallel(gptPipeline({ ...m }, { initSeed: cfg.train.seed }), {
        pp: mesh.pp, ...(layout.dp > 1 ? { dp: mesh.dp } : {}),
        schedule: cfg.parallel.ppSchedule, virtualStages: cfg.parallel.ppVirtualStages, micro: cfg.data.microBatches,
        ...(layout.zero >= 1 ? { zero: layout.zero, shardGroup: mesh.shard, replicateGroup: mesh.replicate, bucketSizeMb: cfg.parallel.bucketSizeMb, reshardAfterForward: cfg.parallel.reshardAfterForward, units: gptUnits } : {}),
      });
      named = pipe.stageNamedParameters();
      grads = pipe.grads;
      numParams = gptNumParams(m);
      header('model', `GPT ${m.nLayer} layers, ${m.nHead} heads, width ${m.nEmbd}, context ${m.blockSize}: ${numParams.toLocaleString('en-US')} parameters; this rank holds ${named.reduce((a, [, p]) => a + p.numel(), 0).toLocaleString('en-US')}`);
      header('parallelize', `pipeline over ${layout.pp} ranks, schedule ${cfg.parallel.ppSchedule}, ${cfg.parallel.ppVirtualStages} stage(s) per rank, ${cfg.data.microBatches} micro-batches` +
        (pipe.dp ? `; ${layout.zero > 0 ? `ZeRO-${layout.zero}` : 'data parallel'} over ${layout.dp} data-parallel ranks` : ''));
    } else {
      model = new GPT({ ...m }, { initSeed: cfg.train.seed });
      numParams = model.numParams();
      header('model', `GPT ${m.nLayer} layers, ${m.nHead} heads, width ${m.nEmbd}, context ${m.blockSize}: ${numParams.toLocaleString('en-US')} parameters`);
      named = model.namedParameters();
      const breakBucket = process.env.FLOTILLA_TEST_BREAK_AVERAGING;
      dp = parallelize(model, mesh, layout, {
        bucketSizeMb: cfg.parallel.bucketSizeMb, overlap: cfg.parallel.overlap, reshardAfterForward: cfg.parallel.reshardAfterForward, units: gptUnits,
        ...(breakBucket !== undefined && breakBucket !== '' ? { breakAveragingOfBucket: Number(breakBucket) } : {}),
      });
      grads = dp;
      header('parallelize', `${dp.buffers.reduce((a, b) => a + b.buckets.length, 0)} bucket(s)${layout.zero === 3 ? ' (one per wrapping unit)' : ` of <= ${cfg.parallel.bucketSizeMb} MiB`}, overlap ${cfg.parallel.overlap ? 'on' : 'off'}`);
    }
    manualSeed(cfg.train.seed); // dropout draws, the same on every layout

    // ---- optimizer + schedule (weight decay on matrices only, as nanoGPT/GPT-2)
    const o = cfg.optim;
    const decay = named.filter(([, p]) => p.ndim >= 2).map(([, p]) => p);
    const noDecay = named.filter(([, p]) => p.ndim < 2).map(([, p]) => p);
    const optimizer = new AdamW(
      [{ params: decay, options: { weightDecay: o.weightDecay } }, { params: noDecay, options: { weightDecay: 0 } }].filter((g) => g.params.length > 0),
      { lr: o.lr, betas: [o.beta1, o.beta2], eps: o.eps, weightDecay: o.weightDecay },
      dp ? { grads: dp } : pipe?.dp ? { grads: pipe.grads } : {},
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

    // ---- the run directory (rank 0): the resolved config first, then metrics as they come
    const runDir = runDirOf(cfg);
    let metrics: MetricsWriter | undefined;
    if (isRank0) {
      prepareRunDir(cfg); // refuses an earlier run's directory (ConfigError naming --train.name), then creates it
      const from = [opts.configPath ? `from ${opts.configPath}` : 'from defaults', ...(opts.overrides ?? [])].join(' ');
      writeFileSync(join(runDir, 'config.toml'), configToToml(cfg, { header: `Resolved config of run "${cfg.train.name}" (${from}), world size ${env.worldSize}.` }));
      if (cfg.log.metrics !== '') metrics = new MetricsWriter(join(runDir, cfg.log.metrics));
      report = watchRun(runDir, (l) => header('report', l));
    }
    const record: { step: number; loss: number; gradNorm: number }[] = [];

    // ---- train loop
    const M = cfg.data.microBatches;
    const evaluate = (): number => {
      if (pipe) {
        // Forward only through the stages; each call returns the global batch's mean on every rank.
        let sum = 0;
        for (let k = 0; k < cfg.train.evalBatches; k++) {
          sum += tidy(() => pipe!.evaluate(Array.from({ length: M }, (_, mb) => evalLoader.batch(k, mb))));
        }
        return sum / cfg.train.evalBatches;
      }
      if (!dp || !model) throw new Error('internal: no model to evaluate');
      model.eval();
      let sum = 0;
      noGrad(() => {
        for (let k = 0; k < cfg.train.evalBatches; k++) {
          for (let mb = 0; mb < M; mb++) {
            sum += tidy(() => {
              const { x, y } = evalLoader.batch(k, mb);
              return dp!.forward(x, y).loss!.item();
            });
          }
        }
      });
      model.train();
      // Equal-sized micro-batches everywhere, so the mean of means is the global mean.
      return meanOverRanks(mesh.dp, sum / (cfg.train.evalBatches * M));
    };

    header('train', `${steps} steps, eval every ${cfg.train.evalEvery || steps} on ${cfg.train.evalBatches} val batch(es); run dir ${runDir}`);
    const progress = new Progress(steps, mode, cfg.log.every, print);
    model?.train();
    let firstLoss = NaN;
    let lastLoss = NaN;
    let lastVal: number | undefined;
    let loopSeconds = 0;
    let memory: MemoryReport | undefined;
    const loopStart = performance.now();
    try {
      for (let step = 0; step < steps; step++) {
        const lr = schedule(step);
        optimizer.lr = lr;
        const t0 = performance.now();
        const { loss, norm } = tidy(() => {
          optimizer.zeroGrad();
          let loss: number;
          if (pipe) {
            const batches = Array.from({ length: M }, () => loader.next());
            loss = pipe.step(batches).loss;
          } else {
            let lossSum = 0;
            for (let mb = 0; mb < M; mb++) {
              // Each micro-batch in its own scope: its activations go before the next one starts.
              const microStep = (): number => tidy(() => {
                const { x, y } = loader.next();
                const l = dp!.forward(x, y).loss as Tensor;
                l.div(M).backward(); // the mean over micro-batches, as one big batch would give
                return l.item();
              });
              // Non-final micro-batches run inside noSync; what is reduced when is the layout's
              // accumulation flavour ([Note: accumulation] in src/parallel/data_parallel.ts).
              lossSum += mb < M - 1 ? dp!.noSync(microStep) : microStep();
            }
            dp!.finishGradSync();
            loss = meanOverRanks(mesh.dp, lossSum / M);
          }
          const norm = o.gradClip > 0 ? clipGradNorm(grads, o.gradClip).norm : gradNorm(grads);
          // A non-finite norm is the same on every rank (grads.ts), so every rank skips alike.
          if (Number.isFinite(norm)) optimizer.step();
          return { loss, norm };
        });
        const dt = (performance.now() - t0) / 1000;
        loopSeconds += dt;
        memory = (dp ?? pipe)?.memory(optimizer.stateBytes());
        if (step === 0) firstLoss = loss;
        // Memory after the second step: the first one also learns gradient readiness (everything
        // is reduced after backward), so its peak is not the steady state.
        if (step === Math.min(1, steps - 1) && memory && isRank0 && mode !== 'off') {
          const per = (b: number) => `${(b / MiB).toFixed(2)} MiB (${(b / numParams).toFixed(2)} B/param)`;
          progress.log(`[memory] rank 0 holds parameters ${per(memory.paramBytes)}, gradients ${per(memory.gradBytes)}, optimizer state ${per(memory.optimizerBytes)}; step peak ${per(memory.peakBytes)}`);
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
        // Let timers and signal handlers run between steps (the step itself is synchronous).
        await new Promise<void>((resolve) => setImmediate(resolve));
      }
      if (opts.recordDir) {
        mkdirSync(opts.recordDir, { recursive: true });
        writeFileSync(join(opts.recordDir, `rank${env.rank}.json`), JSON.stringify({ rank: env.rank, steps: record }));
        const save = () => saveSafetensors(join(opts.recordDir!, `rank${env.rank}.safetensors`), Object.fromEntries(named), { format: 'pt' });
        if (dp) dp.withFullParameters(save);
        else if (pipe) pipe.withFullParameters(save);
        else save();
      }
    } finally {
      progress.stop();
      metrics?.close();
      // Native memory goes back now, not whenever the GC gets to the wrappers.
      dp?.dispose();
      pipe?.dispose();
      optimizer.dispose();
      model?.dispose();
    }
    const tokensPerSec = (steps * tokensPerStep) / loopSeconds;
    header(
      'done',
      `loss ${firstLoss.toFixed(4)} -> ${lastLoss.toFixed(4)}` + (lastVal !== undefined ? `, val loss ${lastVal.toFixed(4)}` : '') +
        `, ${Math.round(tokensPerSec).toLocaleString('en-US')} tokens/s; metrics in ${metrics ? metrics.path : '(off)'}`,
    );
    return {
      runDir, steps, worldSize: env.worldSize, numParams, firstLoss, finalLoss: lastLoss,
      ...(lastVal !== undefined ? { finalValLoss: lastVal } : {}), tokensPerSec,
      ...(memory ? { memory } : {}),
    };
  } finally {
    if (ownsWorld) destroyProcessGroup();
    await report?.finish(); // never throws: a report that cannot be written is one printed line
  }
}
