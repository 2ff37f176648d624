// A LoRA run ([lora] rank > 0): adapters on the model the trainer built, before any parallelism;
// the frozen base read from train.initFrom; checkpoints of the adapters alone, naming the base.
//
// [Note: LoRA run] The model is built as for any run (whole, without memory under ZeRO-3, or as
// pipeline stages), then applyLora (src/nn/lora.ts) adds the adapters in place and freezes the
// rest, then the layout parallelizes it. Every name is the whole model's, so targets resolve the
// same on every rank and every layout, and each A is drawn from (train.seed, its name): a ZeRO-3
// rank draws its shard of A where it makes its shard of the base (drawLoraParameter), a pipeline
// rank adapts the stages it builds. The base is loaded into the frozen parameters only (the
// adapters are not in it); a checkpoint holds the trainable parameters and their optimizer state,
// and meta.base names the base's files (size and SHA-256, hashed once when the run starts), which a
// resume checks before loading the adapters onto it.
import { existsSync, readFileSync, readdirSync, statSync } from 'node:fs';
import { basename, join, resolve } from 'node:path';
import type { Module } from '../nn/module.js';
import { applyLora, drawLoraParameter, hfModuleNames, type ApplyLoraOptions } from '../nn/lora.js';
import { loraCounts as countLora, type LoraCounts } from '../nn/lora_targets.js';
import type { PipelineModel } from '../parallel/pipeline/model.js';
import type { ParamPlacement } from '../parallel/placement.js';
import type { ModelSpec } from '../models/spec.js';
import type { FlotillaConfig } from '../config/schema.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import { broadcastJson } from '../checkpoint/replicas.js';
import { fileSha256 } from '../io/durable.js';
import { CheckpointError, META_FILE, readMeta, resolveCheckpoint, type BaseIdentity, type CheckpointMeta } from '../checkpoint/format.js';
import { HF_CONFIG, HF_INDEX, HF_SINGLE, isHfDir } from '../checkpoint/hf.js';
import { loadCheckpoint } from '../checkpoint/checkpoint.js';
import { placementsOf } from '../parallel/placement.js';
import { modelSpec } from '../models/registry.js';
import { modelConfigOf } from '../config/schema.js';
import { initFrom } from './checkpointing.js';

/** applyLora's options from a run's config: targets by flotilla or Hugging Face module names, A from train.seed. */
export function loraOptionsOf(cfg: FlotillaConfig, spec: ModelSpec, modelCfg: unknown): ApplyLoraOptions {
  const l = cfg.lora;
  return {
    rank: l.rank, alpha: l.alpha, dropout: l.dropout, rsLora: l.rsLora, targets: l.targets, initSeed: cfg.train.seed, head: 'head',
    baseDtype: l.baseDtype === 'bf16' ? 'bfloat16' : 'float32',
    ...(spec.hf ? { hfNames: hfModuleNames(hfTensorsOf(spec, modelCfg)) } : {}),
  };
}

/** The tensor map of the Hugging Face class the config is written as: a family's (Mixtral, Qwen3-MoE: experts' names) when one fits. */
function hfTensorsOf(spec: ModelSpec, modelCfg: unknown): { name: string; hf: string; stack?: unknown }[] {
  const family = spec.hfFamilies?.find((f) => f.misfit?.(modelCfg) === undefined);
  return (family ?? spec.hf!).tensors(modelCfg);
}

/**
 * Applies a run's [lora] to the model as built ([Note: LoRA run]): a whole model now (its adapters
 * taking part in its deferred init), a pipeline's stages as they are built. Returns the same kind.
 */
export function applyRunLora<T extends Module | PipelineModel>(built: T, cfg: FlotillaConfig, spec: ModelSpec, modelCfg: unknown): T {
  const opts = loraOptionsOf(cfg, spec, modelCfg);
  if (!('stage' in built)) {
    adaptModule(built as Module, opts);
    return built;
  }
  const pm = built as PipelineModel;
  const staged: PipelineModel = Object.create(pm) as PipelineModel;
  staged.stage = (index: number, numStages: number): Module => {
    const m = pm.stage(index, numStages);
    // A stage holds some of the Linears: targets naming others' are theirs (checked whole before launch).
    adaptModule(m, { ...opts, part: true });
    return m;
  };
  return staged as T;
}

