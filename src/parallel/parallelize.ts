// The one place a layout is applied to a model, from outside it (models know nothing about ranks):
//
//   const layout = resolveLayout(cfg.parallel, worldSize);     // layout.ts: validated once
//   const mesh = buildMesh(layout, world);                      // pp x dpReplicate x dpShard x cp x tp
//   const model = parallelize(myModel, mesh, { layout, micro, loss, units, tensorParallel });
//   model.step(microBatches); clipGradNorm(model.grads, 1); ...  // the same loop for every layout
//
// parallelize applies the pipeline first (this rank builds only its stages), then tensor
// parallelism to each part (the plan's styles, tensor_parallel/styles.ts), then sharding or
// replication over the data-parallel ranks (plain, ZeRO-1/2/3, HSDP; inside a pipeline the stages
// are wrapped together), and returns this rank's model parts behind one ParallelModel. The order
// is torchtitan's: pipeline, tensor parallel, then FSDP/DDP; ZeRO then shards the tp slices.
// Context parallelism wraps the result: it cuts the micro-batches' sequences and runs the step
// under the ring's attention; to the layers below, its ranks are more data-parallel ranks
// ([Note: context parallelism] in context_parallel/model.ts).
import type { Tensor } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import { DeviceMesh } from '../distributed/mesh.js';
import { expertMeshDims, meshDims, type MeshDegrees } from '../distributed/mesh_axes.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { DataParallel } from './data_parallel/data_parallel.js';
import { buildDataParallel, type DataParallelGroups, type DataParallelKnobs, type DataParallelSpec } from './data_parallel/wrappers.js';
import { DataParallelModel } from './data_parallel/model.js';
import { ExpertParallelModel, applyExpertParallel } from './expert_parallel.js';
import type { Layout } from './layout.js';
import type { Criterion, LossFn, ParallelModel } from './parallel_model.js';
import { bindLoss, criterionOf } from './loss_reduction.js';
import type { PipelineModel } from './pipeline/model.js';
import { PipelineParallel, type PipelineOptions } from './pipeline/pipeline_parallel.js';
import { withCrossEntropy } from '../nn/functional.js';
import { parallelizeModule, TensorParallelError, type TensorParallelApplied, type TpPlan } from './tensor_parallel/styles.js';
import { vocabParallelCrossEntropy } from './tensor_parallel/loss.js';
import { TensorParallelModel } from './tensor_parallel/model.js';
import { ContextParallelModel } from './context_parallel/model.js';

export { resolveLayout, describeLayout, type Layout } from './layout.js';
export type { DataParallelKnobs } from './data_parallel/wrappers.js';

export interface LayoutMesh {
  mesh: DeviceMesh;
  /**
   * The ranks over which gradients are reduced: every data-parallel rank of this rank's pipeline
   * position, times the context-parallel ranks when cp > 1 (they hold the same parameters).
   */
  dp: ProcessGroup;
  /** The ranks one model state is sharded over: dpShard (x cp). */
  shard: ProcessGroup;
  /** The data-parallel ranks proper, which read distinct samples (dp without cp). */
  data: ProcessGroup;
  /** The context-parallel ring (layout.cp > 1): ranks holding chunks of the same sequences. */
  cp?: ProcessGroup;
  replicate: ProcessGroup;
  pp: ProcessGroup;
  /** The tensor-parallel group (innermost dim: neighbouring ranks). */
  tp: ProcessGroup;
  /** This rank's data-parallel rank: the flattened (dpReplicate, dpShard) mesh rank, replicateRank * dpShard + shardRank. */
  dpRank: number;
  /**
   * Expert parallelism (layout.ep > 1): `ep`, the neighbouring ranks of dpShard x cp that split the
   * experts; `edp`, the ranks holding the same experts (over which their gradients are reduced).
   */
  ep?: ProcessGroup;
  edp?: ProcessGroup;
  /** Under HSDP with ep: the expert-holding ranks of one replica (the experts' shard group). */
  edpShard?: ProcessGroup;
}

