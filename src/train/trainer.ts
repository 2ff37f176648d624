// The trainer, built in phases, each announced by a one-line header on rank 0:
//   world -> data -> model -> parallelize -> optimizer -> train loop -> done.
// Parallelism is applied from outside the model (the model knows nothing about ranks), and the
// optimizer is built after parallelisms because DataParallel re-points parameters into its flat
// buffers (see [Note: flat buffers] in src/parallel/grad_buffer.ts).
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { liveTensors, manualSeed, noGrad, setNumThreads, tensor, tidy, torchVersion, type Tensor } from '../tensor/index.js';
import { GPT } from '../models/gpt.js';
import { AdamW, warmupCosine, constant } from '../optim/index.js';
import { initProcessGroup, destroyProcessGroup, getWorld, isInitialized, type ProcessGroup } from '../distributed/process_group.js';
import { readLaunchEnv } from '../distributed/env.js';
import { verifyDataPartition } from '../distributed/partition.js';
import { DataParallel, LocalGrads, clipGradNorm, gradNorm } from '../parallel/index.js';
import { DataLoader, loadTextDataset } from '../data/index.js';
import { ConfigError, checkRunnable, configToToml, runDirOf, type FlotillaConfig } from './config.js';
import { MetricsWriter, type StepMetrics } from './metrics.js';
import { Progress, resolveProgressMode } from './progress.js';

