// The trainer's phases before the loop, in torchtitan's order, each announced by a one-line header
// on rank 0: world -> mesh -> data -> model -> parallelize -> optimizer -> checkpoint state. The
// model comes from the registry by `[model] arch` ([Note: model registry]), the optimizer from
// its own by `[optim] name` ([Note: optimizer registry]); parallelism is applied from outside the
// model (src/parallel/parallelize.ts); the optimizer is built after parallelisms because they
// re-point parameters into flat buffers ([Note: flat buffers] in src/parallel/data_parallel/grad_buffer.ts) and
// hand it the ranges this rank updates.
import { bf16Notice } from './bf16_notice.js';
import { mfuOf, modelFlops } from './flops.js';
import { worldPeakTflops } from './peak_flops.js';
import { mkdirSync, writeFileSync } from 'node:fs';
import { elasticMicroBatches } from './elastic.js';
import { launcherEnv } from '../distributed/launcher_env.js';
import { join } from 'node:path';
import { type Tensor, describeBlas, setNumThreads, tidy, torchVersion } from '../tensor/index.js';
import { autocast } from '../nn/precision.js';
import { withKernels } from '../nn/kernels/choice.js';
import { warmupCosine, constant } from '../optim/schedule.js';
import { optimizerSpec } from '../optim/registry.js';
import type { Optimizer } from '../optim/optimizer.js';
import { initProcessGroup, destroyProcessGroup, describeBackend, getWorld, isInitialized, type ProcessGroup } from '../distributed/process_group.js';
import type { LaunchEnv } from '../distributed/env.js';
import { verifyDataPartition } from '../distributed/partition.js';
import { buildMesh, describeLayout, parallelize, resolveLayout, type Layout, type LayoutMesh, type ParallelPlan } from '../parallel/parallelize.js';
import { configuredBucketSizeMb, defersInit, describeMesh } from '../parallel/layout.js';
import type { ParallelModel } from '../parallel/parallel_model.js';
import type { ParamPlacement } from '../parallel/placement.js';
import { saveSafetensors } from '../checkpoint/safetensors.js';
import type { RunInfo } from '../checkpoint/checkpoint.js';
import { DataLoader, ExampleLoader, loadTrainData, type TrainLoader } from '../data/index.js';
import { modelSpec } from '../models/registry.js';
import { ConfigError } from '../config/error.js';
import { checkRunnable } from '../config/validate.js';
import { modelConfigOf, type FlotillaConfig } from '../config/schema.js';
import { RunCheckpoints, initFrom, restore } from './checkpointing.js';
import { MoEBookkeeping } from './moe.js';
import { agreeOnBase, applyRunLora, checkInitFromNotLora, frozenPlacements, loraCounts, loraResumeProblem, shortCount, trainablePlacements } from './lora_run.js';
import { CheckpointError, readMeta } from '../checkpoint/format.js';
import { describeObjective, objectiveConfig, objectiveCriterion, openDpoReference, referenceKind, withObjective } from './objective.js';
import { frozen, type DpoReference } from './reference.js';
import { loadPeftAdapter } from '../checkpoint/peft.js';

/** Rank 0's console: a phase header, and a line that goes around the progress bar. */
export interface RunConsole {
  header(phase: string, text: string): void;
  log(line: string): void;
}

/** Everything the loop needs, built by openRun; close() frees it in reverse order. */
export interface RunParts {
  world: ProcessGroup;
  layout: Layout;
  mesh: LayoutMesh;
  /** Text windows (DataLoader) or example rows (ExampleLoader, data.format other than "text"). */
  loader: TrainLoader;
  /** Steps the run trains: train.steps, or those train.epochs make of the examples. */
  steps: number;
  tokensPerStep: number;
  numParams: number;
  model: ParallelModel;
  named: [string, Tensor][];
  optimizer: Optimizer<{ lr: number }>;
  schedule: (step: number) => number;
  ckpts: RunCheckpoints;
  /** Mixture of experts: tokens per expert, the auxiliary loss and the expert biases over every rank. */
  moe: MoEBookkeeping | undefined;
  /** The step the run starts from (0, or the resumed checkpoint's), and that checkpoint. */
  startStep: number;
  resumedFrom: string | undefined;
  /** Micro-batches per step: data.microBatches, or more for an elastic job on fewer ranks ([Note: elastic micro-batches]). */
  microBatches: number;
  /** DPO's reference (train.objective = "dpo"): prepare() before the loop, logps(mbs) before each step. */
  dpo: DpoReference | undefined;
  /** The validation loss over train.evalBatches fixed batches (every rank gets the same). */
  evaluate(): number;
  saveCheckpoint(step: number): Promise<void>;
  close(): void;
}

