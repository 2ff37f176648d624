// Qwen2/2.5 (Qwen2ForCausalLM) and Qwen3 (Qwen3ForCausalLM) dense models as the Llama with options:
// Qwen2 has biases on q, k and v; Qwen3 RMSNorms each query and key head (q_norm, k_norm, weights of
// head_dim) before the rotary positions and has biases on all four projections only with
// attention_bias. Everything else (RMSNorm pre-norm blocks, rotate-half rotary positions,
// grouped-query attention, SwiGLU) is the Llama's, so the shape fields are read by llama_hf.ts.
import type { LlamaConfig } from './llama_config.js';
import { llamaFamilyProblems, resolveLlamaConfig } from './llama_config.js';
import { llamaHf } from './llama_hf.js';
import { hfInt } from './gpt_hf.js';
import type { HfFormat, HfTensor } from './spec.js';

/** transformers' Qwen2Config / Qwen3Config defaults that differ from LlamaConfig's. */
const QWEN_DEFAULTS = {
  vocab_size: 151936, hidden_size: 4096, intermediate_size: 22016, num_hidden_layers: 32, num_attention_heads: 32,
  max_position_embeddings: 32768, rms_norm_eps: 1e-6, rope_theta: 10000, tie_word_embeddings: false,
} as const;

type Family = 'qwen2' | 'qwen3';
const NAMES: Record<Family, { architecture: string }> = {
  qwen2: { architecture: 'Qwen2ForCausalLM' },
  qwen3: { architecture: 'Qwen3ForCausalLM' },
};

/** transformers' max_window_layers default (Qwen2Config, Qwen3Config, Qwen3MoeConfig). */
const MAX_WINDOW_LAYERS = 28;

/**
 * config.json's sliding windows as model.slidingWindow and model.windowFrom. transformers' Qwen2Config
 * / Qwen3Config / Qwen3MoeConfig keep sliding_window only when use_sliding_window is true (else None)
 * and, when config.json has no layer_types, derive them as layer_types[i] = "sliding_attention" if
 * sliding_window is not None and i >= max_window_layers, else "full_attention"; each attention
 * layer then uses sliding_window only when its type is "sliding_attention". A layer_types list is
 * read when given and must be that pattern (full layers, then sliding ones).
 */
export function qwenWindows(hf: Record<string, unknown>, nLayer: number): Pick<LlamaConfig, 'slidingWindow' | 'windowFrom'> {
  const use = hf.use_sliding_window ?? false;
  if (typeof use !== 'boolean') throw new Error(`config.json: use_sliding_window = ${JSON.stringify(use)} is not true or false`);
  const w = hf.sliding_window ?? null;
  if (!use || w === null) return { slidingWindow: 0, windowFrom: 0 };
  if (typeof w !== 'number' || !Number.isInteger(w) || w <= 0) throw new Error(`config.json: sliding_window = ${JSON.stringify(w)} is not a positive integer or null (null = full causal attention)`);
  const types = hf.layer_types;
  if (Array.isArray(types)) {
    const from = types.indexOf('sliding_attention') < 0 ? nLayer : types.indexOf('sliding_attention');
    const ok = types.length === nLayer && types.every((t, i) => t === (i < from ? 'full_attention' : 'sliding_attention'));
    if (!ok) throw new Error(`config.json: layer_types = ${JSON.stringify(types)} is not supported; flotilla reads ${nLayer} layers of "full_attention" below max_window_layers and "sliding_attention" from it (or set use_sliding_window = false)`);
    return { slidingWindow: w, windowFrom: from };
  }
  if (hf.max_window_layers === undefined || hf.max_window_layers === null) return { slidingWindow: w, windowFrom: Math.min(MAX_WINDOW_LAYERS, nLayer) };
  const m = hf.max_window_layers;
  if (typeof m !== 'number' || !Number.isInteger(m) || m < 0) throw new Error(`config.json: max_window_layers = ${JSON.stringify(m)} is not a whole number >= 0`);
  if (m > nLayer) throw new Error(`config.json: max_window_layers = ${m} is above num_hidden_layers = ${nLayer}; set max_window_layers <= num_hidden_layers (= num_hidden_layers: no layer windowed), or use_sliding_window = false`);
  return { slidingWindow: w, windowFrom: m };
}

