// What an architecture gives the trainer and its layouts ([Note: model registry] in registry.ts).
import type { Module } from '../nn/module.js';
import type { PipelineModel } from '../parallel/pipeline/model.js';
import type { LossFn } from '../parallel/parallel_model.js';
import type { UnitPolicy } from '../parallel/fsdp.js';
import type { TpPlan } from '../parallel/tensor_parallel/styles.js';

/** What a layout asks of the model's shapes (config field values, before any rank starts). */
export interface ShapeContext {
  /** Tokens per sample (data.seqLen). */
  seqLen: number;
  pp: number;
  ppVirtualStages: number;
  tp: number;
  sequenceParallel: boolean;
}

export interface ModelSpec<C = any> {
  /** The `[model] arch` name. */
  readonly arch: string;
  /** One line for the run's header (layers, widths, context). */
  describe(cfg: C): string;
  numParams(cfg: C): number;
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
  /** Every problem of the model section with this layout, each naming the config field and the fix. */
  shapeProblems(cfg: C, ctx: ShapeContext): string[];
}
