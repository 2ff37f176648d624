// The Llama's parallel plans, next to the model as the GPT's are (gpt_parallel.ts): the pipeline
// split (the GPT's [Note: stage split]: embedding with the first stage, final norm and head with
// the last, blocks cut evenly), ZeRO-3 units, the tensor-parallel plan, and its registry spec.
import type { Tensor } from '../tensor/index.js';
import { Embedding, type Module } from '../nn/index.js';
import type { PipelineModel } from '../parallel/pipeline/model.js';
import type { StageValue } from '../parallel/parallel_model.js';
import { unitsByClass, type UnitPolicy } from '../parallel/fsdp.js';
import type { TpPlan } from '../parallel/tensor_parallel/styles.js';
import { gptLoss } from './gpt.js';
import { planStages, type PartCosts } from './gpt_parallel.js';
import { Llama, LlamaBlock, LlamaStage, llamaIntermediateSize, llamaNumParams, resolveLlamaConfig, type LlamaConfig } from './llama.js';
import type { ModelSpec } from './spec.js';
import { llamaHf } from './llama_hf.js';

/**
 * The Llama's tensor-parallel plan ([Note: tp styles]): q, k, v, gate and up column-parallel (each
 * rank holds nHead / tp query heads, nKvHead / tp key/value heads and intermediateSize / tp MLP
 * units), o and down row-parallel, the embedding vocab-parallel, the head column-parallel over the
 * vocabulary (or left sharded for the vocab-parallel loss). With sequence parallelism the RMSNorms
 * run on this rank's tokens: the embedding's lookup is reduce-scattered over tokens, and each
 * column-parallel projection gathers them. Given a part (a pipeline stage), only the modules it
 * holds are named.
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
        'layers.*.attn.q': { kind: 'colwise', input: act },
        'layers.*.attn.k': { kind: 'colwise', input: act },
        'layers.*.attn.v': { kind: 'colwise', input: act },
        'layers.*.attn.attnDrop': 'localRng',
        'layers.*.attn.o': { kind: 'rowwise', output: act },
        'layers.*.mlp.gate': { kind: 'colwise', input: act },
        'layers.*.mlp.up': { kind: 'colwise', input: act },
        'layers.*.mlp.down': { kind: 'rowwise', output: act },
      } satisfies TpPlan);
      if (sp) for (const m of ['attnNorm', 'mlpNorm']) plan[`layers.*.${m}`] = 'sequenceParallel';
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

/** The criterion: mean cross-entropy of logits (B, T, V), or of Llama.forward's output. */
export function llamaCriterion(output: StageValue | { logits: Tensor }, target: StageValue): Tensor {
  const logits = 'logits' in output ? (output as { logits: Tensor }).logits : (output as Tensor);
  return gptLoss(logits, target as Tensor);
}

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

/** Every problem of a Llama config under a layout, each naming the field and the fix. */
function llamaShapeProblems(m: LlamaConfig, ctx: Parameters<ModelSpec['shapeProblems']>[1]): string[] {
  const p: string[] = [];
  if (m.headDim === 0 && m.nEmbd % m.nHead !== 0) p.push(`model.nEmbd (${m.nEmbd}) must be divisible by model.nHead (${m.nHead}), or set model.headDim`);
  const nKv = m.nKvHead === 0 ? m.nHead : m.nKvHead;
  if (m.nHead % nKv !== 0) p.push(`model.nKvHead (${nKv}) must divide model.nHead (${m.nHead}) (grouped-query attention: 1 = multi-query, model.nHead = multi-head)`);
  const hd = m.headDim || (m.nEmbd % m.nHead === 0 ? m.nEmbd / m.nHead : 0);
  if (hd % 2 !== 0) p.push(`the head width (model.headDim, or model.nEmbd / model.nHead) = ${hd} must be even: rotary embeddings rotate pairs`);
  if (m.ropeScaling === 'llama3' && !(m.ropeHighFreqFactor > m.ropeLowFreqFactor)) {
    p.push(`model.ropeHighFreqFactor (${m.ropeHighFreqFactor}) must be above model.ropeLowFreqFactor (${m.ropeLowFreqFactor}) with model.ropeScaling = "llama3"`);
  }
  if (ctx.seqLen > m.blockSize) p.push(`data.seqLen (${ctx.seqLen}) must be <= model.blockSize (${m.blockSize}); lower data.seqLen or raise model.blockSize`);
  const stages = ctx.pp * ctx.ppVirtualStages;
  if (ctx.pp > 1 && m.nLayer < stages) {
    p.push(`parallel.pp x parallel.ppVirtualStages = ${stages} pipeline stages need model.nLayer >= ${stages} (got ${m.nLayer}); lower parallel.pp or ppVirtualStages, or raise model.nLayer`);
  }
  if (ctx.tp > 1) {
    // What the plan splits: query and key/value heads, the MLP width, the vocabulary (0 until the
    // tokenizer resolves it), and tokens under sequence parallelism.
    const I = m.intermediateSize || llamaIntermediateSize(m.nEmbd);
    const checks: [string, number][] = [
      ['model.nHead', m.nHead], ['model.nKvHead (key/value heads are split over tp)', nKv],
      [`model.intermediateSize (the MLP width${m.intermediateSize ? '' : ', derived from model.nEmbd'})`, I], ['model.vocabSize', m.vocabSize],
    ];
    if (ctx.sequenceParallel) checks.push(['data.seqLen (sequence parallelism shards tokens)', ctx.seqLen]);
    for (const [what, v] of checks) {
      if (v % ctx.tp !== 0) p.push(`${what} = ${v} does not divide by parallel.tp = ${ctx.tp}; choose a tp that divides it${what === 'model.vocabSize' ? ' (or pad the vocabulary: set model.vocabSize to a multiple of tp)' : ''}`);
    }
  }
  return p;
}

/** The Llama as `[model] arch = "llama"` ([Note: model registry] in src/models/registry.ts). */
export const llamaSpec: ModelSpec<LlamaConfig> = {
  arch: 'llama',
  describe: (m) => {
    const c = resolveLlamaConfig(m);
    return `Llama ${c.nLayer} layers, ${c.nHead} heads (${c.nKvHead} key/value) of ${c.headDim}, width ${c.nEmbd}, MLP ${c.intermediateSize}, context ${c.blockSize}` +
      (c.ropeScaling === 'llama3' ? `, rope theta ${c.ropeTheta} scaled (llama3, factor ${c.ropeFactor})` : `, rope theta ${c.ropeTheta}`) + (c.tieEmbeddings ? ', tied head' : '');
  },
  numParams: (m) => llamaNumParams(m),
  build: (m, opts) => new Llama(m, opts),
  pipeline: (m, opts) => llamaPipeline(m, opts),
  loss: llamaCriterion,
  units: llamaUnits,
  tensorPlan: (opts) => llamaTensorPlan(opts),
  shapeProblems: llamaShapeProblems,
  hf: llamaHf,
};
