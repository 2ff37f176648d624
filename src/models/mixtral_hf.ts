// Mixtral as transformers' MixtralForCausalLM: the Llama with an [moe] section in every block and
// Mistral's sliding window when sliding_window is set (model.family = "mistral"). The attention,
// norms and head are the Llama's (llama_hf.ts); each block's MLP is a router
// (block_sparse_moe.gate, a bias-free Linear (experts, hidden)) whose softmax picks the top
// num_experts_per_tok experts, their probabilities renormalised to sum 1 (moe.normTopK), over
// SwiGLU experts w1 (gate), w3 (up), w2 (down), each its own (out, in) Linear. flotilla holds a
// block's experts as grouped stacks (experts, in, out), so each stored Linear is one transposed
// slice of a stack (HfTensor.stack). Routing is dropless (moe.capacityFactor = 0), with no shared
// experts and no selection bias.
import { defaultMoEConfig, type MoEConfig } from '../nn/moe_config.js';
import { llamaFamilyProblems, resolveLlamaConfig, type LlamaConfig } from './llama_config.js';
import { llamaHf } from './llama_hf.js';
import { hfInt, hfRequire } from './gpt_hf.js';
import type { HfMap, HfTensor } from './spec.js';
import { expertTensors, type ExpertNames } from './moe_hf.js';

/** Mixtral's names: block_sparse_moe.gate, experts.j.w1 (gate), w3 (up), w2 (down). */
const MIXTRAL_EXPERTS: ExpertNames = { router: 'gate.weight', gate: (j) => `experts.${j}.w1.weight`, up: (j) => `experts.${j}.w3.weight`, down: (j) => `experts.${j}.w2.weight` };

/** transformers' MixtralConfig defaults, for the fields a config.json leaves out. */
const MIXTRAL_DEFAULTS = {
  vocab_size: 32000, hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: 32, num_attention_heads: 32,
  num_key_value_heads: 8, max_position_embeddings: 4096 * 32, rms_norm_eps: 1e-5, rope_theta: 1e6, tie_word_embeddings: false,
  num_local_experts: 8, num_experts_per_tok: 2,
} as const;

/** The [moe] fields a Mixtral's routing fixes (the balance settings stay the run's). */
function mixtralMoE(experts: number, topK: number): Partial<MoEConfig> {
  return { experts, topK, every: 1, sharedExperts: 0, hidden: 0, router: 'softmax', normTopK: true, capacityFactor: 0 };
}

export const mixtralHf: HfMap<LlamaConfig> = {
  architecture: 'MixtralForCausalLM',
  modelType: 'mixtral',

  fromConfig(hf) {
    const d = MIXTRAL_DEFAULTS;
    // Jitter multiplies the router's input by noise in training only; flotilla routes without it.
    hfRequire(hf, 'router_jitter_noise', 0, [0], 'flotilla\'s router has no input jitter (router_jitter_noise 0)');
    const experts = hfInt(hf, 'num_local_experts', d.num_local_experts), topK = hfInt(hf, 'num_experts_per_tok', d.num_experts_per_tok);
    if (topK > experts) throw new Error(`config.json: num_experts_per_tok = ${topK} is above num_local_experts = ${experts}`);
    // output_router_logits and router_aux_loss_coef only add the balance loss in training; the run's
    // moe.balance and moe.auxCoeff decide that, so they are not read.
    const base = llamaHf.fromConfig({ ...d, ...hf, attention_bias: false, mlp_bias: false });
    // transformers' MixtralConfig: sliding_window null (its default) = full causal attention, else
    // every layer's window (Mistral's attention: model.family = "mistral").
    const w = hf.sliding_window ?? null;
    if (w !== null && (typeof w !== 'number' || !Number.isInteger(w) || w <= 0)) throw new Error(`config.json: sliding_window = ${JSON.stringify(w)} is not a positive integer or null (null = full causal attention)`);
    const window = w === null ? { family: 'llama' as const, slidingWindow: 0 } : { family: 'mistral' as const, slidingWindow: w };
    return { ...base, ...window, windowFrom: 0, attnBias: 'none', qkNorm: false, moe: mixtralMoE(experts, topK) };
  },

  toConfig(cfg) {
    const c = resolveLlamaConfig(cfg);
    const [problem] = llamaFamilyProblems(c);
    if (problem) throw new Error(problem);
    const m = c.moe!;
    const { attention_bias: _a, mlp_bias: _m, pretraining_tp: _p, ...llama } = llamaHf.toConfig({ ...c, moe: undefined });
    return {
      ...llama, architectures: ['MixtralForCausalLM'], model_type: 'mixtral', intermediate_size: m.hidden || c.intermediateSize,
      num_local_experts: m.experts, num_experts_per_tok: m.topK, output_router_logits: false,
      router_aux_loss_coef: m.balance === 'aux' ? m.auxCoeff : 0, router_jitter_noise: 0, sliding_window: c.slidingWindow > 0 ? c.slidingWindow : null,
    };
  },

  tensors(cfg) {
    const c = resolveLlamaConfig(cfg);
    const E = c.moe?.experts ?? 0, C = c.nEmbd, H = c.moe?.hidden || c.intermediateSize;
    const out: HfTensor[] = [];
    for (const t of llamaHf.tensors({ ...c, moe: undefined })) {
      if (/\.mlp\./.test(t.name)) continue;
      out.push(t);
      const layer = /^layers\.(\d+)\.mlpNorm\.weight$/.exec(t.name)?.[1];
      if (layer === undefined) continue;
      out.push(...expertTensors(layer, `model.layers.${layer}.block_sparse_moe.`, MIXTRAL_EXPERTS, E, C, H));
    }
    return out;
  },

  ignored: llamaHf.ignored!,

  misfit(cfg) {
    const c = resolveLlamaConfig(cfg);
    if ((c.family !== 'llama' && c.family !== 'mistral') || llamaFamilyProblems(c).length > 0) return 'its attention is the Llama\'s or Mistral\'s (model.family = "llama", or "mistral" with model.slidingWindow and windowFrom = 0; attnBias = "none", qkNorm = false)';
    const m = cfg.moe;
    if (!m || m.experts === 0) return 'it has experts in every block (moe.experts > 0)';
    const want = { ...defaultMoEConfig, ...mixtralMoE(m.experts, m.topK), hidden: m.hidden };
    const off = (['every', 'sharedExperts', 'router', 'normTopK', 'capacityFactor'] as const).filter((k) => m[k] !== want[k]);
    if (m.balance === 'bias') return 'its router has no selection bias (moe.balance = "aux")';
    if ((m.denseLayers ?? []).length > 0) return 'it has experts in every block (moe.denseLayers = [])';
    return off.length > 0 ? `its routing needs ${off.map((k) => `moe.${k} = ${JSON.stringify(want[k])}`).join(', ')}` : undefined;
  },

  resolve: (cfg) => resolveLlamaConfig(cfg),
};
