// Model FLOPs per trained token, for the MFU ([Note: model flops]).
//
// [Note: model flops] FLOPs per token = 6 N + 12 x nLayer x T x d_attn, PaLM's appendix B count as
// torchtitan's get_num_flop_per_token writes it:
// - N: the weights of every matmul one token goes through: the attention projections (q, k, v and
//   the output; with grouped-query attention k and v are nKvHead heads wide), the MLP, or in an MoE
//   block the router, its topK routed experts and the shared ones (not the other experts), and the
//   output head (vocab x width, whether tied to the embedding or not). The embedding lookups (token,
//   and the GPT's positions), biases and norm weights are not matmuls and are not counted. Each weight
//   costs 2 FLOPs (a multiply and an add) forward and 4 backward (the input's and the weight's
//   gradients): 6 N.
// - attention: the scores (Q K^T) and the weighted values, 2 matmuls forward and 4 backward, 2 FLOPs
//   each, over T keys per query and d_attn = nHead x headDim: 12 x nLayer x T x d_attn. T is
//   data.seqLen: like torchtitan (and PaLM) this does not halve for causal masking; with a sliding
//   window a query reads at most that many keys, so T = min(seqLen, window).
// Recomputation (activation checkpointing) is not counted: these are the model's FLOPs, not the
// hardware's.
// Each architecture says what it is counted from (ModelRules.flopShape in src/models/spec.ts).
import { modelConfigOf, type FlotillaConfig } from '../config/schema.js';
import { modelRules } from '../models/rules.js';

export interface FlopCount {
  /** N: weights of the matmuls one token goes through. */
  matmulParams: number;
  /** 12 x T x d_attn summed over the attention layers. */
  attention: number;
  /** 6 N + attention. */
  perToken: number;
}

/** The count for a config's model, or undefined when its architecture does not give its shape (a user's model may not). */
export function modelFlops(cfg: Pick<FlotillaConfig, 'model' | 'moe' | 'data'>): FlopCount | undefined {
  const shape = modelRules(cfg.model.arch).flopShape?.(modelConfigOf(cfg), cfg.data.seqLen);
  if (!shape) return undefined;
  const attention = shape.attention.reduce((sum, a) => sum + 12 * a.keys * a.width, 0);
  return { matmulParams: shape.matmulParams, attention, perToken: 6 * shape.matmulParams + attention };
}

/** Achieved model TFLOP/s per rank and the MFU, from a step's global tokens/s. */
export function mfuOf(flopsPerToken: number, tokensPerSec: number, ranks: number, peakTflops: number): { tflops: number; mfu: number } {
  const tflops = (flopsPerToken * tokensPerSec) / ranks / 1e12;
  return { tflops, mfu: tflops / peakTflops };
}
