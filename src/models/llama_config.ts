// The Llama's config and its derived fields, apart from the model's code: the config's validation
// (src/config), the launcher and the Hugging Face maps read them without loading the tensor library
// (the rules on its shapes: llama_rules.ts).
import { checkMoEConfig, isMoELayer, moeLayerParams, type MoEConfig } from '../nn/moe_config.js';

/**
 * The Hugging Face families the Llama's options cover (what `flotilla export --format hf` writes and
 * which config.json it reads: llama_family_hf.ts). A new family is one entry here and its format.
 */
export const llamaFamilies = ['llama', 'qwen2', 'qwen3', 'mistral'] as const;
export type LlamaFamily = (typeof llamaFamilies)[number];

/** Biases of the attention projections: none (Llama), on q, k and v (Qwen2), or on all four (attention_bias = true). */
export const llamaAttnBiases = ['none', 'qkv', 'all'] as const;
export type LlamaAttnBias = (typeof llamaAttnBiases)[number];

export interface LlamaConfig {
  /** The Hugging Face family it is exported as (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM). */
  family: LlamaFamily;
  vocabSize: number;
  /** Longest context (max_position_embeddings). */
  blockSize: number;
  nLayer: number;
  nHead: number;
  /** Key/value heads (grouped-query attention); 0 = nHead. */
  nKvHead: number;
  nEmbd: number;
  /** Width of one head; 0 = nEmbd / nHead. */
  headDim: number;
  /** SwiGLU hidden width; 0 = Llama's rule from nEmbd. */
  intermediateSize: number;
  rmsNormEps: number;
  ropeTheta: number;
  ropeScaling: 'none' | 'llama3';
  ropeFactor: number;
  ropeLowFreqFactor: number;
  ropeHighFreqFactor: number;
  ropeOriginalMaxPositions: number;
  /** On the attention probabilities only (transformers' attention_dropout). */
  dropout: number;
  tieEmbeddings: boolean;
  /** Biases of the attention projections. */
  attnBias: LlamaAttnBias;
  /** Qwen3's RMSNorm of each query and key head (weights of headDim, before rotary positions). */
  qkNorm: boolean;
  /**
   * Sliding-window attention (Mistral's sliding_window): query i reads key j only when
   * i - j < slidingWindow (positions within its document); 0 = full causal attention.
   */
  slidingWindow: number;
  /**
   * The first block (global index) with the sliding window; blocks below it attend with full causal
   * attention (Qwen's max_window_layers). 0 = every block windowed (Mistral, Mixtral).
   */
  windowFrom: number;
  /** Mixture of experts (the [moe] section): an MoE MLP every moe.every blocks when moe.experts > 0. */
  moe?: MoEConfig;
}

export const defaultLlamaConfig: LlamaConfig = {
  vocabSize: 256, blockSize: 128, nLayer: 4, nHead: 4, nKvHead: 0, nEmbd: 128, headDim: 0, intermediateSize: 0,
  rmsNormEps: 1e-5, ropeTheta: 10000, ropeScaling: 'none', ropeFactor: 8, ropeLowFreqFactor: 1, ropeHighFreqFactor: 4,
  ropeOriginalMaxPositions: 8192, dropout: 0, tieEmbeddings: false, family: 'llama', attnBias: 'none', qkNorm: false, slidingWindow: 0,
  windowFrom: 0,
};

/** Block `layer`'s (global index) sliding window: model.slidingWindow from block model.windowFrom on, else 0 (full causal). */
export function layerWindow(c: Pick<LlamaConfig, 'slidingWindow'> & { windowFrom?: number }, layer: number): number {
  return layer >= (c.windowFrom ?? 0) ? c.slidingWindow : 0;
}

/** Llama's MLP width for a model width: int(8/3 nEmbd) rounded up to a multiple of 64. */
export function llamaIntermediateSize(nEmbd: number): number {
  return Math.ceil(Math.floor((8 * nEmbd) / 3) / 64) * 64;
}

