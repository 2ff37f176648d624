// The Llama as transformers' LlamaForCausalLM (Llama 2, 3, 3.1, 3.2): the config map and the tensor
// name map (src/checkpoint/hf.ts reads and writes the directories). The model already computes
// rotary positions in transformers' rotate-half convention, so q_proj and k_proj load as stored,
// with no permutation, and every Linear is (out, in) on both sides.
import { resolveLlamaConfig, type LlamaConfig } from './llama_config.js';
import { hfInt, hfRequire } from './gpt_hf.js';
import type { HfMap, HfTensor } from './spec.js';

/** transformers' LlamaConfig defaults, for the fields a config.json leaves out. */
const LLAMA_DEFAULTS = {
  vocab_size: 32000, hidden_size: 4096, intermediate_size: 11008, num_hidden_layers: 32, num_attention_heads: 32,
  max_position_embeddings: 2048, rms_norm_eps: 1e-6, rope_theta: 10000, tie_word_embeddings: false,
} as const;

/** A positive number field of config.json. */
function hfNumber(hf: Record<string, unknown>, field: string, dflt: number): number {
  const v = hf[field] ?? dflt;
  if (typeof v !== 'number' || !(v > 0) || !Number.isFinite(v)) throw new Error(`config.json: ${field} = ${JSON.stringify(v)} is not a positive number`);
  return v;
}

/** The rotary scaling fields of config.json's rope_scaling (null, "default" or "llama3"). */
function ropeScaling(hf: Record<string, unknown>): Record<string, unknown> {
  const rs = hf.rope_scaling ?? null;
  if (rs === null) return { ropeScaling: 'none' };
  if (typeof rs !== 'object' || Array.isArray(rs)) throw new Error(`config.json: rope_scaling = ${JSON.stringify(rs)} is not an object or null`);
  const r = rs as Record<string, unknown>;
  const type = r.rope_type ?? r.type;
  if (type === 'default') return { ropeScaling: 'none' };
  if (type !== 'llama3') {
    throw new Error(`config.json: rope_scaling.rope_type = ${JSON.stringify(type)} is not supported; flotilla reads rope_scaling null, of type "default", or of type "llama3" (Llama 3.1)`);
  }
  const num = (f: string): number => {
    const v = r[f];
    if (typeof v !== 'number' || !(v > 0) || !Number.isFinite(v)) throw new Error(`config.json: rope_scaling.${f} = ${JSON.stringify(v)} is not a positive number (rope_type "llama3" needs it)`);
    return v;
  };
  const orig = num('original_max_position_embeddings');
  if (!Number.isInteger(orig)) throw new Error(`config.json: rope_scaling.original_max_position_embeddings = ${orig} is not a whole number`);
  const lo = num('low_freq_factor'), hi = num('high_freq_factor');
  if (!(hi > lo)) throw new Error(`config.json: rope_scaling.high_freq_factor (${hi}) must be above low_freq_factor (${lo})`);
  return { ropeScaling: 'llama3', ropeFactor: num('factor'), ropeLowFreqFactor: lo, ropeHighFreqFactor: hi, ropeOriginalMaxPositions: orig };
}