function adaptModule(m: Module, opts: ApplyLoraOptions): void {
  const applied = applyLora(m, opts);
  const deferred = m.deferredInit;
  if (!deferred) return;
  // Built without memory (ZeRO-3): the adapters are made where the base is, shard by shard.
  const names = new Set(applied.trainable);
  for (const [name, p] of m.namedParameters()) if (names.has(name) && p.storageNbytes() > 0) p.resizeStorage_(0);
  const seed = opts.initSeed!;
  m.deferredInit = { init: (name, out) => (names.has(name) ? drawLoraParameter(name, out, seed) : deferred.init(name, out)) };
}

/** The whole model's adapter counts from the architecture's list of Linears (undefined when it has none). */
export function loraCounts(cfg: FlotillaConfig, spec: ModelSpec, modelCfg: unknown, numParams: number): LoraCounts | undefined {
  const linears = spec.linears?.(modelCfg);
  return linears ? countLora(linears, cfg.lora, numParams) : undefined;
}

/** A count for a header: 1.2M, 24M, 950K. */
export function shortCount(n: number): string {
  if (n >= 1e9) return `${+(n / 1e9).toPrecision(3)}B`;
  if (n >= 1e6) return `${+(n / 1e6).toPrecision(3)}M`;
  if (n >= 1e3) return `${+(n / 1e3).toPrecision(3)}K`;
  return String(n);
}

/** What a LoRA run saves and resumes: its trainable parameters only (the adapters). */
export function trainablePlacements(placements: readonly ParamPlacement[]): ParamPlacement[] {
  return placements.filter((p) => p.param.requiresGrad);
}

/** The base's frozen parameters: what train.initFrom fills. */
export function frozenPlacements(placements: readonly ParamPlacement[]): ParamPlacement[] {
  return placements.filter((p) => !p.param.requiresGrad);
}

/** The files that make up a base (weights and config), relative to its path. */
function baseFiles(path: string): string[] {
  if (statSync(path).isFile()) return [basename(path)];
  if (isHfDir(path)) {
    const index = join(path, HF_INDEX);
    if (existsSync(index)) {
      const map = (JSON.parse(readFileSync(index, 'utf8')) as { weight_map?: Record<string, string> }).weight_map ?? {};
      return [HF_CONFIG, HF_INDEX, ...[...new Set(Object.values(map))].sort()];
    }
    return [HF_CONFIG, HF_SINGLE];
  }
  return [META_FILE, ...readdirSync(path).filter((n) => n.endsWith('.safetensors')).sort()];
}

/** The identity of train.initFrom's files (path, each file's size and SHA-256); a checkpoint is named by its step directory. */
export function baseIdentity(arg: string): BaseIdentity {
  if (!existsSync(arg)) throw new CheckpointError(`train.initFrom: ${arg} does not exist; name a Hugging Face model directory, a checkpoint directory or an exported .safetensors file`);
  const path = statSync(arg).isFile() || isHfDir(arg) ? arg : resolveCheckpoint(arg);
  const dir = statSync(path).isFile() ? resolve(path, '..') : resolve(path);
  return {
    path: resolve(path),
    files: baseFiles(path).map((name) => {
      const f = join(dir, name);
      if (!existsSync(f)) throw new CheckpointError(`train.initFrom: ${path} is missing ${name}; a LoRA run reads its frozen base from there: restore the file, or set train.initFrom to a complete copy of the base`);
      return { name, bytes: statSync(f).size, sha256: fileSha256(f) };
    }),
  };
}

/** The base's identity, hashed once by rank 0 and shared (collective). */
export function agreeOnBase(world: ProcessGroup, path: string): BaseIdentity {
  let mine: { base?: BaseIdentity; error?: string } | undefined;
  if (world.rank === 0) {
    try {
      mine = { base: baseIdentity(path) };
    } catch (e) {
      mine = { error: (e as Error).message };
    }
  }
  const got = broadcastJson(world, mine);
  if (got.error !== undefined) throw new CheckpointError(got.error);
  return got.base!;
}

/**
 * Why a resumed LoRA checkpoint cannot continue on this base (undefined when it can): a file of the
 * base it trained on is missing or changed.
 */