/** Builds the run's parts phase by phase; on a failure, what was built is freed before rethrowing. */
export async function openRun(cfg: FlotillaConfig, env: LaunchEnv, opts: { resume?: string; configPath?: string }, out: RunConsole): Promise<RunParts> {
  const header = out.header;
  const closers: (() => void)[] = [];
  const close = (): void => {
    for (const c of closers.splice(0).reverse()) c();
  };
  // An elastic job on fewer ranks than it started with: more micro-batches ([Note: elastic micro-batches]).
  const micro = elasticMicroBatches(cfg, env.worldSize);
  if (micro.microBatches !== cfg.data.microBatches) cfg = { ...cfg, data: { ...cfg.data, microBatches: micro.microBatches } };
  const asked = cfg; // DPO turns dropout off: the header says what the config asked
  cfg = objectiveConfig(cfg);
  try {
    // ---- world: a caller that already joined the world keeps it; otherwise the trainer joins and leaves it
    const problems = checkRunnable(cfg, env.worldSize);
    if (problems.length > 0) throw new ConfigError(problems, opts.configPath);
    const ownsWorld = !isInitialized();
    const world = ownsWorld ? initProcessGroup({ backend: cfg.parallel.backend }) : getWorld();
    if (ownsWorld) closers.push(() => destroyProcessGroup());
    setNumThreads(cfg.train.threads);
    const how = { torchrun: 'RANK/WORLD_SIZE (flotilla run, torchrun)', mpirun: 'mpirun', srun: 'srun', single: 'a single process' }[env.source];
    header('world', `${describeBackend(world)}, started by ${how}, ${cfg.train.threads} thread(s) per rank, libtorch ${torchVersion()}, ${describeBlas()}`);
    // Before the model is built, so the user hears it before waiting (rank 0 alone measures: no collective).
    const bf16 = env.rank === 0 ? bf16Notice(cfg.train.precision) : undefined;
    if (bf16) out.log(`[precision] ${bf16}`);

    // ---- mesh: pp x dpReplicate x dpShard x cp x tp; the data-parallel rank decides what a rank reads
    const layout = resolveLayout(cfg.parallel, env.worldSize);
    const mesh = buildMesh(layout, world);
    header('mesh', `${describeLayout(layout)}; ${describeMesh(layout)}`);

    // ---- data: shards are read by byte range, never whole; a worker thread prepares the next batches
    const data = await loadTrainData(cfg.data, { modelVocab: cfg.model.vocabSize, rank: env.rank, worldSize: env.worldSize });
    closers.push(() => data.close());
    const geometry = { seqLen: cfg.data.seqLen, globalBatch: cfg.data.globalBatch, dpRank: mesh.dpRank, dpSize: layout.dp, microBatches: cfg.data.microBatches };
    // Examples: whole examples in rows, epoch by epoch ([Note: example rows] in src/data/example_loader.ts).
    const ex = data.examples;
    const rows = ex && { pack: cfg.data.pack, overflow: cfg.data.overflow, padId: ex.padId, ...geometry };
    const loader: TrainLoader = rows
      ? new ExampleLoader({ sources: ex.train, seed: cfg.train.seed, prefetch: cfg.data.prefetch, epochs: cfg.train.epochs, datasetKey: ex.datasetKey, ...rows })
      : new DataLoader({ sources: data.train, seed: cfg.train.seed, prefetch: cfg.data.prefetch, ...geometry });
    closers.push(() => loader.close());
    // Validation reads fixed batches (steps 0..evalBatches-1 of its own stream; examples: the held-out
    // units in order) so evaluations compare.
    const evalLoader: TrainLoader = rows
      ? new ExampleLoader({ sources: ex.val, shuffle: false, ...rows })
      : new DataLoader({ sources: data.val, seed: (cfg.train.seed + 1) >>> 0, ...geometry });
    closers.push(() => evalLoader.close());
    // train.epochs sets the steps (validate.ts keeps train.steps at its default then); the schedule,
    // the checkpoints and the loop use them.
    const steps = loader instanceof ExampleLoader && cfg.train.epochs > 0 ? loader.stepsFor(cfg.train.epochs) : cfg.train.steps;
    const runCfg = steps === cfg.train.steps ? cfg : { ...cfg, train: { ...cfg.train, steps } };
    // Lingua's lesson: check that the data-parallel ranks' samples partition the global batch.
    verifyDataPartition(mesh.data, loader.localSampleIds(0), cfg.data.globalBatch);
    const tokensPerStep = cfg.data.globalBatch * cfg.data.seqLen;
    header('data', `${data.describe}; global batch ${cfg.data.globalBatch} x ${cfg.data.seqLen} = ${tokensPerStep.toLocaleString('en-US')} tokens/step = ` +
      `${layout.dp} data-parallel rank(s) x ${cfg.data.microBatches} micro-batch(es) x ${loader.microBatchSize} ${ex ? 'rows' : 'samples'}`);
    if (loader instanceof ExampleLoader) header('data', loader.describe(steps));

    // ---- model: weights are drawn per parameter from the seed and its name, so every layout starts
    // from the same whole-model weights. A pipeline rank builds only its stages; under ZeRO-3 the
    // model is built without memory and each rank makes only its shards (defersInit, src/parallel/layout.ts).
    const spec = modelSpec(cfg.model.arch);
    const modelCfg = modelConfigOf(cfg);
    const numParams = spec.numParams(modelCfg);
    const initSeed = cfg.train.seed;
    const buildPlain = () => (layout.pp > 1 ? spec.pipeline(modelCfg, { initSeed }) : spec.build(modelCfg, { initSeed, deferInit: defersInit(layout) }));
    const plain = buildPlain();
    // A LoRA run: adapters in place, the rest frozen, before any parallelism ([Note: LoRA run] in lora_run.ts).
    const lora = cfg.lora.rank > 0;
    let built: typeof plain;
    try {
      built = lora ? applyRunLora(plain, cfg, spec, modelCfg) : plain;
    } catch (e) {
      if ('dispose' in plain) plain.dispose();
      throw e;
    }
    const loraCount = lora ? loraCounts(cfg, spec, modelCfg, numParams) : undefined;

    // ---- parallelize: pipeline, tensor parallel, then sharding or replication
    // What the layout minimises: the model's token loss, or DPO's pairs (src/train/objective.ts).
    const criterion = objectiveCriterion(cfg, { loss: spec.loss, cp: mesh.cp });
    const plan: ParallelPlan = {
      layout, micro: cfg.data.microBatches, loss: criterion, units: spec.units,
      bucketSizeMb: configuredBucketSizeMb(cfg.parallel.bucketSizeMb, layout.zero), reduceDtype: cfg.parallel.reduceDtype, overlap: cfg.parallel.overlap, reshardAfterForward: cfg.parallel.reshardAfterForward,
      ...((layout.tp ?? 1) > 1 ? { tensorParallel: spec.tensorPlan(layout) } : {}),
    };
    const model = parallelize(withObjective(built, criterion), mesh, plan);
    closers.push(() => model.dispose()); // native memory goes back now, not whenever the GC gets to it
    const named = model.namedParameters();
    const held = named.reduce((a, [, p]) => a + p.numel(), 0);
    const adapted = !lora ? '' : loraCount
      ? `; LoRA rank ${cfg.lora.rank} on ${loraCount.modules} modules: ${shortCount(loraCount.trainable)} trainable, ${shortCount(loraCount.frozen)} frozen`
      : `; LoRA rank ${cfg.lora.rank}: ${shortCount(named.filter(([, p]) => p.requiresGrad).reduce((a, [, p]) => a + p.numel(), 0))} trainable on this rank`;
    header('model', `${spec.describe(modelCfg)}${modelCfg.moe ? `, ${modelCfg.moe.experts} experts (top ${modelCfg.moe.topK}) every ${modelCfg.moe.every} block(s)${modelCfg.moe.denseLayers?.length ? ` but ${modelCfg.moe.denseLayers.join(', ')}` : ''}` : ''}: ${numParams.toLocaleString('en-US')} parameters; this rank holds ${held.toLocaleString('en-US')}${adapted}`);
    header('parallelize', model.summary());

    // ---- optimizer + schedule: `[optim] name` from the registry ([Note: optimizer registry]), over
    // the parameters that train
    const o = cfg.optim;
    const optimSpec = optimizerSpec(o.name);
    const { decay, noDecay } = trainedParameters(named);
    const optimizer = optimSpec.build(
      [{ params: decay, weightDecay: o.weightDecay }, { params: noDecay, weightDecay: 0 }].filter((g) => g.params.length > 0),
      o, model.optimizerGrads ? { grads: model.optimizerGrads } : {},
    );
    closers.push(() => optimizer.dispose());
    const schedule = o.schedule === 'cosine' ? warmupCosine({ warmupSteps: o.warmupSteps, maxSteps: steps, maxLr: o.lr, minLr: o.minLr }) : constant(o.lr);
    header('optimizer', `${optimSpec.describe(o)}, weight decay ${o.weightDecay} on ${decay.length} matrices; lr ${o.lr} ` +
      (o.schedule === 'cosine' ? `warmup ${o.warmupSteps} steps, cosine to ${o.minLr}` : 'constant') +
      (o.gradClip > 0 ? `; clip grad norm at ${o.gradClip}` : '') + (layout.zero >= 1 ? `; state sharded over ${layout.dpShard} rank(s)` : ''));

    // ---- checkpoint state: where each parameter lives ([Note: placement]), then resume or initFrom
    // A LoRA run saves and resumes its trainable parameters only; its base comes from train.initFrom.
    const placements = (): ParamPlacement[] => (lora ? trainablePlacements(model.placements()) : model.placements());
    if (lora) checkInitFromNotLora(cfg.train.initFrom);
    const base = lora ? agreeOnBase(world, cfg.train.initFrom) : undefined;
    const moe = cfg.moe.experts > 0 ? new MoEBookkeeping(model.parts, cfg.moe, cfg.model.nLayer, layout.tp ?? 1) : undefined;
    const ckpts = new RunCheckpoints(runCfg, { world, ranksPerHost: env.localWorldSize, log: out.log });
    const resumedFrom = ckpts.resumeTarget(opts.resume);
    let startStep = 0;
    if (resumedFrom !== undefined) {
      const saved = readMeta(resumedFrom);
      const problem = loraResumeProblem(resumedFrom, saved, base);
      if (problem !== undefined) throw new CheckpointError(problem);
      const meta = restore(resumedFrom, { placements: placements(), optimizer, optimizerName: optimSpec.label }, lora ? loraCount?.trainable : numParams);
      startStep = meta.step;
      if (meta.moe && moe) moe.loadExpertBiases(meta.moe.expertBias);
      if (startStep >= steps) {
        throw new ConfigError([cfg.train.epochs > 0
          ? `the checkpoint ${resumedFrom} is at step ${startStep}, and train.epochs = ${cfg.train.epochs} makes ${steps} steps: nothing is left to train; raise --train.epochs`
          : `the checkpoint ${resumedFrom} is at step ${startStep}, and train.steps is ${cfg.train.steps}: nothing is left to train; raise --train.steps`]);
      }
      loader.loadStateDict(meta.data);
      // Lingua's lesson again, at the resumed position and under this run's data-parallel layout.
      verifyDataPartition(mesh.data, loader.localSampleIds(startStep), cfg.data.globalBatch);
      header('resume', `resumed from step ${startStep} (${resumedFrom}; saved by ${meta.layout.worldSize} rank(s), ${meta.layout.description})`);
      // After a lost host (src/launch/launcher.ts, [Note: elastic shrink]): the launcher said what happened.
      if (launcherEnv().elastic) header('elastic', `${launcherEnv().elastic}; ${describeLayout(layout)}${micro.why ? `; ${micro.why}` : ''}; resumed from step ${startStep}`);
    } else if (launcherEnv().elastic) {
      header('elastic', `${launcherEnv().elastic}; ${describeLayout(layout)}${micro.why ? `; ${micro.why}` : ''}; no checkpoint yet: started again from step 0`);
    }
    if (lora) {
      initFrom(cfg.train.initFrom, frozenPlacements(model.placements()), numParams, modelConfigOf(cfg) as unknown as Record<string, unknown>);
      // [lora] adapter: a PEFT adapter's tensors continue training (each rank reads the ranges it holds).
      const fromPeft = resumedFrom === undefined && cfg.lora.adapter !== '';
      if (fromPeft) loadPeftAdapter(cfg.lora.adapter, placements(), { model: modelCfg as unknown as Record<string, unknown>, lora: cfg.lora });
      const adapters = resumedFrom !== undefined ? `adapters from step ${startStep}` : fromPeft ? `adapters from ${cfg.lora.adapter}, step 0` : 'new adapters (A from train.seed, B zero), step 0';
      header('init', `frozen base from ${cfg.train.initFrom}; ${adapters}`);
    } else if (resumedFrom === undefined && cfg.train.initFrom !== '') {
      initFrom(cfg.train.initFrom, placements(), numParams, modelConfigOf(cfg) as unknown as Record<string, unknown>);
      header('init', `weights from ${cfg.train.initFrom}; step 0, fresh optimizer state`);
    }
    // ---- DPO's reference ([Note: DPO reference] in reference.ts): the policy with its adapters off,
    // or a frozen copy of the starting weights (seed or train.initFrom) placed by the same layout.
    let dpo: DpoReference | undefined;
    if (cfg.train.objective === 'dpo') {
      dpo = openDpoReference(cfg, {
        model, mesh, world, loader, evalLoader, microBatches: cfg.data.microBatches, evalBatches: cfg.train.evalBatches, steps,
        // the policy's precision and kernels: at step 0 both give the same log-probabilities (loss ln 2)
        scope: (fn) => autocast(cfg.train.precision, () => withKernels(cfg.train.kernels, fn)),
        copy: () => {
          const copy = parallelize(withObjective(frozen(buildPlain()), criterion), mesh, plan);
          if (cfg.train.initFrom !== '') initFrom(cfg.train.initFrom, copy.placements(), numParams, modelConfigOf(cfg) as unknown as Record<string, unknown>);
          return copy;
        },
      });
      const ref = dpo;
      closers.push(() => ref.dispose());
      header('dpo', describeObjective(asked, referenceKind(cfg) === 'adapters' ? 'the policy with its LoRA adapters off' : 'a frozen copy of the starting weights'));
    }
    const runInfo = (step: number, expertBias?: Record<string, number[]>): RunInfo => ({
      layout: { worldSize: env.worldSize, description: describeLayout(layout), ...layout },
      config: cfg as unknown as Record<string, Record<string, unknown>>,
      data: loader.stateDict(),
      rng: { kind: 'seed-per-step' as const, seed: cfg.train.seed },
      schedule: { step },
      ...(expertBias ? { moe: { expertBias } } : {}),
      ...(base ? { base } : {}),
    });
    const M = cfg.data.microBatches;
    return {
      world, layout, mesh, loader, steps, tokensPerStep, numParams, model, named, optimizer, schedule, ckpts, moe, startStep, resumedFrom, close, microBatches: M, dpo,
      evaluate() {
        // Forward only, on the step's kernels; each call returns its global batch's loss and count on every rank: weighted
        // by their counts, the batches give the mean over every trained token they hold.
        let sum = 0, count = 0;
        for (let k = 0; k < cfg.train.evalBatches; k++) {
          const r = tidy(() => {
            const mbs = Array.from({ length: M }, (_, mb) => evalLoader.batch(k, mb));
            try {
              return autocast(cfg.train.precision, () => withKernels(cfg.train.kernels, () => model.evaluate(dpo ? dpo.evalLogps(mbs) : mbs)));
            } finally {
              for (const mb of mbs) mb.docs?.dispose(); // packed validation rows' documents are kept tensors
            }
          });
          sum += r.loss * r.count;
          count += r.count;
        }
        return count > 0 ? sum / count : NaN;
      },
      async saveCheckpoint(step) {
        model.finishParameterGathers(); // ZeRO-1/2: the last step's parameter gathers land first
        const expertBias = moe?.expertBiases(world); // a collective: every rank saves
        await ckpts.save(step, { placements: placements(), optimizer, optimizerName: optimSpec.label }, runInfo(step, expertBias));
      },
    };
  } catch (e) {
    close();
    throw e;
  }
}