export const llamaHf: HfMap<LlamaConfig> = {
  architecture: 'LlamaForCausalLM',
  modelType: 'llama',

  fromConfig(hf) {
    const d = LLAMA_DEFAULTS;
    const nEmbd = hfInt(hf, 'hidden_size', d.hidden_size), nHead = hfInt(hf, 'num_attention_heads', d.num_attention_heads);
    const nKvHead = hfInt(hf, 'num_key_value_heads', nHead);
    if (nHead % nKvHead !== 0) throw new Error(`config.json: num_key_value_heads = ${nKvHead} does not divide num_attention_heads = ${nHead}`);
    if (hf.head_dim === undefined || hf.head_dim === null) {
      if (nEmbd % nHead !== 0) throw new Error(`config.json: hidden_size = ${nEmbd} does not divide by num_attention_heads = ${nHead}, and there is no head_dim`);
    }
    const headDim = hfInt(hf, 'head_dim', nEmbd / nHead);
    if (headDim % 2 !== 0) throw new Error(`config.json: head_dim = ${headDim} is odd; rotary positions rotate pairs`);
    hfRequire(hf, 'hidden_act', 'silu', ['silu'], 'the Llama\'s MLP is SwiGLU (hidden_act "silu")');
    hfRequire(hf, 'attention_bias', false, [false], 'the Llama\'s attention projections have no biases');
    hfRequire(hf, 'mlp_bias', false, [false], 'the Llama\'s MLP has no biases');
    const tie = hf.tie_word_embeddings ?? d.tie_word_embeddings;
    if (typeof tie !== 'boolean') throw new Error(`config.json: tie_word_embeddings = ${JSON.stringify(tie)} is not true or false`);
    return {
      arch: 'llama', vocabSize: hfInt(hf, 'vocab_size', d.vocab_size), blockSize: hfInt(hf, 'max_position_embeddings', d.max_position_embeddings),
      nLayer: hfInt(hf, 'num_hidden_layers', d.num_hidden_layers), nHead, nKvHead, nEmbd, headDim,
      intermediateSize: hfInt(hf, 'intermediate_size', d.intermediate_size),
      rmsNormEps: hfNumber(hf, 'rms_norm_eps', d.rms_norm_eps), ropeTheta: hfNumber(hf, 'rope_theta', d.rope_theta),
      ...ropeScaling(hf), tieEmbeddings: tie,
    };
  },

  toConfig(cfg) {
    const c = resolveLlamaConfig(cfg);
    return {
      architectures: ['LlamaForCausalLM'], model_type: 'llama',
      vocab_size: c.vocabSize, hidden_size: c.nEmbd, intermediate_size: c.intermediateSize, num_hidden_layers: c.nLayer,
      num_attention_heads: c.nHead, num_key_value_heads: c.nKvHead, head_dim: c.headDim, max_position_embeddings: c.blockSize,
      hidden_act: 'silu', rms_norm_eps: c.rmsNormEps, rope_theta: c.ropeTheta,
      rope_scaling: c.ropeScaling === 'llama3'
        ? { rope_type: 'llama3', factor: c.ropeFactor, low_freq_factor: c.ropeLowFreqFactor, high_freq_factor: c.ropeHighFreqFactor, original_max_position_embeddings: c.ropeOriginalMaxPositions }
        : null,
      attention_bias: false, attention_dropout: c.dropout, mlp_bias: false, pretraining_tp: 1, initializer_range: 0.02,
      use_cache: true, tie_word_embeddings: c.tieEmbeddings,
    };
  },

  tensors(cfg) {
    const c = resolveLlamaConfig(cfg);
    const C = c.nEmbd, A = c.nHead * c.headDim, KV = c.nKvHead * c.headDim, I = c.intermediateSize;
    const out: HfTensor[] = [{ name: 'wte.weight', hf: 'model.embed_tokens.weight', shape: [c.vocabSize, C] }];
    for (let i = 0; i < c.nLayer; i++) {
      const f = `layers.${i}.`, h = `model.layers.${i}.`;
      out.push(
        { name: `${f}attnNorm.weight`, hf: `${h}input_layernorm.weight`, shape: [C] },
        { name: `${f}attn.q.weight`, hf: `${h}self_attn.q_proj.weight`, shape: [A, C] },
        { name: `${f}attn.k.weight`, hf: `${h}self_attn.k_proj.weight`, shape: [KV, C] },
        { name: `${f}attn.v.weight`, hf: `${h}self_attn.v_proj.weight`, shape: [KV, C] },
        { name: `${f}attn.o.weight`, hf: `${h}self_attn.o_proj.weight`, shape: [C, A] },
        { name: `${f}mlpNorm.weight`, hf: `${h}post_attention_layernorm.weight`, shape: [C] },
        { name: `${f}mlp.gate.weight`, hf: `${h}mlp.gate_proj.weight`, shape: [I, C] },
        { name: `${f}mlp.up.weight`, hf: `${h}mlp.up_proj.weight`, shape: [I, C] },
        { name: `${f}mlp.down.weight`, hf: `${h}mlp.down_proj.weight`, shape: [C, I] },
      );
    }
    out.push({ name: 'norm.weight', hf: 'model.norm.weight', shape: [C] });
    if (!c.tieEmbeddings) out.push({ name: 'head.weight', hf: 'lm_head.weight', shape: [c.vocabSize, C] });
    return out;
  },

  // The rotary frequencies older transformers saved with every layer.
  ignored: /^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$/,


  resolve: (cfg) => resolveLlamaConfig(cfg),
};
