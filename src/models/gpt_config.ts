// The GPT's config and the rules on its shapes, apart from the model's code: the config's
// validation (src/config) and the launcher read them without loading the tensor library.
import type { ModelRules } from './spec.js';
import type { LinearShape } from '../nn/lora_targets.js';
import { checkMoEConfig, isMoELayer, moeActiveParams, moeLayerParams, moeProblems, type MoEConfig } from '../nn/moe_config.js';

export interface GPTConfig {
  vocabSize: number;
  /** Longest context (positions). */
  blockSize: number;
  nLayer: number;
  nHead: number;
  nEmbd: number;
  dropout: number;
  /** Biases in Linear and LayerNorm layers. */
  bias: boolean;
  /** Share the token embedding with the output head (one parameter used twice per step). */
  tieEmbeddings: boolean;
  /** The MLP's GELU: 'exact' (erf, the default) or 'tanh' (the approximation GPT-2 was trained with). */
  gelu?: 'exact' | 'tanh';
  /** Mixture of experts (the [moe] section): an MoE MLP every moe.every blocks when moe.experts > 0. */
  moe?: MoEConfig;
}

export const defaultGPTConfig: GPTConfig = {
  vocabSize: 256, blockSize: 128, nLayer: 4, nHead: 4, nEmbd: 128, dropout: 0, bias: true, tieEmbeddings: false, gelu: 'exact',
};


/** The config with defaults filled in; throws naming a field that cannot work. */
export function checkGPTConfig(cfg: Partial<GPTConfig>): GPTConfig {
  const c = { ...defaultGPTConfig, ...cfg };
  for (const k of ['vocabSize', 'blockSize', 'nLayer', 'nHead', 'nEmbd'] as const) {
    if (!Number.isInteger(c[k]) || c[k] <= 0) throw new Error(`GPT: ${k} must be a positive integer, got ${c[k]}`);
  }
  if (c.gelu !== 'exact' && c.gelu !== 'tanh') throw new Error(`GPT: gelu must be "exact" or "tanh", got ${JSON.stringify(c.gelu)}`);
  const moe = checkMoEConfig(c.moe, c.nLayer);
  if (moe) c.moe = moe;
  else delete c.moe;
  return c;
}

/**
 * Parameters of the whole GPT a config describes, counted from its shapes, so a pipeline rank that
 * builds only its stages can still name the model's size (a tied head counts once).
 */
export function gptNumParams(cfg: Partial<GPTConfig>): number {
  const c = checkGPTConfig(cfg);
  const C = c.nEmbd, b = c.bias ? 1 : 0;
  const norm = C + b * C;
  const linear = (inF: number, outF: number) => inF * outF + b * outF;
  const mlp = linear(C, 4 * C) + linear(4 * C, C);
  const block = 2 * norm + linear(C, 3 * C) + linear(C, C) + mlp;
  let moe = 0;
  for (let i = 0; i < c.nLayer; i++) {
    if (!isMoELayer(c.moe, i)) continue;
    const H = c.moe!.hidden || 4 * C;
    moe += moeLayerParams(c.moe!, C, linear(C, H) + linear(H, C)) - mlp;
  }
  return c.vocabSize * C + c.blockSize * C + c.nLayer * block + moe + norm + (c.tieEmbeddings ? 0 : c.vocabSize * C);
}

/** The GPT's shape rules (the light part of its spec; [Note: model registry] in registry.ts). */
export const gptRules: ModelRules<GPTConfig> = {
  arch: 'gpt',
  describe: (m) => `GPT ${m.nLayer} layers, ${m.nHead} heads, width ${m.nEmbd}, context ${m.blockSize}`,
  numParams: (m) => gptNumParams(m),
  flopShape(m, seqLen) {
    // Per block qkv (C x 3C) and the output (C x C), the MLP (C x 4C, 4C x C) or the MoE's active experts; the head.
    const c = checkGPTConfig(m), C = c.nEmbd;
    let n = C * c.vocabSize;
    for (let i = 0; i < c.nLayer; i++) n += 4 * C * C + (isMoELayer(c.moe, i) ? moeActiveParams(c.moe!, C, 2 * C * (c.moe!.hidden || 4 * C)) : 8 * C * C);
    return { matmulParams: n, attention: Array.from({ length: c.nLayer }, () => ({ width: C, keys: seqLen })) };
  },
  linears(m) {
    // GPT-2's Conv1D names (transformers' GPT2LMHeadModel; gpt_hf.ts); an MoE block's experts are no Linears.
    const C = m.nEmbd, out: LinearShape[] = [];
    const lin = (path: string, hf: string | undefined, inFeatures: number, outFeatures: number): LinearShape => ({ path, ...(hf ? { hf } : {}), inFeatures, outFeatures });
    for (let i = 0; i < m.nLayer; i++) {
      const f = `layers.${i}.`, h = `transformer.h.${i}.`;
      out.push(lin(`${f}attn.qkv`, `${h}attn.c_attn`, C, 3 * C), lin(`${f}attn.proj`, `${h}attn.c_proj`, C, C));
      if (!isMoELayer(m.moe, i)) out.push(lin(`${f}mlp.fc`, `${h}mlp.c_fc`, C, 4 * C), lin(`${f}mlp.proj`, `${h}mlp.c_proj`, 4 * C, C));
    }
    out.push(lin('head', m.tieEmbeddings ? undefined : 'lm_head', C, m.vocabSize));
    return out;
  },
  shapeProblems(m, ctx) {
    const p: string[] = moeProblems(m.moe, m.nLayer);
    if (m.nEmbd % m.nHead !== 0) p.push(`model.nEmbd (${m.nEmbd}) must be divisible by model.nHead (${m.nHead})`);
    if (ctx.seqLen > m.blockSize) p.push(`data.seqLen (${ctx.seqLen}) must be <= model.blockSize (${m.blockSize}); lower data.seqLen or raise model.blockSize`);
    const stages = ctx.pp * ctx.ppVirtualStages;
    if (ctx.pp > 1 && m.nLayer < stages) {
      p.push(`parallel.pp x parallel.ppVirtualStages = ${stages} pipeline stages need model.nLayer >= ${stages} (got ${m.nLayer}); lower parallel.pp or ppVirtualStages, or raise model.nLayer`);
    }
    if (ctx.tp > 1) {
      // What the tensor-parallel plan splits: heads, the widths of the split Linears, the vocabulary
      // (model.vocabSize = 0 until the tokenizer resolves it), and tokens under sequence parallelism.
      const checks: [string, number][] = [['model.nHead', m.nHead], ['model.nEmbd', m.nEmbd], ['4 x model.nEmbd (the MLP width)', 4 * m.nEmbd], ['model.vocabSize', m.vocabSize]];
      if (ctx.sequenceParallel) checks.push(['data.seqLen (sequence parallelism shards tokens)', ctx.seqLen]);
      for (const [what, v] of checks) {
        if (v % ctx.tp !== 0) p.push(`${what} = ${v} does not divide by parallel.tp = ${ctx.tp}; choose a tp that divides it${what === 'model.vocabSize' ? ' (or pad the vocabulary: set model.vocabSize to a multiple of tp)' : ''}`);
      }
    }
    return p;
  },
};