/** Builds the mesh and its groups (collective: every rank calls it with the same layout). */
export function buildMesh(layout: MeshDegrees, world: ProcessGroup): LayoutMesh {
  const ep = layout.ep ?? 1, cp = layout.cp ?? 1;
  // The axes and their order are the table's ([Note: mesh axes] in src/distributed/mesh_axes.ts).
  // Expert parallelism borrows its ranks from the ranks that hold the same dense parameters of one
  // replica, dpShard x cp in mesh order, split into (outer, ep): ep ranks are neighbours, and the
  // ranks holding the same experts (edp) are the replicas x outer ([Note: expert parallelism]).
  const expertMesh = () => DeviceMesh.build(expertMeshDims(layout), world);
  const expertGroups = (m: DeviceMesh): Pick<LayoutMesh, 'ep' | 'edp' | 'edpShard'> =>
    ({ ep: m.dim('ep').group, edp: m.flatten(['dpReplicate', 'dpShardOuter'], 'edp').group, edpShard: m.dim('dpShardOuter').group });
  if (cp > 1) {
    // cp between dpShard and tp (torchtitan's order): a cp ring is neighbouring tp groups. Gradients
    // are reduced and sharded over dpShard x cp ([Note: context parallelism]); the data-parallel
    // rank stays the (dpReplicate, dpShard) rank, so every cp rank reads the same samples. The
    // expert groups come from a second grid over the same ranks (ep need not divide cp or dpShard).
    const mesh = DeviceMesh.build(meshDims(layout), world);
    const data = mesh.flatten(['dpReplicate', 'dpShard'], 'data');
    return {
      mesh, dp: mesh.flatten(['dpReplicate', 'dpShard', 'cp'], 'dp').group, shard: mesh.flatten(['dpShard', 'cp'], 'dpShardCp').group, data: data.group,
      replicate: mesh.dim('dpReplicate').group, pp: mesh.dim('pp').group, tp: mesh.dim('tp').group, cp: mesh.dim('cp').group, dpRank: data.rank,
      ...(ep > 1 ? expertGroups(expertMesh()) : {}),
    };
  }
  if (ep > 1) {
    // Without cp the expert grid is the mesh: the data-parallel rank is unchanged (replicate x
    // dpShard + outer x ep + epRank).
    const mesh = expertMesh();
    const dp = mesh.flatten(['dpReplicate', 'dpShardOuter', 'ep'], 'dp');
    return {
      mesh, dp: dp.group, data: dp.group, shard: mesh.flatten(['dpShardOuter', 'ep'], 'dpShard').group, replicate: mesh.dim('dpReplicate').group, pp: mesh.dim('pp').group,
      tp: mesh.dim('tp').group, dpRank: dp.rank, ...expertGroups(mesh),
    };
  }
  // Without cp the mesh has no cp axis, so no group of one rank is built for it.
  const mesh = DeviceMesh.build(meshDims(layout).filter(([a]) => a !== 'cp'), world);
  // The data-parallel rank is the flattened mesh rank and nothing else (see layout.ts).
  const dp = mesh.flatten(['dpReplicate', 'dpShard'], 'dp');
  return {
    mesh, dp: dp.group, data: dp.group, shard: mesh.dim('dpShard').group, replicate: mesh.dim('dpReplicate').group, pp: mesh.dim('pp').group, tp: mesh.dim('tp').group, dpRank: dp.rank,
  };
}

/**
 * The data-parallel groups of a layout's mesh: ZeRO's shard and replicate groups when zero >= 1,
 * and under expert parallelism the experts' (their shard group is edpShard under HSDP, else edp).
 */
export function dataParallelGroups(mesh: LayoutMesh, layout: Layout): DataParallelGroups {
  return {
    dp: mesh.dp,
    ...(layout.zero >= 1 ? { shard: mesh.shard, replicate: mesh.replicate } : {}),
    ...((layout.ep ?? 1) > 1 ? { edp: mesh.edp!, ...(layout.dpReplicate > 1 ? { edpShard: mesh.edpShard! } : {}) } : {}),
  };
}

