// The GPT's parallel plan, kept next to the model as torchtitan keeps each model's: how a GPT is cut
// into pipeline stages (gptPipeline, planStages, measureGPTPartCosts) and which modules are its
// ZeRO-3 wrapping units (gptUnits). src/parallel knows no model; it takes these as data.
//
// [Note: stage split] The model is a sequence of parts: the embeddings, nLayer blocks, and the
// final norm + head. The embeddings always go with the first stage and the norm + head with the
// last. The blocks are cut into contiguous runs either evenly by count (earlier stages take the
// remainder) or, given a measured cost per part, so that the most expensive stage is as cheap as
// possible (the classic linear partition, solved exactly by dynamic programming). Every stage holds
// at least one block. Each rank builds only its stages' modules (GPTStage), never the whole model.
import { type Tensor, arange, randint, tidy } from '../tensor/index.js';
import { Block, Embedding, type Module } from '../nn/index.js';
import { evenSplitPoints, type PipelineModel } from '../parallel/pipeline/model.js';
import type { StageValue } from '../parallel/parallel_model.js';
import { unitsByClass, type UnitPolicy } from '../parallel/data_parallel/fsdp.js';
import type { TpPlan } from '../parallel/tensor_parallel/styles.js';
import { GPT, GPTStage, gptLoss, type GPTConfig, type GPTStageSpec } from './gpt.js';
import { gptRules } from './gpt_config.js';
import type { ModelSpec } from './spec.js';
import { gpt2Hf } from './gpt_hf.js';

/**
 * The GPT's tensor-parallel plan ([Note: tp styles] in src/parallel/tensor_parallel/styles.ts), as
 * Megatron cuts a transformer: attention's fused q, k, v projection and the MLP's first Linear
 * column-parallel (each rank holds nHead / tp heads and 4 nEmbd / tp hidden units), the two output
 * projections row-parallel, the token embedding vocab-parallel, the head column-parallel over the
 * vocabulary. With sequence parallelism the LayerNorms and dropouts between them run on this rank's
 * tokens: the embeddings' sum is split over tokens at `drop`, and the head gathers them back. Given
 * a part (a pipeline stage), only the modules it holds are named.
 */
export function gptTensorPlan(opts: { sequenceParallel?: boolean; lossParallel?: boolean } = {}): (part: Module) => TpPlan {
  const sp = opts.sequenceParallel ?? false;
  const act = sp ? 'sequenceSharded' : 'replicated';
  return (part) => {
    const has = new Set(part.namedModules().map(([n]) => n));
    const plan: TpPlan = {};
    if (has.has('wte')) {
      plan.wte = { kind: 'vocabEmbedding' };
      if (sp) plan.drop = { kind: 'sequenceParallel', input: 'replicated' };
    }
    if (part.namedModules().some(([n]) => /^layers\.\d+$/.test(n))) {
      Object.assign(plan, {
        'layers.*.attn.qkv': { kind: 'colwise', input: act, chunks: 3 },
        'layers.*.attn.attnDrop': 'localRng',
        'layers.*.attn.proj': { kind: 'rowwise', output: act },
      } satisfies TpPlan);
      // Dense MLPs only: an MoE block's experts stay whole on every tp rank.
      const dense = [...has].some((n) => /^layers\.\d+\.mlp\.fc$/.test(n));
      if (dense) {
        Object.assign(plan, {
          'layers.*.mlp.fc': { kind: 'colwise', input: act },
          'layers.*.mlp.proj': { kind: 'rowwise', output: act },
        } satisfies TpPlan);
      }
      if (sp) for (const m of ['ln1', 'ln2', 'attn.residDrop', ...(dense ? ['mlp.drop'] : [])]) plan[`layers.*.${m}`] = 'sequenceParallel';
    }
    if (has.has('head')) {
      if (sp) plan.lnF = 'sequenceParallel';
      plan.head = opts.lossParallel ? { kind: 'lossParallel', input: act } : { kind: 'colwise', input: act, output: 'replicated' };
    }
    return plan;
  };
}