/**
 * The parameters the optimizer updates: those that train (requiresGrad; a frozen one gets no
 * optimizer state), split into the matrices that take weight decay and the rest (biases, norms),
 * as nanoGPT and GPT-2 decay.
 */
export function trainedParameters(named: readonly [string, Tensor][]): { decay: Tensor[]; noDecay: Tensor[] } {
  const trained = named.map(([, p]) => p).filter((p) => p.requiresGrad);
  return { decay: trained.filter((p) => p.ndim >= 2), noDecay: trained.filter((p) => p.ndim < 2) };
}

/**
 * `flotilla verify`'s record: every rank writes its per-step loss and gradient norm and the names
 * of the parameters it trains (rank<r>.json), and its whole parameters by model name
 * (rank<r>.safetensors; tensor-parallel slices gathered).
 */
export function writeRankRecord(dir: string, rank: number, steps: { step: number; loss: number; gradNorm: number }[], parts: Pick<RunParts, 'model' | 'named'>): void {
  mkdirSync(dir, { recursive: true });
  const { model, named } = parts;
  const trained = named.filter(([, p]) => p.requiresGrad).map(([n]) => n);
  writeFileSync(join(dir, `rank${rank}.json`), JSON.stringify({ rank, steps, trained }));
  const whole = (p: Tensor) => model.whole(p); // tensor-parallel slices gathered
  const save = () => tidy(() => saveSafetensors(join(dir, `rank${rank}.safetensors`), Object.fromEntries(named.map(([n, p]) => [n, whole(p)])), { format: 'pt' }));
  model.withFullParameters(save);
}

/**
 * The MFU's numerator per token ([Note: model flops]) and one rank's peak (rank 0's, told to all),
 * announced once; returns the metrics row's MFU fields for a step's global tokens/s (none when the
 * model does not give its FLOP count).
 */
export function openMfu(cfg: FlotillaConfig, world: ProcessGroup, out: Pick<RunConsole, 'header'>): (tokensPerSec: number) => { flopsPerToken?: number; tflops?: number; mfu?: number } {
  const flops = modelFlops(cfg);
  const peak = flops && worldPeakTflops(world, cfg.log.peakTflops, cfg.train.precision === 'bf16-mixed' ? 'bfloat16' : 'float32');
  if (!flops || !peak) return () => ({});
  out.header('mfu', `${flops.perToken.toExponential(3)} model FLOPs per token (6 x ${flops.matmulParams.toLocaleString('en-US')} matmul weights a token goes through + ` +
    `${flops.attention.toLocaleString('en-US')} of attention); peak ${peak.tflops.toPrecision(3)} TFLOP/s per rank, ${peak.source}`);
  return (tokensPerSec) => ({ flopsPerToken: flops.perToken, ...mfuOf(flops.perToken, tokensPerSec, world.size, peak.tflops) });
}