export interface ParallelPlan extends DataParallelKnobs {
  layout: Layout;
  /** Micro-batches per step on each data-parallel rank (the pipeline's m). */
  micro: number;
  /**
   * The criterion for a whole-module model: (its output, the micro-batch's y, { reduction }) ->
   * scalar loss, or a Criterion ([Note: global loss reduction] in loss_reduction.ts). A PipelineModel carries its own.
   */
  loss?: LossFn | Criterion;
  /**
   * Tensor parallelism (layout.tp > 1): module path -> style for the model, or for each part (a
   * pipeline stage holds only some modules). A GPT's is gptTensorPlan (src/models/gpt_parallel.ts).
   */
  tensorParallel?: TpPlan | ((part: Module) => TpPlan);
}

/** True for a PipelineModel (stage builder + loss), false for a Module. */
function isPipelineModel(m: Module | PipelineModel): m is PipelineModel {
  const loss = (m as PipelineModel).loss as LossFn | Criterion | undefined;
  return typeof (m as PipelineModel).stage === 'function' && (typeof loss === 'function' || typeof loss?.apply === 'function');
}

/**
 * Applies the plan's layout to a model: pipeline (a PipelineModel is required when pp > 1), then
 * sharding or replication. Takes ownership of the model: the result's dispose() frees it.
 */
export function parallelize(model: Module | PipelineModel, mesh: LayoutMesh, plan: ParallelPlan): ParallelModel {
  const { cp = 1, ep = 1 } = plan.layout;
  if (ep > 1 && (!mesh.ep || !mesh.edp)) throw new Error(`parallelize: layout.ep = ${ep} needs the mesh built from the same layout (buildMesh(layout, world))`);
  if (cp === 1) return parallelizeLayers(model, mesh, plan);
  if (!mesh.cp || mesh.cp.size !== cp) throw new Error(`parallelize: layout.cp = ${cp} needs the mesh built from the same layout (buildMesh(layout, world))`);
  return new ContextParallelModel(parallelizeLayers(model, mesh, plan), mesh.cp, mesh.pp);
}

/** Pipeline, tensor parallelism and data parallelism (everything but context parallelism). */
function parallelizeLayers(model: Module | PipelineModel, mesh: LayoutMesh, plan: ParallelPlan): ParallelModel {
  const { layout } = plan;
  const tp = layout.tp ?? 1;
  // Experts are cut to this rank's share first, so that the tensor-parallel placements see the
  // parameters the model ends up with ([Note: expert parallelism] in expert_parallel.ts).
  const experts = (layout.ep ?? 1) > 1 && !isPipelineModel(model) ? applyExpertParallel(model, mesh.ep!) : undefined;
  if (tp === 1) return parallelizeParts(model, mesh, plan, { experts });
  if (!plan.tensorParallel) throw new TensorParallelError([`parallel.tp = ${tp} needs a tensor-parallel plan: pass plan.tensorParallel (module path -> style; a GPT's is gptTensorPlan)`]);
  if (mesh.tp.size !== tp) throw new TensorParallelError([`the mesh's tp group has ${mesh.tp.size} rank(s), the layout says tp = ${tp}: build the mesh from the same layout`]);
  const planFor = plan.tensorParallel;
  const applied: TensorParallelApplied[] = [];
  const applyTo = (part: Module): void => {
    applied.push(parallelizeModule(part, mesh.tp, typeof planFor === 'function' ? planFor(part) : planFor));
  };
  // The criterion's cross-entropy becomes the vocab-parallel one when the logits stay sharded (its
  // 'sum' reduction and ignored targets included); the count reads y, which every tp rank holds.
  const scope = <T>(fn: () => T): T => (applied.some((a) => a.lossParallel) ? withCrossEntropy(vocabParallelCrossEntropy(mesh.tp), fn) : fn());
  const lossParallel = (loss: LossFn | Criterion): Criterion => {
    const c = criterionOf(loss);
    return { count: (mb) => c.count(mb), apply: (out, mb) => scope(() => c.apply(out, mb)) };
  };
  let inner: ParallelModel;
  if (isPipelineModel(model)) {
    const stage = model.stage.bind(model);
    inner = parallelizeParts({
      ...model,
      stage: (i, n) => {
        const s = stage(i, n);
        applyTo(s);
        return s;
      },
      loss: lossParallel(bindLoss(model.loss, model)),
    }, mesh, plan, { restyled: (m) => applied.some((a) => a.styled.has(m)) });
  } else {
    applyTo(model);
    inner = parallelizeParts(model, mesh, { ...plan, ...(plan.loss ? { loss: lossParallel(plan.loss) } : {}) }, { experts });
  }
  return new TensorParallelModel(inner, applied, { sequenceParallel: layout.sequenceParallel ?? false, lossScope: scope });
}

