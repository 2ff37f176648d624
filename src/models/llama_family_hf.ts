// The Llama's Hugging Face form over its families: a config.json is read by its model_type's
// format, a model is written as its model.family's (LlamaForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM, MistralForCausalLM). A family is one entry in the map below (typed by llama_config.ts's list). No
// model class here (the spec adds configOf): a config resolves `[train] initFrom` with it before any rank starts.
import { llamaFamilyProblems, resolveLlamaConfig, type LlamaConfig, type LlamaFamily } from './llama_config.js';
import { llamaHf } from './llama_hf.js';
import { qwen2Hf, qwen3Hf } from './qwen_hf.js';
import { mistralHf } from './mistral_hf.js';
import type { HfMap } from './spec.js';

const byFamily: { readonly [F in LlamaFamily]: HfMap<LlamaConfig> } = { llama: llamaHf, qwen2: qwen2Hf, qwen3: qwen3Hf, mistral: mistralHf };

/** The format a config's family is written as. */
function formatOf(cfg: Partial<LlamaConfig>): HfMap<LlamaConfig> {
  const c = resolveLlamaConfig(cfg);
  // A parameter the family's class has no name for would be left out of the directory: refused.
  const [problem] = llamaFamilyProblems(c);
  if (problem) throw new Error(problem);
  return byFamily[c.family];
}

export const llamaFamilyHf: HfMap<LlamaConfig> = {
  architecture: llamaHf.architecture,
  modelType: llamaHf.modelType,
  modelTypes: Object.fromEntries(Object.values(byFamily).map((f) => [f.modelType, f.architecture])),

  fromConfig(hf) {
    const f = Object.values(byFamily).find((x) => x.modelType === hf.model_type) ?? llamaHf;
    // Every family's options, so a run's [model] section is compared on them too (train.initFrom).
    // (After the format's own fields: arch first in the [model] section an error offers to paste.)
    const d = f.fromConfig(hf);
    return { ...d, family: d.family ?? 'llama', attnBias: d.attnBias ?? 'none', qkNorm: d.qkNorm ?? false, slidingWindow: d.slidingWindow ?? 0, windowFrom: d.windowFrom ?? 0 };
  },
  toConfig: (cfg) => formatOf(cfg).toConfig(cfg),
  tensors: (cfg) => formatOf(cfg).tensors(cfg),
  ignored: llamaHf.ignored,
  // A Llama with experts is a MixtralForCausalLM (mixtral_hf.ts).
  misfit: (cfg) => (cfg.moe && cfg.moe.experts > 0 ? 'it has no experts (moe.experts = 0)' : undefined),
  resolve: (cfg) => resolveLlamaConfig(cfg),
};
