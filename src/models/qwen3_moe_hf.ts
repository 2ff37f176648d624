// Qwen3-MoE as transformers' Qwen3MoeForCausalLM: Qwen3's attention (q/k norms of head_dim, biases on
// all four projections only with attention_bias; qwen_hf.ts) with a mixture of experts as the MLP of
// block i when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (transformers'
// Qwen3MoeDecoderLayer) -- flotilla's moe.denseLayers and moe.every (moe_config.ts isMoELayer) --
// and a dense SwiGLU MLP of intermediate_size elsewhere. An MoE MLP is a router
// (mlp.gate, a bias-free Linear (experts, hidden)) whose softmax picks the top num_experts_per_tok
// experts, renormalised to sum 1 only with norm_topk_prob (moe.normTopK), over SwiGLU experts of
// moe_intermediate_size (moe.hidden): gate_proj, up_proj, down_proj, each its own (out, in) Linear,
// held by flotilla as one transposed slice of a grouped stack (HfTensor.stack). No shared experts,
// dropless routing (moe.capacityFactor = 0), no selection bias.
import { defaultMoEConfig, isMoELayer, moeLayers, type MoEConfig } from '../nn/moe_config.js';
import { llamaFamilyProblems, resolveLlamaConfig, type LlamaConfig } from './llama_config.js';
import { qwen3Hf } from './qwen_hf.js';
import { hfInt } from './gpt_hf.js';
import type { HfMap, HfTensor } from './spec.js';
import { expertTensors, type ExpertNames } from './moe_hf.js';

/** Qwen3-MoE's names: mlp.gate, mlp.experts.j.{gate,up,down}_proj. */
const QWEN3_MOE_EXPERTS: ExpertNames = { router: 'gate.weight', gate: (j) => `experts.${j}.gate_proj.weight`, up: (j) => `experts.${j}.up_proj.weight`, down: (j) => `experts.${j}.down_proj.weight` };

/** transformers' Qwen3MoeConfig defaults, for the fields a config.json leaves out (head_dim: see fromConfig). */
const QWEN3_MOE_DEFAULTS = {
  vocab_size: 151936, hidden_size: 2048, intermediate_size: 6144, num_hidden_layers: 24, num_attention_heads: 32,
  num_key_value_heads: 4, max_position_embeddings: 32768, rms_norm_eps: 1e-6, rope_theta: 10000, tie_word_embeddings: false,
  num_experts: 128, num_experts_per_tok: 8, decoder_sparse_step: 1, moe_intermediate_size: 768, norm_topk_prob: false,
} as const;

/** The [moe] fields a Qwen3-MoE's routing fixes (the balance settings stay the run's). */
function qwen3MoE(experts: number, topK: number, every: number, denseLayers: number[], hidden: number, normTopK: boolean): Partial<MoEConfig> {
  return { experts, topK, every, denseLayers, sharedExperts: 0, hidden, router: 'softmax', normTopK, capacityFactor: 0 };
}