export function baseMismatch(ckpt: string, saved: BaseIdentity, now: BaseIdentity): string | undefined {
  const have = new Map(now.files.map((f) => [f.name, f]));
  const fix = `restore the base the adapters were trained on (train.initFrom = "${saved.path}"), or start a new run on this base from the adapters' weights without --resume`;
  for (const f of saved.files) {
    const h = have.get(f.name);
    if (!h) return `the checkpoint ${ckpt} trained adapters on ${saved.path}, whose file ${f.name} is not in ${now.path} now; ${fix}`;
    if (h.sha256 !== f.sha256 || h.bytes !== f.bytes) {
      return `the base changed since the checkpoint ${ckpt} was saved: ${join(now.path, f.name)} is ${h.bytes} bytes with SHA-256 ${h.sha256.slice(0, 16)}..., ` +
        `and the adapters were trained on ${f.bytes} bytes with SHA-256 ${f.sha256.slice(0, 16)}...; ${fix}`;
    }
  }
  for (const f of now.files) if (!saved.files.some((s) => s.name === f.name)) return `the base ${now.path} has a file ${f.name} that the checkpoint ${ckpt}'s base did not have; ${fix}`;
  return undefined;
}

/** A LoRA run cannot start from a LoRA checkpoint: its base is elsewhere and its adapters are not a model. */
export function checkInitFromNotLora(path: string): void {
  if (!existsSync(path) || statSync(path).isFile() || isHfDir(path)) return;
  let meta: CheckpointMeta;
  try {
    meta = readMeta(resolveCheckpoint(path));
  } catch {
    return; // loadWeights names what is wrong with it
  }
  if (meta.base) {
    throw new CheckpointError(
      `train.initFrom: ${path} is a LoRA checkpoint (adapters on the base ${meta.base.path}), not a model; ` +
        `merge its adapters into the base first (flotilla export ${path} OUT --format hf --merge) and set train.initFrom to OUT, or resume it with --resume`,
    );
  }
}

/**
 * Why a checkpoint cannot resume this run (undefined when it can): a LoRA checkpoint resumed
 * without [lora], a full one resumed with it, or a LoRA checkpoint whose base changed.
 */
export function loraResumeProblem(ckpt: string, meta: CheckpointMeta, base: BaseIdentity | undefined): string | undefined {
  if (meta.base && !base) {
    const l = (meta.config.lora ?? {}) as Record<string, unknown>;
    return `the checkpoint ${ckpt} holds LoRA adapters (rank ${String(l.rank)}) on the base ${meta.base.path}, and this run has lora.rank = 0; resume it with the [lora] section and train.initFrom it was saved with (its run's config.toml)`;
  }
  if (!meta.base && base) {
    return `the checkpoint ${ckpt} holds a whole model, not LoRA adapters; to train adapters on it start a new run with train.initFrom = "${ckpt}" (without --resume), or resume it with lora.rank = 0`;
  }
  return meta.base && base ? baseMismatch(ckpt, meta.base, base) : undefined;
}

/** A LoRA checkpoint's model in one process ({@link loraRunModel}). */
export interface LoraRunModel {
  /** The whole model: the base with its adapters (A and B as saved), in eval mode. */
  model: Module;
  meta: CheckpointMeta;
  /** The run's resolved config, as the checkpoint records it. */
  config: FlotillaConfig;
  spec: ModelSpec;
}

/**
 * A LoRA run's checkpoint as one whole model in this process ([Note: LoRA run]): built from the
 * run's config, adapted as the run was, its base read from the run's train.initFrom after checking
 * the files are the ones the adapters trained on, and the adapters from the checkpoint.
 */
export function loraRunModel(path: string): LoraRunModel {
  const dir = resolveCheckpoint(path);
  const meta = readMeta(dir);
  if (!meta.base) throw new CheckpointError(`${path} is not a LoRA checkpoint (its meta.json names no base): it holds a whole model`);
  const config = meta.config as unknown as FlotillaConfig;
  const mismatch = baseMismatch(dir, meta.base, baseIdentity(config.train.initFrom));
  if (mismatch !== undefined) throw new CheckpointError(mismatch);
  const spec = modelSpec(config.model.arch);
  const modelCfg = modelConfigOf(config);
  const numParams = spec.numParams(modelCfg);
  const model = applyRunLora(spec.build(modelCfg, { initSeed: config.train.seed }), config, spec, modelCfg);
  try {
    const placements = placementsOf(model.namedParameters());
    initFrom(config.train.initFrom, frozenPlacements(placements), numParams, modelCfg as unknown as Record<string, unknown>);
    const trainable = trainablePlacements(placements);
    loadCheckpoint(dir, trainable, { numParams: trainable.reduce((a, p) => a + p.param.numel(), 0) });
  } catch (e) {
    model.dispose();
    throw e;
  }
  model.eval();
  return { model, meta, config, spec };
}
