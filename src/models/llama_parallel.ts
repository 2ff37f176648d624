// The Llama's parallel plans, next to the model as the GPT's are (gpt_parallel.ts): the pipeline
// split (the GPT's [Note: stage split]: embedding with the first stage, final norm and head with
// the last, blocks cut evenly), ZeRO-3 units, the tensor-parallel plan, and its registry spec.
import type { Tensor } from '../tensor/index.js';
import { Embedding, type Module } from '../nn/index.js';
import type { PipelineModel } from '../parallel/pipeline/model.js';
import type { StageValue } from '../parallel/parallel_model.js';
import { unitsByClass, type UnitPolicy } from '../parallel/data_parallel/fsdp.js';
import type { TpPlan } from '../parallel/tensor_parallel/styles.js';
import { gptLoss } from './gpt.js';
import { planStages, type PartCosts } from './gpt_parallel.js';
import { Llama, LlamaBlock, LlamaStage, resolveLlamaConfig, type LlamaConfig } from './llama.js';
import { llamaRules } from './llama_rules.js';
import type { ModelSpec } from './spec.js';
import { llamaFamilyHf } from './llama_family_hf.js';
import { mixtralHf } from './mixtral_hf.js';
import { qwen3MoeHf } from './qwen3_moe_hf.js';

/**
 * The Llama's tensor-parallel plan ([Note: tp styles]): q, k, v, gate and up column-parallel (each
 * rank holds nHead / tp query heads, nKvHead / tp key/value heads and intermediateSize / tp MLP
 * units), o and down row-parallel, the embedding vocab-parallel, the head column-parallel over the
 * vocabulary (or left sharded for the vocab-parallel loss). The attention and the MLP each prepare
 * their input once for their column-parallel projections (one communication each way, not one per
 * projection). With sequence parallelism the RMSNorms run on this rank's tokens: the embedding's
 * lookup is reduce-scattered over tokens, and the attention and the MLP gather them. Given a part
 * (a pipeline stage), only the modules it holds are named. Attention biases split with their
 * projection's output rows (q, k, v; o's is added once after the sum). Qwen3's per-head norms
 * are whole on every rank (they act within a head), but each rank's gradient is the part of its
 * own heads: they take the sequence-parallel style without input scatter, whose gradients are
 * summed over tp.
 */
export function llamaTensorPlan(opts: { sequenceParallel?: boolean; lossParallel?: boolean } = {}): (part: Module) => TpPlan {
  const sp = opts.sequenceParallel ?? false;
  const act = sp ? 'sequenceSharded' : 'replicated';
  return (part) => {
    const has = new Set(part.namedModules().map(([n]) => n));
    const plan: TpPlan = {};
    if (has.has('wte')) plan.wte = { kind: 'vocabEmbedding', output: act };
    if (part.namedModules().some(([n]) => /^layers\.\d+$/.test(n))) {
      Object.assign(plan, {
        'layers.*.attn': { kind: 'prepareInput', input: act },
        'layers.*.attn.q': { kind: 'colwise', input: 'prepared' },
        'layers.*.attn.k': { kind: 'colwise', input: 'prepared' },
        'layers.*.attn.v': { kind: 'colwise', input: 'prepared' },
        'layers.*.attn.attnDrop': 'localRng',
        'layers.*.attn.o': { kind: 'rowwise', output: act },
      } satisfies TpPlan);
      // Dense MLPs only: an MoE block's experts stay whole on every tp rank.
      const dense = [...has].filter((n) => /^layers\.\d+\.mlp\.gate$/.test(n)).map((n) => n.slice(0, -'.gate'.length));
      for (const mlp of dense) plan[mlp] = { kind: 'prepareInput', input: act };
      if (dense.length) {
        Object.assign(plan, {
          'layers.*.mlp.gate': { kind: 'colwise', input: 'prepared' },
          'layers.*.mlp.up': { kind: 'colwise', input: 'prepared' },
          'layers.*.mlp.down': { kind: 'rowwise', output: act },
        } satisfies TpPlan);
      }
      if (sp) for (const m of ['attnNorm', 'mlpNorm']) plan[`layers.*.${m}`] = 'sequenceParallel';
      if (has.has(`${[...has].find((n) => /^layers\.\d+$/.test(n))}.attn.qNorm`)) {
        for (const m of ['qNorm', 'kNorm']) plan[`layers.*.attn.${m}`] = 'sequenceParallel';
      }
    }
    if (has.has('head')) {
      if (sp) plan.norm = 'sequenceParallel';
      plan.head = opts.lossParallel ? { kind: 'lossParallel', input: act } : { kind: 'colwise', input: act, output: 'replicated' };
    }
    return plan;
  };
}

/** ZeRO-3 units of a Llama: each block, the embedding and the output head. */
export const llamaUnits: UnitPolicy = unitsByClass([LlamaBlock, Embedding], { paths: ['head', /\.head$/] });

/** The criterion: cross-entropy of logits (B, T, V), or of Llama.forward's output; summed over trained tokens by the layouts, as gptCriterion. */
export const llamaCriterion = Object.assign(
  (output: StageValue | { logits: Tensor }, target: StageValue, o?: { reduction?: 'mean' | 'sum' }): Tensor => {
    const logits = 'logits' in output ? (output as { logits: Tensor }).logits : (output as Tensor);
    return gptLoss(logits, target as Tensor, o);
  },
  { reduces: true },
);

/**
 * A Llama as a pipeline model: stage s of n is a LlamaStage; with tieEmbeddings the first stage's
 * wte.weight and the last stage's head copy are declared tied.
 */
export function llamaPipeline(cfg: Partial<LlamaConfig>, opts: { initSeed: number; costs?: PartCosts }): PipelineModel {
  const c = resolveLlamaConfig(cfg);
  return {
    stage: (index, numStages) => new LlamaStage(c, planStages(c, numStages, opts.costs)[index]!, { initSeed: opts.initSeed }),
    loss: llamaCriterion,
    tied: (n) => (c.tieEmbeddings && n > 1 ? [{ name: 'wte.weight', copies: [{ stage: 0, path: 'wte.weight' }, { stage: n - 1, path: 'head.weight' }] }] : []),
  };
}

/** The Llama as `[model] arch = "llama"` ([Note: model registry] in src/models/registry.ts). */
export const llamaSpec: ModelSpec<LlamaConfig> = {
  ...llamaRules,
  build: (m, opts) => new Llama(m, opts),
  pipeline: (m, opts) => llamaPipeline(m, opts),
  loss: llamaCriterion,
  units: llamaUnits,
  tensorPlan: (opts) => llamaTensorPlan(opts),
  hf: { ...llamaFamilyHf, configOf: (model) => (model instanceof Llama ? { ...model.cfg } : undefined) },
  hfFamilies: [mixtralHf, qwen3MoeHf].map((f) => ({ ...f, configOf: (model) => (model instanceof Llama ? { ...model.cfg } : undefined) })),
};