export const qwen3MoeHf: HfMap<LlamaConfig> = {
  architecture: 'Qwen3MoeForCausalLM',
  modelType: 'qwen3_moe',

  fromConfig(hf) {
    const given = Object.fromEntries(Object.entries(hf).filter(([, v]) => v !== undefined && v !== null));
    const all: Record<string, unknown> = { ...QWEN3_MOE_DEFAULTS, ...given };
    const nLayer = hfInt(all, 'num_hidden_layers');
    // Dense layers listed by index among the sparse ones (Qwen3MoeConfig: None = []).
    const only = hf.mlp_only_layers ?? [];
    if (!Array.isArray(only) || only.some((i) => typeof i !== 'number' || !Number.isInteger(i) || i < 0 || i >= nLayer)) {
      throw new Error(`config.json: mlp_only_layers = ${JSON.stringify(only)} is not a list of layer indices from 0 to num_hidden_layers - 1 (${nLayer - 1})`);
    }
    const nEmbd = hfInt(all, 'hidden_size'), nHead = hfInt(all, 'num_attention_heads');
    // transformers' Qwen3MoeConfig has no head_dim parameter (unlike Qwen3Config's default of 128):
    // Qwen3MoeAttention reads config.head_dim when config.json has one, else hidden_size //
    // num_attention_heads.
    if (given.head_dim === undefined) all.head_dim = Math.floor(nEmbd / nHead);
    const experts = hfInt(all, 'num_experts'), topK = hfInt(all, 'num_experts_per_tok');
    if (topK > experts) throw new Error(`config.json: num_experts_per_tok = ${topK} is above num_experts = ${experts}`);
    const every = hfInt(all, 'decoder_sparse_step'), hidden = hfInt(all, 'moe_intermediate_size');
    const norm = all.norm_topk_prob;
    if (typeof norm !== 'boolean') throw new Error(`config.json: norm_topk_prob = ${JSON.stringify(norm)} is not true or false`);
    // output_router_logits and router_aux_loss_coef only add the balance loss in training; the run's
    // moe.balance and moe.auxCoeff decide that, so they are not read.
    const { num_experts: _e, num_experts_per_tok: _k, decoder_sparse_step: _s, moe_intermediate_size: _h, norm_topk_prob: _n, ...dense } = all;
    const { mlp_only_layers: _o, ...attention } = dense;
    const base = qwen3Hf.fromConfig({ ...attention, rope_scaling: hf.rope_scaling ?? null });
    if (every > nLayer) throw new Error(`config.json: decoder_sparse_step = ${every} is above num_hidden_layers = ${nLayer}, so no layer has experts; flotilla reads a Qwen3-MoE with experts in some layer`);
    const moe = qwen3MoE(experts, topK, every, [...new Set(only as number[])].sort((a, b) => a - b), hidden, norm);
    if (moeLayers({ ...defaultMoEConfig, ...moe }, nLayer).length === 0) throw new Error(`config.json: mlp_only_layers = ${JSON.stringify(only)} leaves no layer with experts; flotilla reads a Qwen3-MoE with experts in some layer`);
    return { ...base, moe };
  },

  toConfig(cfg) {
    const c = resolveLlamaConfig(cfg);
    const m = c.moe!;
    const { architectures: _r, model_type: _t, ...common } = qwen3Hf.toConfig({ ...c, moe: undefined });
    return {
      architectures: ['Qwen3MoeForCausalLM'], model_type: 'qwen3_moe', ...common,
      num_experts: m.experts, num_experts_per_tok: m.topK, decoder_sparse_step: m.every, moe_intermediate_size: m.hidden || c.intermediateSize,
      norm_topk_prob: m.normTopK, mlp_only_layers: [...m.denseLayers], output_router_logits: false, router_aux_loss_coef: m.balance === 'aux' ? m.auxCoeff : 0,
    };
  },

  tensors(cfg) {
    const c = resolveLlamaConfig(cfg);
    const E = c.moe?.experts ?? 0, C = c.nEmbd, H = c.moe?.hidden || c.intermediateSize;
    const out: HfTensor[] = [];
    for (const t of qwen3Hf.tensors({ ...c, moe: undefined })) {
      const layer = Number(/^layers\.(\d+)\./.exec(t.name)?.[1] ?? -1);
      const sparse = layer >= 0 && isMoELayer(c.moe, layer);
      if (sparse && /\.mlp\./.test(t.name)) continue;
      out.push(t);
      if (!sparse || !t.name.endsWith('.mlpNorm.weight')) continue;
      out.push(...expertTensors(layer, `model.layers.${layer}.mlp.`, QWEN3_MOE_EXPERTS, E, C, H));
    }
    return out;
  },

  ignored: qwen3Hf.ignored!,

  misfit(cfg) {
    const c = resolveLlamaConfig(cfg);
    if (c.family !== 'qwen3' || llamaFamilyProblems(c).length > 0) return 'its attention is Qwen3\'s (model.family = "qwen3", qkNorm = true, attnBias = "none" or "all")';
    const m = cfg.moe;
    if (!m || m.experts === 0) return 'it has experts (moe.experts > 0)';
    const want = { ...defaultMoEConfig, ...qwen3MoE(m.experts, m.topK, m.every, m.denseLayers, m.hidden, m.normTopK) };
    const off = (['sharedExperts', 'router', 'capacityFactor'] as const).filter((k) => m[k] !== want[k]);
    if (m.balance === 'bias') return 'its router has no selection bias (moe.balance = "aux")';
    return off.length > 0 ? `its routing needs ${off.map((k) => `moe.${k} = ${JSON.stringify(want[k])}`).join(', ')}` : undefined;
  },

  resolve: (cfg) => resolveLlamaConfig(cfg),
};