export interface TrainOptions {
  /** Where the config came from, recorded in the saved config. */
  configPath?: string;
  /** Command-line overrides, recorded in the saved config. */
  overrides?: readonly string[];
  /** Rank 0's console sink (default: stdout). */
  print?: (line: string) => void;
  /** Called on every rank after each step (tests watch losses and live tensors through it). */
  onStep?: (m: StepMetrics & { liveTensors: number }) => void;
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
  const dp = env.worldSize; // data parallelism is the only layout so far (checkRunnable)
  // A caller that already joined the world keeps it; otherwise the trainer joins and leaves it.
  const ownsWorld = !isInitialized();
  const group = ownsWorld ? initProcessGroup() : getWorld();
  try {
    setNumThreads(cfg.train.threads);
    const how = { torchrun: 'RANK/WORLD_SIZE (flotilla run, torchrun)', mpirun: 'mpirun', srun: 'srun', single: 'a single process' }[env.source];
    header('world', `${env.worldSize} rank(s) from ${how}, data parallel ${dp}, ${cfg.train.threads} thread(s) per rank, libtorch ${torchVersion()}`);

    // ---- data
    const ds = loadTextDataset({ source: cfg.data.source, valFraction: cfg.data.valFraction, seqLen: cfg.data.seqLen });
    const geometry = { seqLen: cfg.data.seqLen, globalBatch: cfg.data.globalBatch, dpRank: group.rank, dpSize: dp, microBatches: cfg.data.microBatches };
    const loader = new DataLoader({ tokens: ds.train, seed: cfg.train.seed, ...geometry });
    // Validation reads fixed batches (steps 0..evalBatches-1 of its own stream) so evaluations compare.
    const evalLoader = new DataLoader({ tokens: ds.val, seed: (cfg.train.seed + 1) >>> 0, ...geometry });
    // Lingua's lesson: check that the ranks' samples partition the global batch, do not trust it.
    verifyDataPartition(group, loader.localSampleIds(0), cfg.data.globalBatch);
    const tokensPerStep = cfg.data.globalBatch * cfg.data.seqLen;
    header(
      'data',
      `${ds.source}: ${ds.tokens.length.toLocaleString('en-US')} byte tokens (train ${ds.train.length.toLocaleString('en-US')}, ` +
        `val ${ds.val.length.toLocaleString('en-US')}); global batch ${cfg.data.globalBatch} x ${cfg.data.seqLen} = ` +
        `${tokensPerStep.toLocaleString('en-US')} tokens/step = ${dp} rank(s) x ${cfg.data.microBatches} micro-batch(es) x ${loader.microBatchSize} samples`,
    );

    // ---- model (same seed on every rank; DataParallel also broadcasts rank 0's weights)
    manualSeed(cfg.train.seed);
    const model = new GPT({ ...cfg.model });
    const numParams = model.numParams();
    const m = cfg.model;
    header('model', `GPT ${m.nLayer} layers, ${m.nHead} heads, width ${m.nEmbd}, context ${m.blockSize}: ${model.numParams().toLocaleString('en-US')} parameters`);

    // ---- parallelize
    let ddp: DataParallel | undefined;
    if (env.worldSize > 1) {
      ddp = new DataParallel(model, { group, bucketSizeMb: cfg.parallel.bucketSizeMb, overlap: cfg.parallel.overlap });
      header('parallelize', `DataParallel over ${group.size} ranks: ${ddp.buffers.reduce((a, b) => a + b.buckets.length, 0)} bucket(s) of <= ${cfg.parallel.bucketSizeMb} MiB, overlap ${cfg.parallel.overlap ? 'on' : 'off'}`);
    } else {
      header('parallelize', 'single process (no data parallelism)');
    }
    const grads = ddp ?? new LocalGrads(model);

    // ---- optimizer + schedule (weight decay on matrices only, as nanoGPT/GPT-2)
    const o = cfg.optim;
    const named = model.namedParameters();
    const decay = named.filter(([, p]) => p.ndim >= 2).map(([, p]) => p);
    const noDecay = named.filter(([, p]) => p.ndim < 2).map(([, p]) => p);
    const optimizer = new AdamW(
      [{ params: decay, options: { weightDecay: o.weightDecay } }, { params: noDecay, options: { weightDecay: 0 } }].filter((g) => g.params.length > 0),
      { lr: o.lr, betas: [o.beta1, o.beta2], eps: o.eps, weightDecay: o.weightDecay },
    );
    const steps = cfg.train.steps;
    const schedule = o.schedule === 'cosine'
      ? warmupCosine({ warmupSteps: o.warmupSteps, maxSteps: steps, maxLr: o.lr, minLr: o.minLr })
      : constant(o.lr);
    header(
      'optimizer',
      `AdamW betas (${o.beta1}, ${o.beta2}), weight decay ${o.weightDecay} on ${decay.length} matrices; lr ${o.lr} ` +
        (o.schedule === 'cosine' ? `warmup ${o.warmupSteps} steps, cosine to ${o.minLr}` : 'constant') +
        (o.gradClip > 0 ? `; clip grad norm at ${o.gradClip}` : ''),
    );

    // ---- the run directory (rank 0): the resolved config first, then metrics as they come
    const runDir = runDirOf(cfg);
    let metrics: MetricsWriter | undefined;
    if (isRank0) {
      mkdirSync(runDir, { recursive: true });
      const from = [opts.configPath ? `from ${opts.configPath}` : 'from defaults', ...(opts.overrides ?? [])].join(' ');
      writeFileSync(join(runDir, 'config.toml'), configToToml(cfg, { header: `Resolved config of run "${cfg.train.name}" (${from}), world size ${env.worldSize}.` }));
      if (cfg.log.metrics !== '') metrics = new MetricsWriter(join(runDir, cfg.log.metrics));
    }

    // ---- train loop
    const M = cfg.data.microBatches;
    const evaluate = (): number => {
      model.eval();
      let sum = 0;
      noGrad(() => {
        for (let k = 0; k < cfg.train.evalBatches; k++) {
          for (let mb = 0; mb < M; mb++) {
            sum += tidy(() => {
              const { x, y } = evalLoader.batch(k, mb);
              return model.forward(x, y).loss!.item();
            });
          }
        }
      });
      model.train();
      // Equal-sized micro-batches everywhere, so the mean of means is the global mean.
      return meanOverRanks(group, sum / (cfg.train.evalBatches * M));
    };

    header('train', `${steps} steps, eval every ${cfg.train.evalEvery || steps} on ${cfg.train.evalBatches} val batch(es); run dir ${runDir}`);
    const progress = new Progress(steps, mode, cfg.log.every, print);
    model.train();
    let firstLoss = NaN;
    let lastLoss = NaN;
    let lastVal: number | undefined;
    let loopSeconds = 0;
    const loopStart = performance.now();
    try {
      for (let step = 0; step < steps; step++) {
        const lr = schedule(step);
        optimizer.lr = lr;
        const t0 = performance.now();
        const { loss, norm } = tidy(() => {
          optimizer.zeroGrad();
          let lossSum = 0;
          for (let mb = 0; mb < M; mb++) {
            // Each micro-batch in its own scope: its activations go before the next one starts.
            const microStep = (): number => tidy(() => {
              const { x, y } = loader.next();
              const l = model.forward(x, y).loss as Tensor;
              l.div(M).backward(); // the mean over micro-batches, as one big batch would give
              return l.item();
            });
            // Gradients are reduced on the last micro-batch only; the earlier ones just accumulate
            // into the flat buffer (see [Note: accumulation] in src/parallel/data_parallel.ts).
            lossSum += ddp && mb < M - 1 ? ddp.noSync(microStep) : microStep();
          }
          ddp?.finishGradSync();
          const norm = o.gradClip > 0 ? clipGradNorm(grads, o.gradClip).norm : gradNorm(grads);
          optimizer.step();
          return { loss: meanOverRanks(group, lossSum / M), norm };
        });
        const dt = (performance.now() - t0) / 1000;
        loopSeconds += dt;
        if (step === 0) firstLoss = loss;
        lastLoss = loss;
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
    } finally {
      progress.stop();
      metrics?.close();
      // Native memory goes back now, not whenever the GC gets to the wrappers.
      ddp?.dispose();
      optimizer.dispose();
      model.dispose();
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
    };
  } finally {
    if (ownsWorld) destroyProcessGroup();
  }
}
