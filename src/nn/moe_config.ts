// The mixture-of-experts settings ([moe] in the config) and their rules, apart from the layer's code
// (moe.ts): model configs and the config's validation read them without loading the tensor library.

export type MoERouter = 'softmax' | 'sigmoid';
export type MoEBalance = 'aux' | 'bias';

export interface MoEConfig {
  /** Routed experts per MoE layer; 0 = every MLP dense. */
  experts: number;
  /** Experts each token is sent to. */
  topK: number;
  /** An MoE MLP in every `every`-th block (blocks every-1, 2 every-1, ...); the others stay dense. */
  every: number;
  /** Blocks (global index) that stay dense although `every` places experts there (Qwen3-MoE's mlp_only_layers). */
  denseLayers: number[];
  /** Experts every token goes through besides its routed ones (DeepSeek's shared experts). */
  sharedExperts: number;
  /** Hidden width of one expert; 0 = the dense MLP's width. */
  hidden: number;
  /** Router scores: softmax over the experts, or each expert's own sigmoid. */
  router: MoERouter;
  /** Weight a token's chosen experts by their scores renormalised to sum 1 (Mixtral, Qwen3-MoE's norm_topk_prob), not the raw scores. */
  normTopK: boolean;
  /** "aux": the Switch auxiliary loss times auxCoeff; "bias": a per-expert selection bias moved after each step (no loss). */
  balance: MoEBalance;
  auxCoeff: number;
  /** How far one step moves an expert's selection bias (balance = "bias"). */
  biasRate: number;
  /** Tokens an expert takes per batch, as a multiple of an even share (topK x tokens / experts); 0 = no limit (dropless). */
  capacityFactor: number;
}

export const defaultMoEConfig: MoEConfig = {
  experts: 0, topK: 1, every: 1, denseLayers: [], sharedExperts: 0, hidden: 0, router: 'softmax', normTopK: false, balance: 'aux', auxCoeff: 0.01, biasRate: 1e-3, capacityFactor: 0,
};

/**
 * Whether block `layer` (global index) has an MoE MLP: every place that decides which blocks have
 * experts asks this. As transformers' Qwen3MoeDecoderLayer: sparse when the layer is not in
 * mlp_only_layers (moe.denseLayers) and (layer + 1) % decoder_sparse_step (moe.every) == 0.
 */
export function isMoELayer(m: MoEConfig | undefined, layer: number): boolean {
  return m !== undefined && m.experts > 0 && (layer + 1) % m.every === 0 && !(m.denseLayers ?? []).includes(layer);
}

/** The blocks with an MoE MLP, in order. */
export function moeLayers(m: MoEConfig | undefined, nLayer: number): number[] {
  return Array.from({ length: nLayer }, (_, i) => i).filter((i) => isMoELayer(m, i));
}

/** Every problem of an [moe] section, each naming the field and the fix (none when experts = 0). */
export function moeProblems(m: MoEConfig | undefined, nLayer: number): string[] {
  if (!m || m.experts === 0) return [];
  const p: string[] = [];
  const int = (k: 'experts' | 'topK' | 'every' | 'sharedExperts' | 'hidden', min: number) => {
    if (!Number.isInteger(m[k]) || m[k] < min) p.push(`moe.${k} must be an integer >= ${min}, got ${m[k]}`);
  };
  int('experts', 0); int('topK', 1); int('every', 1); int('sharedExperts', 0); int('hidden', 0);
  if (m.topK > m.experts) p.push(`moe.topK (${m.topK}) must be <= moe.experts (${m.experts}); lower moe.topK or raise moe.experts`);
  if (m.every > nLayer) p.push(`moe.every (${m.every}) is above model.nLayer (${nLayer}), so no block would have experts; lower moe.every`);
  const dense = m.denseLayers ?? [];
  if (!Array.isArray(dense) || dense.some((i) => !Number.isInteger(i) || i < 0 || i >= nLayer)) p.push(`moe.denseLayers (${JSON.stringify(dense)}) must list blocks from 0 to model.nLayer - 1 (${nLayer - 1})`);
  else if (m.every <= nLayer && moeLayers(m, nLayer).length === 0) p.push(`moe.denseLayers (${JSON.stringify(dense)}) leaves no block with experts; remove a block every moe.every places experts in from it, or set moe.experts = 0`);
  if (m.router !== 'softmax' && m.router !== 'sigmoid') p.push(`moe.router must be "softmax" or "sigmoid", got ${JSON.stringify(m.router)}`);
  if (typeof m.normTopK !== 'boolean') p.push(`moe.normTopK must be true or false, got ${JSON.stringify(m.normTopK)}`);
  if (m.balance !== 'aux' && m.balance !== 'bias') p.push(`moe.balance must be "aux" or "bias", got ${JSON.stringify(m.balance)}`);
  if (!(m.auxCoeff >= 0)) p.push(`moe.auxCoeff must be >= 0, got ${m.auxCoeff}`);
  if (!(m.biasRate >= 0)) p.push(`moe.biasRate must be >= 0, got ${m.biasRate}`);
  if (!(m.capacityFactor >= 0)) p.push(`moe.capacityFactor must be >= 0 (0 = dropless), got ${m.capacityFactor}`);
  return p;
}

/** The config with defaults filled in; throws naming the first field that cannot work. */
export function checkMoEConfig(m: Partial<MoEConfig> | undefined, nLayer: number): MoEConfig | undefined {
  if (!m || !m.experts) return undefined;
  const c = { ...defaultMoEConfig, ...m };
  const p = moeProblems(c, nLayer);
  if (p.length > 0) throw new Error(p.join('; '));
  return c;
}

/** Parameters of one MoE MLP: router, routed and shared experts (`expert`: one expert's parameter count). */
export function moeLayerParams(m: MoEConfig, nEmbd: number, expert: number): number {
  return m.experts * nEmbd + (m.experts + m.sharedExperts) * expert;
}

/** Weights of one MoE MLP a token goes through: the router and its topK routed and the shared experts (`expert`: one expert's weights). */
export function moeActiveParams(m: MoEConfig, nEmbd: number, expert: number): number {
  return m.experts * nEmbd + (m.topK + m.sharedExperts) * expert;
}