/** The config with its 0 = derived fields resolved; throws naming a field that cannot work. */
export function resolveLlamaConfig(cfg: Partial<LlamaConfig>): LlamaConfig {
  const given = Object.fromEntries(Object.entries(cfg).filter(([, v]) => v !== undefined)) as Partial<LlamaConfig>;
  const c = { ...defaultLlamaConfig, ...given };
  for (const k of ['vocabSize', 'blockSize', 'nLayer', 'nHead', 'nEmbd'] as const) {
    if (!Number.isInteger(c[k]) || c[k] <= 0) throw new Error(`Llama: ${k} must be a positive integer, got ${c[k]}`);
  }
  if (!Number.isInteger(c.slidingWindow) || c.slidingWindow < 0) throw new Error(`Llama: slidingWindow must be a whole number >= 0 (0 = full causal attention), got ${c.slidingWindow}`);
  if (!Number.isInteger(c.windowFrom) || c.windowFrom < 0 || c.windowFrom > c.nLayer) throw new Error(`Llama: windowFrom must be a whole number from 0 to nLayer (${c.nLayer}), got ${c.windowFrom}`);
  if (c.nKvHead === 0) c.nKvHead = c.nHead;
  if (c.headDim === 0) {
    if (c.nEmbd % c.nHead !== 0) throw new Error(`Llama: nEmbd (${c.nEmbd}) must be divisible by nHead (${c.nHead}), or set headDim`);
    c.headDim = c.nEmbd / c.nHead;
  }
  if (c.intermediateSize === 0) c.intermediateSize = llamaIntermediateSize(c.nEmbd);
  if (c.nHead % c.nKvHead !== 0) throw new Error(`Llama: nKvHead (${c.nKvHead}) must divide nHead (${c.nHead})`);
  if (c.headDim % 2 !== 0) throw new Error(`Llama: headDim (${c.headDim}) must be even (rotary embeddings rotate pairs)`);
  if (!llamaFamilies.includes(c.family)) throw new Error(`Llama: family ${JSON.stringify(c.family)} is not one of ${llamaFamilies.map((f) => JSON.stringify(f)).join(', ')}`);
  if (!llamaAttnBiases.includes(c.attnBias)) throw new Error(`Llama: attnBias ${JSON.stringify(c.attnBias)} is not one of ${llamaAttnBiases.map((f) => JSON.stringify(f)).join(', ')}`);
  const moe = checkMoEConfig(c.moe, c.nLayer);
  if (moe) c.moe = moe;
  else delete c.moe;
  return c;
}

/** Parameters of the whole Llama a config describes (a tied head counts once). */
export function llamaNumParams(cfg: Partial<LlamaConfig>): number {
  const c = resolveLlamaConfig(cfg);
  const C = c.nEmbd, A = c.nHead * c.headDim, KV = c.nKvHead * c.headDim;
  const mlp = 3 * C * c.intermediateSize;
  const bias = c.attnBias === 'none' ? 0 : A + 2 * KV + (c.attnBias === 'all' ? C : 0);
  const block = 2 * C + C * A + 2 * C * KV + A * C + mlp + bias + (c.qkNorm ? 2 * c.headDim : 0);
  let moe = 0;
  for (let i = 0; i < c.nLayer; i++) {
    if (isMoELayer(c.moe, i)) moe += moeLayerParams(c.moe!, C, 3 * C * (c.moe!.hidden || c.intermediateSize)) - mlp;
  }
  return c.vocabSize * C + c.nLayer * block + moe + C + (c.tieEmbeddings ? 0 : c.vocabSize * C);
}

/**
 * What the config's family cannot express (its Hugging Face class has no such model): empty, or
 * one message naming the fields to set. A Llama with experts is a Mixtral (family "llama", or
 * "mistral" with a sliding window) or a Qwen3-MoE (family "qwen3"): mixtral_hf.ts, qwen3_moe_hf.ts.
 */
export function llamaFamilyProblems(m: Pick<LlamaConfig, 'family' | 'attnBias' | 'qkNorm'> & { slidingWindow?: number; windowFrom?: number }): string[] {
  const where = `model.family = "${m.family}"`, got = `(got model.attnBias = "${m.attnBias}", model.qkNorm = ${m.qkNorm})`;
  const w = m.slidingWindow ?? 0, from = m.windowFrom ?? 0;
  // Mistral and Mixtral window every layer; Qwen2/Qwen3 (and Qwen3-MoE) from max_window_layers on.
  if (w > 0 && m.family === 'llama') return [`${where} has no sliding window: set model.family = "mistral" (MistralForCausalLM, or MixtralForCausalLM with [moe]), "qwen2" or "qwen3", or model.slidingWindow = 0 (got model.slidingWindow = ${w})`];
  if (w > 0 && from > 0 && m.family === 'mistral') return [`${where} windows every layer (sliding_window): set model.windowFrom = 0, or model.family = "qwen2" or "qwen3" (max_window_layers) (got model.windowFrom = ${from})`];
  switch (m.family) {
    case 'mistral':
      return m.attnBias !== 'none' || m.qkNorm ? [`${where} (MistralForCausalLM) has no attention biases and no q/k norms: set model.attnBias = "none" and model.qkNorm = false ${got}`] : [];
    case 'llama':
      // (transformers' attention_bias would give all four; flotilla's LlamaForCausalLM map has none.)
      return m.attnBias !== 'none' || m.qkNorm ? [`${where} (LlamaForCausalLM) has no attention biases and no q/k norms: set model.attnBias = "none" and model.qkNorm = false, or model.family = "qwen2" or "qwen3" ${got}`] : [];
    case 'qwen2':
      return m.attnBias !== 'qkv' || m.qkNorm ? [`${where} (Qwen2ForCausalLM) has biases on q, k and v and no q/k norms: set model.attnBias = "qkv" and model.qkNorm = false ${got}`] : [];
    case 'qwen3':
      return m.attnBias === 'qkv' || !m.qkNorm ? [`${where} (Qwen3ForCausalLM) has q/k norms and attention biases on all of q, k, v, o or none: set model.qkNorm = true and model.attnBias = "none" or "all" ${got}`] : [];
    default:
      return [];
  }
}