/** A config its family's class cannot express is an error naming the fields (llama_config.ts). */
function checkExpressible(c: LlamaConfig): void {
  const [problem] = llamaFamilyProblems(c);
  if (problem) throw new Error(problem);
}

function qwenHf(family: Family): HfFormat<LlamaConfig> {
  const { architecture } = NAMES[family];
  return {
    architecture,
    modelType: family,

    fromConfig(hf) {
      let attnBias: LlamaConfig['attnBias'] = 'qkv';
      if (family === 'qwen3') {
        const b = hf.attention_bias ?? false;
        if (typeof b !== 'boolean') throw new Error(`config.json: attention_bias = ${JSON.stringify(b)} is not true or false`);
        attnBias = b ? 'all' : 'none';
      }
      // The shape fields as the Llama reads them, with this family's defaults (Qwen3 sets head_dim 128).
      const defaults: Record<string, unknown> = { ...QWEN_DEFAULTS, ...(family === 'qwen3' ? { head_dim: 128 } : {}) };
      const given = Object.fromEntries(Object.entries(hf).filter(([, v]) => v !== undefined && v !== null));
      const shape = llamaHf.fromConfig({ ...defaults, ...given, rope_scaling: hf.rope_scaling ?? null, attention_bias: false, mlp_bias: false });
      return { ...shape, family, attnBias, qkNorm: family === 'qwen3', ...qwenWindows(hf, hfInt({ ...defaults, ...given }, 'num_hidden_layers')) };
    },

    toConfig(cfg) {
      const c = resolveLlamaConfig(cfg);
      checkExpressible(c);
      const { attention_bias: _a, mlp_bias: _m, pretraining_tp: _p, architectures: _r, model_type: _t, ...common } = llamaHf.toConfig(c);
      return {
        architectures: [architecture], model_type: family, ...common,
        ...(family === 'qwen3' ? { attention_bias: c.attnBias === 'all' } : {}),
        // max_window_layers: the first windowed layer (qwenWindows).
        use_sliding_window: c.slidingWindow > 0, sliding_window: c.slidingWindow > 0 ? c.slidingWindow : null, max_window_layers: c.slidingWindow > 0 ? c.windowFrom : c.nLayer,
      };
    },

    tensors(cfg) {
      const c = resolveLlamaConfig(cfg);
      checkExpressible(c);
      const A = c.nHead * c.headDim, KV = c.nKvHead * c.headDim;
      const out: HfTensor[] = [];
      // In transformers' order: each projection's bias after its weight, the norms after o_proj.
      for (const t of llamaHf.tensors(c)) {
        out.push(t);
        const m = /^(layers\.\d+\.attn\.)([qkvo])\.weight$/.exec(t.name);
        if (!m) continue;
        const [, f, which] = m as unknown as [string, string, 'q' | 'k' | 'v' | 'o'];
        const h = t.hf.slice(0, -'.weight'.length);
        if (c.attnBias === 'all' || (c.attnBias === 'qkv' && which !== 'o')) out.push({ name: `${f}${which}.bias`, hf: `${h}.bias`, shape: [which === 'q' ? A : which === 'o' ? c.nEmbd : KV] });
        if (which === 'o' && c.qkNorm) {
          const a = h.slice(0, -'o_proj'.length);
          out.push({ name: `${f}qNorm.weight`, hf: `${a}q_norm.weight`, shape: [c.headDim] }, { name: `${f}kNorm.weight`, hf: `${a}k_norm.weight`, shape: [c.headDim] });
        }
      }
      return out;
    },

    ignored: llamaHf.ignored,
    configOf: () => undefined,
    resolve: (cfg) => resolveLlamaConfig(cfg),
  };
}

export const qwen2Hf = qwenHf('qwen2');
export const qwen3Hf = qwenHf('qwen3');
