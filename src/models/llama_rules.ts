// The Llama's shape rules (the light part of its spec: [Note: model registry] in registry.ts): the
// problems of a config under a layout, its description and its list of Linears with the Hugging
// Face names of the class it is written as. Apart from llama_config.ts, which the Hugging Face maps
// read, so that the maps and the config do not import each other.
import type { ModelRules, ShapeContext } from './spec.js';
import type { LinearShape } from '../nn/lora_targets.js';
import { mixtralHf } from './mixtral_hf.js';
import { qwen3MoeHf } from './qwen3_moe_hf.js';
import { isMoELayer, moeActiveParams, moeProblems } from '../nn/moe_config.js';
import { layerWindow, llamaFamilyProblems, llamaIntermediateSize, llamaNumParams, resolveLlamaConfig, type LlamaConfig } from './llama_config.js';

/** Every problem of a Llama config under a layout, each naming the field and the fix. */
function llamaShapeProblems(m: LlamaConfig, ctx: ShapeContext): string[] {
  const p: string[] = [...moeProblems(m.moe, m.nLayer), ...llamaFamilyProblems(m)];
  if (m.headDim === 0 && m.nEmbd % m.nHead !== 0) p.push(`model.nEmbd (${m.nEmbd}) must be divisible by model.nHead (${m.nHead}), or set model.headDim`);
  const nKv = m.nKvHead === 0 ? m.nHead : m.nKvHead;
  if (m.nHead % nKv !== 0) p.push(`model.nKvHead (${nKv}) must divide model.nHead (${m.nHead}) (grouped-query attention: 1 = multi-query, model.nHead = multi-head)`);
  const hd = m.headDim || (m.nEmbd % m.nHead === 0 ? m.nEmbd / m.nHead : 0);
  if (hd % 2 !== 0) p.push(`the head width (model.headDim, or model.nEmbd / model.nHead) = ${hd} must be even: rotary embeddings rotate pairs`);
  if (m.ropeScaling === 'llama3' && !(m.ropeHighFreqFactor > m.ropeLowFreqFactor)) {
    p.push(`model.ropeHighFreqFactor (${m.ropeHighFreqFactor}) must be above model.ropeLowFreqFactor (${m.ropeLowFreqFactor}) with model.ropeScaling = "llama3"`);
  }
  const w = m.slidingWindow ?? 0;
  if (!Number.isInteger(w) || w < 0) p.push(`model.slidingWindow (${w}) must be a whole number >= 0 (0 = full causal attention)`);
  const from = m.windowFrom ?? 0;
  if (!Number.isInteger(from) || from < 0 || from > m.nLayer) p.push(`model.windowFrom (${from}) must be a whole number from 0 to model.nLayer (${m.nLayer}): the first block with the sliding window`);
  if (ctx.seqLen > m.blockSize) p.push(`data.seqLen (${ctx.seqLen}) must be <= model.blockSize (${m.blockSize}); lower data.seqLen or raise model.blockSize`);
  const stages = ctx.pp * ctx.ppVirtualStages;
  if (ctx.pp > 1 && m.nLayer < stages) {
    p.push(`parallel.pp x parallel.ppVirtualStages = ${stages} pipeline stages need model.nLayer >= ${stages} (got ${m.nLayer}); lower parallel.pp or ppVirtualStages, or raise model.nLayer`);
  }
  if (ctx.tp > 1) {
    // What the plan splits: query and key/value heads, the MLP width, the vocabulary (0 until the
    // tokenizer resolves it), and tokens under sequence parallelism.
    const I = m.intermediateSize || llamaIntermediateSize(m.nEmbd);
    const checks: [string, number][] = [
      ['model.nHead', m.nHead], ['model.nKvHead (key/value heads are split over tp)', nKv],
      [`model.intermediateSize (the MLP width${m.intermediateSize ? '' : ', derived from model.nEmbd'})`, I], ['model.vocabSize', m.vocabSize],
    ];
    if (ctx.sequenceParallel) checks.push(['data.seqLen (sequence parallelism shards tokens)', ctx.seqLen]);
    for (const [what, v] of checks) {
      if (v % ctx.tp !== 0) p.push(`${what} = ${v} does not divide by parallel.tp = ${ctx.tp}; choose a tp that divides it${what === 'model.vocabSize' ? ' (or pad the vocabulary: set model.vocabSize to a multiple of tp)' : ''}`);
    }
  }
  return p;
}

