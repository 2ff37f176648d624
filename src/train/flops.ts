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
import type { FlotillaConfig } from '../config/schema.js';
import { modelConfigOf } from '../config/schema.js';
import { checkGPTConfig } from '../models/gpt_config.js';
import { resolveLlamaConfig } from '../models/llama_config.js';
import { isMoELayer, type MoEConfig } from '../nn/moe_config.js';

export interface FlopCount {
  /** N: weights of the matmuls one token goes through. */
  matmulParams: number;
  /** 12 x nLayer x T x d_attn. */
  attention: number;
  /** 6 N + attention. */
  perToken: number;
}

/** An MoE block's active weights: the router (width x experts) and topK + shared experts of `expert` weights each. */
const moeActive = (m: MoEConfig, width: number, expert: number): number => width * m.experts + (m.topK + m.sharedExperts) * expert;

/** The count for a config's model, or undefined for an architecture it does not know (a user's model). */
export function modelFlops(cfg: Pick<FlotillaConfig, 'model' | 'moe' | 'data'>): FlopCount | undefined {
  const m = modelConfigOf(cfg), T = cfg.data.seqLen;
  let n = 0, layers = 0, dAttn = 0, keys = T;
  if (m.arch === 'gpt') {
    const c = checkGPTConfig(m), C = c.nEmbd;
    layers = c.nLayer;
    dAttn = C;
    for (let i = 0; i < c.nLayer; i++) {
      n += 4 * C * C; // qkv (C x 3C) and the output projection (C x C)
      n += isMoELayer(c.moe, i) ? moeActive(c.moe!, C, 2 * C * (c.moe!.hidden || 4 * C)) : 8 * C * C;
    }
    n += C * c.vocabSize;
  } else if (m.arch === 'llama') {
    const c = resolveLlamaConfig(m), C = c.nEmbd, A = c.nHead * c.headDim, KV = c.nKvHead * c.headDim, I = c.intermediateSize;
    layers = c.nLayer;
    dAttn = A;
    if (c.slidingWindow > 0) keys = Math.min(T, c.slidingWindow);
    for (let i = 0; i < c.nLayer; i++) {
      n += C * A + 2 * C * KV + A * C; // q, k, v, o
      n += isMoELayer(c.moe, i) ? moeActive(c.moe!, C, 3 * C * (c.moe!.hidden || I)) : 3 * C * I; // SwiGLU: gate, up, down
    }
    n += C * c.vocabSize;
  } else {
    return undefined;
  }
  const attention = 12 * layers * keys * dAttn;
  return { matmulParams: n, attention, perToken: 6 * n + attention };
}

/** Achieved model TFLOP/s per rank and the MFU, from a step's global tokens/s. */
export function mfuOf(flopsPerToken: number, tokensPerSec: number, ranks: number, peakTflops: number): { tflops: number; mfu: number } {
  const tflops = (flopsPerToken * tokensPerSec) / ranks / 1e12;
  return { tflops, mfu: tflops / peakTflops };
}
