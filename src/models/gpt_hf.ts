// The GPT as transformers' GPT2LMHeadModel: the config map and the tensor name map
// (src/checkpoint/hf.ts reads and writes the directories). GPT-2's Conv1D layers keep weights as
// [in, out], the transpose of a Linear's; its c_attn is the same fused [q | k | v] projection as
// the GPT's attn.qkv, so the map is one tensor to one tensor.
import type { GPTConfig } from './gpt_config.js';
import type { HfMap, HfTensor } from './spec.js';

/** transformers' GPT2Config defaults, for the fields a config.json leaves out. */
const GPT2_DEFAULTS = {
  vocab_size: 50257, n_positions: 1024, n_embd: 768, n_layer: 12, n_head: 12, n_inner: null,
  activation_function: 'gelu_new', layer_norm_epsilon: 1e-5, tie_word_embeddings: true,
  scale_attn_weights: true, scale_attn_by_inverse_layer_idx: false, add_cross_attention: false,
} as const;

const TANH = ['gelu_new', 'gelu_pytorch_tanh'];

/** A positive integer field of config.json (its transformers default when absent). */
export function hfInt(hf: Record<string, unknown>, field: string, dflt?: number): number {
  const v = hf[field] ?? dflt;
  if (typeof v !== 'number' || !Number.isInteger(v) || v <= 0) {
    throw new Error(`config.json: ${field} = ${JSON.stringify(v)} is not a positive integer`);
  }
  return v;
}

/** A field that must have one value for this model to be exact. */
export function hfRequire(hf: Record<string, unknown>, field: string, dflt: unknown, ok: readonly unknown[], why: string): void {
  const v = hf[field] ?? dflt;
  if (!ok.includes(v)) throw new Error(`config.json: ${field} = ${JSON.stringify(v)} is not supported; ${why}`);
}