/** ZeRO-3 units of a GPT: each transformer block, each embedding and the output head. */
export const gptUnits: UnitPolicy = unitsByClass([Block, Embedding], { paths: ['head', /\.head$/] });

/**
 * The GPT's loss as a pipeline's (and a data-parallel plan's) criterion: logits (B, T, V) or
 * GPT.forward's output. It `reduces`: the layouts take the sum over trained tokens and divide by
 * the global batch's ([Note: global loss reduction] in src/parallel/loss_reduction.ts).
 */
export const gptCriterion = Object.assign(
  (output: StageValue | { logits: Tensor }, target: StageValue, o?: { reduction?: 'mean' | 'sum' }): Tensor => {
    const logits = 'logits' in output ? (output as { logits: Tensor }).logits : (output as Tensor);
    return gptLoss(logits, target as Tensor, o);
  },
  { reduces: true },
);

export interface GPTPipelineOptions {
  /** Per-parameter init seed (GPTBuildOptions.initSeed): any split gets the whole model's weights. */
  initSeed: number;
  /** Measured cost per part (embeddings, blocks, head) to split by; default: even by block count. */
  costs?: PartCosts;
}

/**
 * A GPT as a pipeline model: stage s of n is a GPTStage (see [Note: stage split]); with
 * tieEmbeddings the first stage's wte.weight and the last stage's head copy are declared tied.
 */
export function gptPipeline(cfg: GPTConfig, opts: GPTPipelineOptions): PipelineModel {
  let specs: { n: number; specs: GPTStageSpec[] } | undefined;
  return {
    stage(index, numStages) {
      if (specs?.n !== numStages) specs = { n: numStages, specs: planStages(cfg, numStages, opts.costs) };
      return new GPTStage(cfg, specs.specs[index]!, { initSeed: opts.initSeed });
    },
    loss: gptCriterion,
    tied: (n) => (cfg.tieEmbeddings && n > 1 ? [{ name: 'wte.weight', copies: [{ stage: 0, path: 'wte.weight' }, { stage: n - 1, path: 'head.weight' }] }] : []),
  };
}

/**
 * The GPT's parts in order, for cost-based splitting: costs[0] the embeddings, costs[1..nLayer]
 * the blocks, costs[nLayer + 1] the final norm + head.
 */
export type PartCosts = readonly number[];

/** The stage specs of a numStages-way split (see [Note: stage split]). */
export function planStages(cfg: Pick<GPTConfig, 'nLayer'>, numStages: number, costs?: PartCosts): GPTStageSpec[] {
  const L = cfg.nLayer;
  if (!Number.isInteger(numStages) || numStages < 1) throw new Error(`pipeline: the number of stages must be a positive integer, got ${numStages}`);
  if (L < numStages) {
    throw new Error(
      `pipeline: ${numStages} stages need at least ${numStages} blocks, the model has nLayer=${L}; ` +
        'lower parallel.pp (or parallel.ppVirtualStages), or give the model more layers',
    );
  }
  let bounds: number[]; // block index where each stage starts, plus L
  if (costs === undefined) {
    bounds = [0, ...evenSplitPoints(L, numStages), L];
  } else {
    if (costs.length !== L + 2 || costs.some((c) => !(c >= 0) || !Number.isFinite(c))) {
      throw new Error(`pipeline: costs must hold ${L + 2} finite non-negative numbers (embeddings, ${L} blocks, head), got ${costs.length}`);
    }
    bounds = partitionBlocks(costs, L, numStages);
  }
  return Array.from({ length: numStages }, (_, s) => ({
    layers: [bounds[s]!, bounds[s + 1]!] as const,
    embed: s === 0,
    head: s === numStages - 1,
  }));
}