/** The Llama's shape rules (the light part of its spec; [Note: model registry] in registry.ts). */
export const llamaRules: ModelRules<LlamaConfig> = {
  arch: 'llama',
  describe: (m) => {
    const c = resolveLlamaConfig(m);
    return `Llama ${c.nLayer} layers, ${c.nHead} heads (${c.nKvHead} key/value) of ${c.headDim}, width ${c.nEmbd}, MLP ${c.intermediateSize}, context ${c.blockSize}` +
      (c.ropeScaling === 'llama3' ? `, rope theta ${c.ropeTheta} scaled (llama3, factor ${c.ropeFactor})` : `, rope theta ${c.ropeTheta}`) + (c.tieEmbeddings ? ', tied head' : '') +
      (c.attnBias !== 'none' ? `, attention biases (${c.attnBias})` : '') + (c.qkNorm ? ', q/k norms' : '') + (c.family !== 'llama' ? ` (${c.family})` : '') + (c.slidingWindow ? `, sliding window ${c.slidingWindow}${c.windowFrom > 0 ? ` from block ${c.windowFrom}` : ''}` : '');
  },
  numParams: (m) => llamaNumParams(m),
  flopShape(m, seqLen) {
    // Per block q, k, v (nKvHead heads wide) and o, the SwiGLU (gate, up, down) or the MoE's active experts; the head.
    // A sliding window caps the keys a query reads, in the blocks that have it (layerWindow).
    const c = resolveLlamaConfig(m), C = c.nEmbd, A = c.nHead * c.headDim, KV = c.nKvHead * c.headDim, I = c.intermediateSize;
    let n = C * c.vocabSize;
    for (let i = 0; i < c.nLayer; i++) n += 2 * C * A + 2 * C * KV + (isMoELayer(c.moe, i) ? moeActiveParams(c.moe!, C, 3 * C * (c.moe!.hidden || I)) : 3 * C * I);
    const keys = (i: number) => (layerWindow(c, i) > 0 ? Math.min(seqLen, layerWindow(c, i)) : seqLen);
    return { matmulParams: n, attention: Array.from({ length: c.nLayer }, (_, i) => ({ width: A, keys: keys(i) })) };
  },
  linears(m) {
    // transformers' LlamaForCausalLM names (llama_hf.ts); an MoE block's experts are stacks of Linears. The
    // head's width is 0 while the vocabulary is not resolved (model.vocabSize = 0 = the tokenizer's).
    const c = { ...resolveLlamaConfig({ ...m, vocabSize: m.vocabSize || 1 }), vocabSize: m.vocabSize }, C = c.nEmbd, A = c.nHead * c.headDim, KV = c.nKvHead * c.headDim, I = c.intermediateSize;
    const out: LinearShape[] = [];
    const stacks = new Map<string, string>();
    if (c.moe && c.moe.experts > 0) {
      const fits = [mixtralHf, qwen3MoeHf].find((f) => f.misfit!(m) === undefined);
      for (const t of fits?.tensors(m) ?? []) if (t.stack) stacks.set(t.name, t.hf.slice(0, -'.weight'.length).replace(/\.experts\.\d+\./, '.experts.'));
    }
    const lin = (path: string, hf: string | undefined, inFeatures: number, outFeatures: number): LinearShape => ({ path, ...(hf ? { hf } : {}), inFeatures, outFeatures });
    for (let i = 0; i < c.nLayer; i++) {
      const f = `layers.${i}.`, h = `model.layers.${i}.`;
      out.push(lin(`${f}attn.q`, `${h}self_attn.q_proj`, C, A), lin(`${f}attn.k`, `${h}self_attn.k_proj`, C, KV), lin(`${f}attn.v`, `${h}self_attn.v_proj`, C, KV), lin(`${f}attn.o`, `${h}self_attn.o_proj`, A, C));
      if (!isMoELayer(c.moe, i)) out.push(lin(`${f}mlp.gate`, `${h}mlp.gate_proj`, C, I), lin(`${f}mlp.up`, `${h}mlp.up_proj`, C, I), lin(`${f}mlp.down`, `${h}mlp.down_proj`, I, C));
      else {
        // The experts' projections, stacks of per-expert Linears ([Note: LoRA on experts]), named as
        // the Hugging Face class this config writes names them (Mixtral's w1/w3/w2, Qwen3-MoE's
        // gate_proj/up_proj/down_proj), without the expert's index; none when no class fits.
        const E = c.moe!.experts, H = c.moe!.hidden || I;
        const e = (name: string, inF: number, outF: number): LinearShape => ({ ...lin(`${f}mlp.experts.${name}`, stacks.get(`${f}mlp.experts.${name}`), inF, outF), experts: E });
        out.push(e('gate', C, H), e('up', C, H), e('down', H, C));
      }
    }
    out.push(lin('head', c.tieEmbeddings ? undefined : 'lm_head', C, c.vocabSize));
    return out;
  },
  shapeProblems: llamaShapeProblems,
};