export const gpt2Hf: HfMap<GPTConfig> = {
  architecture: 'GPT2LMHeadModel',
  modelType: 'gpt2',

  fromConfig(hf) {
    const d = GPT2_DEFAULTS;
    const nEmbd = hfInt(hf, 'n_embd', d.n_embd), nHead = hfInt(hf, 'n_head', d.n_head);
    if (nEmbd % nHead !== 0) throw new Error(`config.json: n_embd = ${nEmbd} does not divide by n_head = ${nHead}`);
    const act = hf.activation_function ?? d.activation_function;
    if (typeof act !== 'string' || (!TANH.includes(act) && act !== 'gelu')) {
      throw new Error(`config.json: activation_function = ${JSON.stringify(act)} is not supported; GPT2LMHeadModel is read with "gelu_new" or "gelu_pytorch_tanh" (the tanh GELU) or "gelu" (exact)`);
    }
    const inner = hf.n_inner ?? null;
    if (inner !== null && inner !== 4 * nEmbd) throw new Error(`config.json: n_inner = ${JSON.stringify(inner)} is not supported; the GPT's MLP is 4 x n_embd = ${4 * nEmbd} wide (or null)`);
    hfRequire(hf, 'layer_norm_epsilon', d.layer_norm_epsilon, [1e-5], 'the GPT\'s LayerNorms use 1e-5');
    hfRequire(hf, 'scale_attn_weights', d.scale_attn_weights, [true], 'the GPT scales attention by 1/sqrt(head width)');
    hfRequire(hf, 'scale_attn_by_inverse_layer_idx', d.scale_attn_by_inverse_layer_idx, [false], 'the GPT does not scale attention per layer');
    hfRequire(hf, 'add_cross_attention', d.add_cross_attention, [false], 'the GPT is a decoder without cross-attention');
    const tie = hf.tie_word_embeddings ?? d.tie_word_embeddings;
    if (typeof tie !== 'boolean') throw new Error(`config.json: tie_word_embeddings = ${JSON.stringify(tie)} is not true or false`);
    return {
      arch: 'gpt', vocabSize: hfInt(hf, 'vocab_size', d.vocab_size), blockSize: hfInt(hf, 'n_positions', d.n_positions),
      nLayer: hfInt(hf, 'n_layer', d.n_layer), nHead, nEmbd, bias: true, tieEmbeddings: tie, gelu: act === 'gelu' ? 'exact' : 'tanh',
    };
  },

  toConfig(c) {
    return {
      architectures: ['GPT2LMHeadModel'], model_type: 'gpt2',
      vocab_size: c.vocabSize, n_positions: c.blockSize, n_embd: c.nEmbd, n_layer: c.nLayer, n_head: c.nHead, n_inner: null,
      activation_function: c.gelu === 'tanh' ? 'gelu_new' : 'gelu',
      resid_pdrop: c.dropout, embd_pdrop: c.dropout, attn_pdrop: c.dropout,
      layer_norm_epsilon: 1e-5, initializer_range: 0.02, scale_attn_weights: true, use_cache: true,
      tie_word_embeddings: c.tieEmbeddings,
    };
  },

  tensors(c) {
    const C = c.nEmbd;
    // A bias-free GPT is GPT-2 with zero biases (transformers' GPT-2 always has them).
    const bias = (name: string, hf: string, n: number): HfTensor => (c.bias ? { name, hf, shape: [n] } : { name, hf, shape: [n], zeros: true });
    const out: HfTensor[] = [
      { name: 'wte.weight', hf: 'transformer.wte.weight', shape: [c.vocabSize, C] },
      { name: 'wpe.weight', hf: 'transformer.wpe.weight', shape: [c.blockSize, C] },
    ];
    for (let i = 0; i < c.nLayer; i++) {
      const f = `layers.${i}.`, h = `transformer.h.${i}.`;
      out.push(
        { name: `${f}ln1.weight`, hf: `${h}ln_1.weight`, shape: [C] }, bias(`${f}ln1.bias`, `${h}ln_1.bias`, C),
        { name: `${f}attn.qkv.weight`, hf: `${h}attn.c_attn.weight`, shape: [C, 3 * C], transpose: true }, bias(`${f}attn.qkv.bias`, `${h}attn.c_attn.bias`, 3 * C),
        { name: `${f}attn.proj.weight`, hf: `${h}attn.c_proj.weight`, shape: [C, C], transpose: true }, bias(`${f}attn.proj.bias`, `${h}attn.c_proj.bias`, C),
        { name: `${f}ln2.weight`, hf: `${h}ln_2.weight`, shape: [C] }, bias(`${f}ln2.bias`, `${h}ln_2.bias`, C),
        { name: `${f}mlp.fc.weight`, hf: `${h}mlp.c_fc.weight`, shape: [C, 4 * C], transpose: true }, bias(`${f}mlp.fc.bias`, `${h}mlp.c_fc.bias`, 4 * C),
        { name: `${f}mlp.proj.weight`, hf: `${h}mlp.c_proj.weight`, shape: [4 * C, C], transpose: true }, bias(`${f}mlp.proj.bias`, `${h}mlp.c_proj.bias`, C),
      );
    }
    out.push({ name: 'lnF.weight', hf: 'transformer.ln_f.weight', shape: [C] }, bias('lnF.bias', 'transformer.ln_f.bias', C));
    if (!c.tieEmbeddings) out.push({ name: 'head.weight', hf: 'lm_head.weight', shape: [c.vocabSize, C] });
    return out;
  },

  // The causal mask buffers older transformers saved with every layer.
  ignored: /^transformer\.h\.\d+\.attn\.(bias|masked_bias)$/,

  // Checkpoints saved from GPT2Model (the original "gpt2" upload) have no "transformer." prefix.
  canonicalName: (stored) => (stored.startsWith('transformer.') || stored.startsWith('lm_head.') ? stored : `transformer.${stored}`),

  misfit: (cfg) => (cfg.moe && cfg.moe.experts > 0 ? 'it has no experts (moe.experts = 0)' : undefined),
};
