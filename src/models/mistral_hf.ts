// Mistral as transformers' MistralForCausalLM: the Llama with a sliding attention window
// (model.slidingWindow; sliding_window null = full causal attention) and Mistral's config defaults.
// Its tensors are the Llama's, under the same names, so the map is llama_hf.ts's; model.family =
// "mistral" writes this class (llama_family_hf.ts).
import { llamaFamilyProblems, resolveLlamaConfig, type LlamaConfig } from './llama_config.js';
import { llamaHf } from './llama_hf.js';
import type { HfMap } from './spec.js';

/** transformers' MistralConfig defaults (Mistral 7B), for the fields a config.json leaves out. */
const MISTRAL_DEFAULTS: Record<string, unknown> = {
  vocab_size: 32000, hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: 32, num_attention_heads: 32,
  num_key_value_heads: 8, max_position_embeddings: 4096 * 32, rms_norm_eps: 1e-6, rope_theta: 10000, sliding_window: 4096,
  tie_word_embeddings: false,
};

/** config.json's sliding_window as model.slidingWindow: null = 0 (full causal attention). */
function slidingWindow(hf: Record<string, unknown>): number {
  const w = hf.sliding_window === undefined ? MISTRAL_DEFAULTS.sliding_window : hf.sliding_window;
  if (w === null) return 0;
  if (typeof w !== 'number' || !Number.isInteger(w) || w <= 0) throw new Error(`config.json: sliding_window = ${JSON.stringify(w)} is not a positive integer or null (null = full causal attention)`);
  return w;
}

export const mistralHf: HfMap<LlamaConfig> = {
  architecture: 'MistralForCausalLM',
  modelType: 'mistral',

  fromConfig(hf) {
    // MistralConfig: an absent num_key_value_heads is 8, a null one the number of query heads.
    const filled: Record<string, unknown> = { ...MISTRAL_DEFAULTS, ...Object.fromEntries(Object.entries(hf).filter(([, v]) => v !== undefined)) };
    if (filled.num_key_value_heads === null) filled.num_key_value_heads = filled.num_attention_heads;
    return { ...llamaHf.fromConfig(filled), family: 'mistral', attnBias: 'none', qkNorm: false, slidingWindow: slidingWindow(hf) };
  },

  toConfig(cfg) {
    const c = resolveLlamaConfig(cfg);
    const [problem] = llamaFamilyProblems(c);
    if (problem) throw new Error(problem);
    if (c.ropeScaling !== 'none') throw new Error(`MistralForCausalLM has no rope_scaling; a model with model.slidingWindow = ${c.slidingWindow} and model.ropeScaling = "${c.ropeScaling}" has no Hugging Face form (set model.ropeScaling = "none")`);
    const { attention_bias: _a, mlp_bias: _m, pretraining_tp: _p, rope_scaling: _r, ...shared } = llamaHf.toConfig(cfg);
    return { ...shared, architectures: ['MistralForCausalLM'], model_type: 'mistral', sliding_window: c.slidingWindow > 0 ? c.slidingWindow : null };
  },

  tensors: (cfg) => llamaHf.tensors(cfg),
  ignored: llamaHf.ignored,
  resolve: (cfg) => resolveLlamaConfig(cfg),
};