/**
 * Pipeline, then data parallelism, of the (tensor-parallel) parts; `restyled`: the modules tp styles
 * rewrote; `experts`: a whole model's expert parameters that expert parallelism cut.
 */
function parallelizeParts(model: Module | PipelineModel, mesh: LayoutMesh, plan: ParallelPlan, cut: { restyled?: (m: Module) => boolean; experts?: Set<Tensor> | undefined } = {}): ParallelModel {
  const { restyled } = cut;
  const { layout } = plan;
  const dataParallel: DataParallelSpec = { layout, groups: dataParallelGroups(mesh, layout), knobs: plan };
  if (isPipelineModel(model)) {
    // Expert parallelism in a pipeline: each stage's experts are cut as the stage is built.
    let experts: PipelineOptions['experts'];
    if ((layout.ep ?? 1) > 1) {
      const ex = (experts = { params: new Set<Tensor>(), ep: mesh.ep! });
      const stage = model.stage.bind(model);
      model = { ...model, stage: (i, n) => {
        const s = stage(i, n);
        applyExpertParallel(s, ex.ep, { into: ex.params, allowNone: true });
        return s;
      } };
    }
    return new PipelineParallel(model, {
      ...(experts ? { experts } : {}),
      pp: mesh.pp, schedule: layout.schedule ?? '1f1b', ...(layout.virtualStages !== undefined ? { virtualStages: layout.virtualStages } : {}),
      micro: plan.micro,
      // nonFinite stays off: its verdict would be one stage's dp ranks', and the other stages would step on.
      dataParallel: { ...dataParallel, knobs: { ...plan, nonFinite: 'off' } },
      ...(restyled ? { restyled } : {}),
    });
  }
  if (layout.pp > 1) {
    throw new Error(`parallelize: pp = ${layout.pp} needs the model as pipeline stages, not one module: pass a PipelineModel (sequentialStages({ layers, layer, loss }), or gptPipeline(cfg, { initSeed }) for a GPT)`);
  }
  if (!plan.loss) throw new Error('parallelize: a whole-module model needs plan.loss, the criterion (output, target) => scalar loss');
  const { dense, experts } = buildDataParallel(model, dataParallel, cut.experts ? { experts: cut.experts } : {});
  // [Note: expert parallelism] in expert_parallel.ts: this rank's experts in a wrapper of their own.
  if (experts) return new ExpertParallelModel(model, dense, experts, cut.experts!, mesh.ep!, plan.loss);
  return new DataParallelModel(model, dense, plan.loss);
}

/** A whole model's data-parallel wrapper for the layout (plain, ZeRO-1/2/3, HSDP; no experts): the lower-level DataParallel. */
export function wrapDataParallel<M extends Module>(model: M, mesh: LayoutMesh, layout: Layout, knobs: DataParallelKnobs = {}): DataParallel<M> {
  return buildDataParallel(model, { layout, groups: dataParallelGroups(mesh, layout), knobs }).dense;
}