/**
 * Measures the GPT's part costs for planStages on this process: forward + backward time (ms,
 * median of `repeats`) of the embeddings, of one block (every block costs the same) and of the
 * final norm + head + loss, on a (batch, seqLen) input. Builds one block, never the whole model.
 */
export function measureGPTPartCosts(cfg: GPTConfig, opts: { batch: number; seqLen: number; repeats?: number }): number[] {
  const one = new GPTStage({ ...cfg, nLayer: Math.max(1, cfg.nLayer) }, { layers: [0, 1], embed: true, head: true }, { initSeed: 0 });
  const repeats = opts.repeats ?? 3;
  const times = { embed: [] as number[], block: [] as number[], head: [] as number[] };
  try {
    for (let r = 0; r < repeats; r++) {
      tidy(() => {
        const idx = randint(0, cfg.vocabSize, [opts.batch, opts.seqLen]);
        const timed = (fn: () => void): number => {
          const t0 = performance.now();
          fn();
          return performance.now() - t0;
        };
        // Each part on a detached input, so its backward stops at its own boundary.
        let h!: Tensor;
        times.embed.push(timed(() => {
          const e = one.wte!.call(idx).add(one.wpe!.call(arange(0, opts.seqLen)));
          e.sum().backward();
          h = e.detach().requiresGrad_(true);
        }));
        let out!: Tensor;
        times.block.push(timed(() => {
          const y = one.layers.items[0]!.call(h);
          y.sum().backward();
          out = y.detach().requiresGrad_(true);
        }));
        times.head.push(timed(() => {
          gptLoss(one.head!.call(one.lnF!.call(out)), idx).backward();
        }));
      });
    }
  } finally {
    one.dispose();
  }
  const med = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
  return [med(times.embed), ...new Array<number>(cfg.nLayer).fill(med(times.block)), med(times.head)];
}

/**
 * Cuts blocks 0..L-1 into k non-empty contiguous runs minimising the largest stage cost, where
 * stage 0 also pays costs[0] (embeddings) and stage k-1 pays costs[L+1] (head).
 */
function partitionBlocks(costs: PartCosts, L: number, k: number): number[] {
  const prefix = [0];
  for (let i = 0; i < L; i++) prefix.push(prefix[i]! + costs[i + 1]!);
  const cost = (s: number, a: number, b: number): number =>
    prefix[b]! - prefix[a]! + (s === 0 ? costs[0]! : 0) + (s === k - 1 ? costs[L + 1]! : 0);
  // best[s][b]: the smallest max-cost of stages 0..s covering blocks [0, b); cut[s][b]: where stage s starts.
  const best = Array.from({ length: k }, () => new Array<number>(L + 1).fill(Infinity));
  const cut = Array.from({ length: k }, () => new Array<number>(L + 1).fill(-1));
  for (let b = 1; b <= L; b++) best[0]![b] = cost(0, 0, b);
  for (let s = 1; s < k; s++) {
    for (let b = s + 1; b <= L; b++) {
      for (let a = s; a < b; a++) {
        const v = Math.max(best[s - 1]![a]!, cost(s, a, b));
        if (v < best[s]![b]!) [best[s]![b], cut[s]![b]] = [v, a];
      }
    }
  }
  const bounds = new Array<number>(k + 1);
  bounds[k] = L;
  for (let s = k - 1; s >= 1; s--) bounds[s] = cut[s]![bounds[s + 1]!]!;
  bounds[0] = 0;
  return bounds;
}

/** The GPT as `[model] arch = "gpt"` ([Note: model registry] in src/models/registry.ts). */
export const gptSpec: ModelSpec<GPTConfig> = {
  ...gptRules,
  build: (m, opts) => new GPT({ ...m }, opts),
  pipeline: (m, opts) => gptPipeline({ ...m }, opts),
  loss: gptCriterion,
  units: gptUnits,
  tensorPlan: (opts) => gptTensorPlan(opts),
  hf: { ...gpt2Hf, configOf: (model) => (model instanceof GPT ? { ...model.cfg } : undefined) },
};
