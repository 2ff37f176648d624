// What an architecture gives the trainer and its layouts ([Note: model registry] in registry.ts).
import type { Module } from '../nn/module.js';
import type { PipelineModel } from '../parallel/pipeline/model.js';
import type { LossFn } from '../parallel/parallel_model.js';
import type { UnitPolicy } from '../parallel/data_parallel/fsdp.js';
import type { TpPlan } from '../parallel/tensor_parallel/styles.js';
import type { LinearShape } from '../nn/lora_targets.js';

/** An architecture's part of the model FLOPs per token (ModelRules.flopShape). */
export interface FlopShape {
  matmulParams: number;
  /** Per attention layer: heads x head width, and the keys a query reads. */
  attention: { width: number; keys: number }[];
}

/** What a layout asks of the model's shapes (config field values, before any rank starts). */
export interface ShapeContext {
  /** Tokens per sample (data.seqLen). */
  seqLen: number;
  pp: number;
  ppVirtualStages: number;
  tp: number;
  sequenceParallel: boolean;
}

/**
 * The light part of a spec: what the config's validation and the launcher ask of an architecture,
 * kept in files that do not load the tensor library (src/models/rules.ts).
 */
export interface ModelRules<C = any> {
  /** The `[model] arch` name. */
  readonly arch: string;
  /** One line for the run's header (layers, widths, context). */
  describe(cfg: C): string;
  numParams(cfg: C): number;
  /**
   * What the model FLOPs per token are counted from ([Note: model flops] in src/train/flops.ts): the
   * weights of the matmuls one token goes through, and each attention layer's width (heads x head
   * width) and the keys a query reads from a sequence of `seqLen`. Absent: no MFU.
   */
  flopShape?(cfg: C, seqLen: number): FlopShape;
  /** Every problem of the model section with this layout, each naming the config field and the fix. */
  shapeProblems(cfg: C, ctx: ShapeContext): string[];
  /**
   * Every Linear of the whole model (module path, Hugging Face module path, shape), as the built
   * model has them: what LoRA targets are checked against before any rank starts (src/nn/lora_targets.ts).
   */
  linears?(cfg: C): LinearShape[];
  /**
   * The architecture's Hugging Face map without the model class (HfMap): how a config resolves
   * `[train] initFrom = HF_DIR` into its [model] section before any rank starts (src/config/init_from.ts).
   * A spec's `hf` stands for it.
   */
  readonly hfMap?: HfMap<C>;
  /** More Hugging Face maps of the architecture (MixtralForCausalLM for the Llama), as hfMap; a spec's hfFamilies stand for them. */
  readonly hfFamilyMaps?: readonly HfMap<C>[];
}

export interface ModelSpec<C = any> extends ModelRules<C> {
  /**
   * The whole model, every parameter drawn from (initSeed, its name); deferInit builds it without
   * memory for ZeRO-3 ([Note: deferred init] in src/nn/module.ts).
   */
  build(cfg: C, opts: { initSeed: number; deferInit?: boolean }): Module;
  /** The model cut into pipeline stages (a rank builds only its own). */
  pipeline(cfg: C, opts: { initSeed: number }): PipelineModel;
  /** The criterion: (the model's output, the targets) -> mean loss. */
  readonly loss: LossFn;
  /** ZeRO-3 wrapping units. */
  readonly units: UnitPolicy;
  /** The tensor-parallel plan (module path -> style), per part when the model is split into stages. */
  tensorPlan(opts: { sequenceParallel?: boolean; lossParallel?: boolean }): TpPlan | ((part: Module) => TpPlan);
  /** How the model reads and writes Hugging Face directories (src/checkpoint/hf.ts), when it can. */
  readonly hf?: HfFormat<C>;
  /** More transformers classes that load into this architecture (MixtralForCausalLM: the Llama with [moe]); a model is written as the first of hf, then these, that fits its config (misfit). */
  readonly hfFamilies?: readonly HfFormat<C>[];
}

/** One parameter as transformers stores it. */
export interface HfTensor {
  /** The parameter's whole-model name in flotilla. */
  name: string;
  /** Its name in transformers' state dict. */
  hf: string;
  /** Its shape there. */
  shape: number[];
  /** Stored as the transpose of flotilla's 2-D tensor (GPT-2's Conv1D keeps weights [in, out]). */
  transpose?: boolean;
  /** Not a parameter of this config: written as zeros (a bias-free GPT's biases), not read. */
  zeros?: boolean;
  /**
   * One of `count` stored tensors stacked along flotilla's first dim: this one is slice `index` (an
   * expert's Linear of a grouped (experts, in, out) stack). `shape` and `transpose` are the slice's.
   */
  stack?: { index: number; count: number };
}

/** An architecture's map to a transformers model class: the config fields and the tensor names. */
export interface HfFormat<C = any> {
  /** config.json's `architectures[0]` (e.g. "LlamaForCausalLM"). */
  readonly architecture: string;
  /** config.json's `model_type` (e.g. "llama"). */
  readonly modelType: string;
  /**
   * Every model_type it reads, with its `architectures[0]`, when it is more than one (the Llama's
   * families: llama_family_hf.ts); fromConfig then reads each, and toConfig and tensors write the
   * config's own.
   */
  readonly modelTypes?: Readonly<Record<string, string>>;
  /**
   * The [model] fields a config.json describes (arch included); a field this model cannot honour is
   * an error naming it and what is supported.
   */
  fromConfig(hf: Record<string, unknown>): Record<string, unknown>;
  /** config.json for a model of this config, with transformers' field names. */
  toConfig(cfg: C): Record<string, unknown>;
  /** Every stored tensor, in the order transformers writes them (a tied head is not stored). */
  tensors(cfg: C): HfTensor[];
  /** Stored tensors that are not parameters (buffers older transformers saved), skipped on read. */
  readonly ignored?: RegExp;
  /** Names older saves used, mapped to today's (GPT-2 checkpoints without the "transformer." prefix). */
  canonicalName?(stored: string): string;
  /** Why this format cannot hold a model of this config (undefined: it can); a spec's formats are tried in order. */
  misfit?(cfg: C): string | undefined;
  /** This architecture's whole-model config, when `model` is one of its models (savePretrained). */
  configOf(model: Module): C | undefined;
  /** The config with its derived fields (0 = from the others) filled in, to compare two configs. */
  resolve?(cfg: C): C;
}

/** An HfFormat without configOf, the one part that needs the model's class: kept in files that load no tensor library. */
export type HfMap<C = any> = Omit<HfFormat<C>, 'configOf'>;
