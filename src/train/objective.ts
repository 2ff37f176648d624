// What a run minimises (`[train] objective`): "lm", the model's next-token loss on the trained
// targets; "dpo", direct preference optimisation on preference pairs against a reference
// ([Note: DPO criterion] in dpo.ts, [Note: DPO reference] in reference.ts).
//
// DPO turns dropout off (model.dropout and lora.dropout become 0, as TRL's disable_dropout): the
// log-ratios to the reference must be those of one deterministic function, so that the first
// step's are exactly 0 (loss ln 2) and a reference computed once stays the one the policy is
// compared with. The run's header says so.
import type { Module } from '../nn/module.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { Criterion, LossFn, ParallelModel } from '../parallel/parallel_model.js';
import type { LayoutMesh } from '../parallel/parallelize.js';
import type { PipelineModel } from '../parallel/pipeline/model.js';
import type { FlotillaConfig } from '../config/schema.js';
import { DPO_METRICS, dpoCriterion } from './dpo.js';
import { DpoReference, adaptersReference, modelReference, sequenceReader, type ReferenceLoader } from './reference.js';

/** The run's config as the objective runs it: under DPO, dropout off. */
export function objectiveConfig(cfg: FlotillaConfig): FlotillaConfig {
  if (cfg.train.objective !== 'dpo' || (cfg.model.dropout === 0 && cfg.lora.dropout === 0)) return cfg;
  return { ...cfg, model: { ...cfg.model, dropout: 0 }, lora: { ...cfg.lora, dropout: 0 } };
}

/** The reference DPO compares with: "auto" is the adapters with LoRA, else a frozen copy. */
export function referenceKind(cfg: FlotillaConfig): 'adapters' | 'copy' {
  const r = cfg.dpo.reference;
  return r === 'auto' ? (cfg.lora.rank > 0 ? 'adapters' : 'copy') : r;
}

/** What the layout minimises: the model's token loss ("lm") or the DPO criterion (cp: the context-parallel ring). */
export function objectiveCriterion(cfg: FlotillaConfig, o: { loss: LossFn; cp?: ProcessGroup | undefined }): LossFn | Criterion {
  if (cfg.train.objective !== 'dpo') return o.loss;
  return dpoCriterion({ beta: cfg.dpo.beta, loss: cfg.dpo.loss, ...(o.cp ? { cp: o.cp } : {}) });
}

/** A model as built with the objective's criterion: a pipeline carries its own, so it gets this one. */
export function withObjective<T extends Module | PipelineModel>(built: T, criterion: LossFn | Criterion): T {
  if (!('stage' in built)) return built;
  const staged = Object.create(built) as PipelineModel;
  (staged as { loss: LossFn | Criterion }).loss = criterion;
  return staged as T;
}

/** One line for the run's header. */
export function describeObjective(cfg: FlotillaConfig, reference: string): string {
  const d = cfg.dpo;
  const dropout = cfg.model.dropout > 0 || cfg.lora.dropout > 0 ? '; dropout off (model.dropout and lora.dropout set to 0 for DPO)' : '; dropout off';
  return `DPO (${d.loss === 'ipo' ? 'IPO, per-token mean log-probabilities' : 'sigmoid'}, beta ${d.beta}) against ${reference}${d.precompute ? ', computed once before step 0' : ''}${dropout}`;
}

/** What a DPO run's reference is built from (phases.ts). */
export interface DpoRunContext {
  /** The policy as parallelized. */
  model: ParallelModel;
  mesh: LayoutMesh;
  world: ProcessGroup;
  /** Builds the frozen copy of the starting weights, placed by the run's layout and loaded as the policy was at step 0. */
  copy(): ParallelModel;
  loader: ReferenceLoader;
  evalLoader: ReferenceLoader;
  microBatches: number;
  evalBatches: number;
  steps: number;
  /** The run's autocast and kernels around each forward-only pass. */
  scope<R>(fn: () => R): R;
}

/** The reference of a DPO run ([Note: DPO reference] in reference.ts), live or to be precomputed by prepare(). */
export function openDpoReference(cfg: FlotillaConfig, c: DpoRunContext): DpoReference {
  const read = sequenceReader({ cp: c.mesh.cp });
  const kind = referenceKind(cfg);
  const live = kind === 'adapters' ? adaptersReference(c.model, read) : modelReference(c.copy(), read, 'a frozen copy of the starting weights, placed by the same layout');
  const d = cfg.data;
  return new DpoReference({
    live, precompute: cfg.dpo.precompute, world: c.world,
    contributes: c.mesh.tp.rank === 0 && (c.mesh.cp?.rank ?? 0) === 0 && c.mesh.pp.rank === 0,
    key: {
      data: JSON.stringify([c.loader.datasetKey, c.evalLoader.datasetKey, d.seqLen, d.overflow, c.loader.units, c.evalLoader.units]),
      base: JSON.stringify([cfg.train.initFrom, cfg.train.seed, cfg.model, cfg.train.precision, cfg.train.kernels]),
      reference: kind,
    },
    train: c.loader, val: c.evalLoader, microBatches: c.microBatches, evalBatches: c.evalBatches, steps: c.steps, scope: c.scope,
  });
}

/** A DPO step's metrics.jsonl fields: the pairs of the global batch and the means over them. */
export function dpoMetrics(pairs: number, m: Record<string, number> | undefined): Record<string, number> {
  return { pairs, ...Object.fromEntries(DPO_METRICS.map((k) => [k, m?.[k] ?? 0])) };
}
