// A Llama-family decoder (Llama 2/3, Mistral-style shapes): RMSNorm pre-norm blocks, rotary
// positions (transformers' rotate-half convention, so Hugging Face weights load without any
// permutation), grouped-query attention and a SwiGLU MLP, optionally tied head; as options, Qwen2's
// and Qwen3's attention biases and Qwen3's per-head query and key norms. Built
// from flotilla's own layers, with the GPT's conventions (src/models/gpt.ts): every parameter drawn
// from (initSeed, its whole-model name), deferInit for ZeRO-3, and a pipeline stage is "the model
// minus what it does not own" (LlamaStage). Its layouts' plans are in llama_parallel.ts.
//
// Module names (the Hugging Face name map depends on them):
//   wte                            model.embed_tokens
//   layers.{i}.attnNorm            model.layers.{i}.input_layernorm
//   layers.{i}.attn.{q,k,v,o}      model.layers.{i}.self_attn.{q,k,v,o}_proj
//   layers.{i}.attn.{qNorm,kNorm}  model.layers.{i}.self_attn.{q,k}_norm (Qwen3)
//   layers.{i}.mlpNorm             model.layers.{i}.post_attention_layernorm
//   layers.{i}.mlp.{gate,up,down}  model.layers.{i}.mlp.{gate,up,down}_proj
//   norm                           model.norm
//   head                           lm_head (absent when tied: it reuses wte.weight)
import { type Tensor, type DType, cat, keep, noGrad, ones, tensor, isGradEnabled, zerosLike } from '../tensor/index.js';
import { seedParameter } from '../nn/init.js';
import { Module, Embedding, Linear, RMSNorm, Dropout, deferParameters } from '../nn/index.js';
import { castFor } from '../nn/precision.js';
import { LMHead, runHead } from '../nn/kernels/lm_head.js';
import { activationCheckpointMode, checkpointBlock, checkpointRegion } from '../nn/checkpoint.js';
import { gptLoss, type GPTBuildOptions, type GPTStageSpec } from './gpt.js';
import { KVCache } from '../nn/kv_cache.js';
import { sequenceShard } from '../nn/sequence_shard.js';
import { documents } from '../nn/documents.js';
import { kernelChoice } from '../nn/kernels/choice.js';
import { fusedRotary, fusedSwiglu } from '../nn/kernels/pointwise.js';
import { fusedAttention } from '../nn/kernels/attention.js';
import { MoE } from '../nn/moe.js';
import { isMoELayer, type MoEConfig } from '../nn/moe_config.js';
import { layerWindow, resolveLlamaConfig, type LlamaConfig } from './llama_config.js';

export { defaultLlamaConfig, llamaIntermediateSize, llamaNumParams, resolveLlamaConfig, type LlamaConfig } from './llama_config.js';

/**
 * Rotary inverse frequencies, 1 / theta^(2i / headDim), with Llama 3.1's scaling when asked
 * (transformers' _compute_llama3_parameters: long wavelengths divided by factor, short ones kept,
 * a smooth blend between).
 */
export function ropeInverseFrequencies(c: Pick<LlamaConfig, 'headDim' | 'ropeTheta' | 'ropeScaling' | 'ropeFactor' | 'ropeLowFreqFactor' | 'ropeHighFreqFactor' | 'ropeOriginalMaxPositions'>): number[] {
  const half = c.headDim / 2;
  // As transformers computes it: the exponent in float32, the power in float32.
  const f32 = (x: number) => Math.fround(x);
  const inv = Array.from({ length: half }, (_, i) => f32(1 / f32(c.ropeTheta ** f32((2 * i) / c.headDim))));
  if (c.ropeScaling !== 'llama3') return inv;
  const old = c.ropeOriginalMaxPositions, lo = c.ropeLowFreqFactor, hi = c.ropeHighFreqFactor, factor = c.ropeFactor;
  const lowWavelen = old / lo, highWavelen = old / hi;
  return inv.map((f) => {
    const wavelen = (2 * Math.PI) / f;
    if (wavelen < highWavelen) return f;
    if (wavelen > lowWavelen) return f / factor;
    const smooth = (old / wavelen - lo) / (hi - lo);
    return (1 - smooth) * (f / factor) + smooth * f;
  });
}

/**
 * The tables of one model (or stage), shared by its attention layers: the causal mask bias, and cos and sin of
 * position x frequency for every position up to blockSize, (blockSize, headDim) in float32 (float64
 * for a float64 model), made on first use. Under bf16-mixed the rotation runs on float32 q and k,
 * as autocast-era Llama code does. The sin table holds -sin on its first half, so that
 * x * cos + rotateHalf(x) * sin is x * cos + swapHalves(x) * sinSigned (no negation pass).
 */
export class RotaryTables {
  private readonly invFreq: number[];
  private readonly tables = new Map<DType, { cos: Tensor; sinSigned: Tensor }>();
  private readonly biases = new Map<string, Tensor>();
  constructor(readonly cfg: LlamaConfig) {
    this.invFreq = ropeInverseFrequencies(cfg);
  }

  /** cos and signed sin for positions [offset, offset + T), (T, headDim), in `dtype`. */
  slice(dtype: DType, offset: number, T: number): { cos: Tensor; sinSigned: Tensor } {
    if (offset + T > this.cfg.blockSize) throw new Error(`Llama: positions up to ${offset + T} exceed blockSize ${this.cfg.blockSize}`);
    let t = this.tables.get(dtype);
    if (!t) {
      t = noGrad(() => this.build(dtype));
      this.tables.set(dtype, t);
    }
    return { cos: t.cos.narrow(0, offset, T), sinSigned: t.sinSigned.narrow(0, offset, T) };
  }

  /** cos and signed sin at any positions (B, T) int64 (rows of a batch at different offsets): (B, T, headDim). */
  at(dtype: DType, positions: Tensor): { cos: Tensor; sinSigned: Tensor } {
    const [B, T] = positions.shape as [number, number];
    const { cos, sinSigned } = this.slice(dtype, 0, this.cfg.blockSize);
    const flat = positions.reshape(B * T);
    return { cos: cos.indexSelect(0, flat).view(B, T, -1), sinSigned: sinSigned.indexSelect(0, flat).view(B, T, -1) };
  }

  private build(dtype: DType): { cos: Tensor; sinSigned: Tensor } {
    const P = this.cfg.blockSize, half = this.invFreq.length, D = 2 * half;
    const cos = new Float64Array(P * D), sin = new Float64Array(P * D);
    // The angle is rounded as the table's dtype would compute position x frequency (float32 in transformers).
    const round = dtype === 'float64' ? (x: number) => x : Math.fround;
    const inv = this.invFreq.map(round);
    for (let p = 0; p < P; p++) {
      for (let i = 0; i < half; i++) {
        const a = round(p * inv[i]!);
        const c = Math.cos(a), s = Math.sin(a);
        cos[p * D + i] = c;
        cos[p * D + half + i] = c;
        sin[p * D + i] = -s;
        sin[p * D + half + i] = s;
      }
    }
    const make = (a: Float64Array) => {
      const t = tensor(a, { shape: [P, D] });
      const r = t.to(dtype);
      if (r !== t) t.dispose();
      return keep(r);
    };
    return { cos: make(cos), sinSigned: make(sin) };
  }

  /**
   * The causal mask as an additive bias for `group` query heads stacked along the rows: (group T, T),
   * 0 where a query may see a key and -inf where not; with a sliding `window` W > 0 (the block's:
   * layerWindow) query i sees keys j with i - W < j <= i only. Kept per (dtype, T, group, W).
   */
  causalBias(dtype: DType, T: number, group: number, window: number): Tensor {
    const key = `${dtype}:${T}:${group}:${window}`;
    let b = this.biases.get(key);
    if (!b) {
      b = noGrad(() => {
        const W = window;
        const allowed = W > 0 ? ones([T, T], { dtype: 'bool' }).tril().triu(-(W - 1)) : ones([T, T], { dtype: 'bool' }).tril();
        return keep(zerosLike(allowed, { dtype }).maskedFill(allowed.logicalNot(), -Infinity).repeat(group, 1));
      });
      this.biases.set(key, b);
    }
    return b;
  }

  dispose(): void {
    for (const t of this.tables.values()) {
      t.cos.dispose();
      t.sinSigned.dispose();
    }
    for (const b of this.biases.values()) b.dispose();
    this.tables.clear();
    this.biases.clear();
  }
}

/**
 * x (..., T, nh, hd) rotated by its positions: x * cos + rotateHalf(x) * sin, with rotateHalf(x) =
 * (-x2, x1) for halves x1, x2 (transformers' apply_rotary_pos_emb). cos, sinSigned: (T, hd).
 */
export function applyRotary(x: Tensor, cos: Tensor, sinSigned: Tensor): Tensor {
  const hd = x.shape[x.ndim - 1]!, half = hd / 2;
  const swapped = cat([x.narrow(-1, half, half), x.narrow(-1, 0, half)], -1);
  const c = cos.unsqueeze(-2), s = sinSigned.unsqueeze(-2); // (T, 1, hd) or (B, T, 1, hd): broadcast over heads
  return x.mul(c).addcmul(swapped, s); // one pass for the product and the sum
}

export interface LlamaLayerConfig {
  nEmbd: number;
  nHead: number;
  nKvHead: number;
  headDim: number;
  intermediateSize: number;
  rmsNormEps: number;
  dropout: number;
  /** Biases of the attention projections (q, k, v; o too with 'all'). */
  attnBias?: LlamaConfig['attnBias'];
  /** RMSNorm of each query and key head before rotary (Qwen3). */
  qkNorm?: boolean;
  /** Mixture-of-experts settings; a block built with `{ moe: true }` uses them for its MLP. */
  moe?: MoEConfig;
}

/** What differs between a Llama's blocks (decided by the block's global index, llama_config.ts / moe_config.ts). */
export interface LlamaBlockOptions {
  /** An MoE MLP (cfg.moe's settings). */
  moe?: boolean;
  /** Sliding attention window of this block (layerWindow); 0 = full causal attention. */
  window?: number;
}

/**
 * Causal grouped-query self-attention with rotary positions. It sizes its work from its
 * projections' outputs (tensor parallelism leaves this rank nHead / tp query heads and
 * nKvHead / tp key/value heads; the group size is unchanged), and its core takes q, k, v and the
 * position offset, so that a key/value cache can feed it later.
 */
export class LlamaAttention extends Module {
  readonly q: Linear;
  readonly k: Linear;
  readonly v: Linear;
  readonly o: Linear;
  readonly attnDrop: Dropout;
  readonly headDim: number;
  /** Qwen3's norms of each query and key head (weights of headDim, shared by the heads). */
  readonly qNorm?: RMSNorm;
  readonly kNorm?: RMSNorm;
  /** This block's sliding window (0 = full causal attention): training, the cp ring and generation read it. */
  readonly window: number;

  constructor(cfg: LlamaLayerConfig, readonly rope: RotaryTables, window = 0) {
    super();
    this.window = window;
    const C = cfg.nEmbd, hd = (this.headDim = cfg.headDim);
    const qkv = (cfg.attnBias ?? 'none') !== 'none', o = cfg.attnBias === 'all';
    this.q = this.registerModule('q', new Linear(C, cfg.nHead * hd, { bias: qkv }));
    this.k = this.registerModule('k', new Linear(C, cfg.nKvHead * hd, { bias: qkv }));
    this.v = this.registerModule('v', new Linear(C, cfg.nKvHead * hd, { bias: qkv }));
    this.o = this.registerModule('o', new Linear(cfg.nHead * hd, C, { bias: o }));
    this.attnDrop = this.registerModule('attnDrop', new Dropout(cfg.dropout));
    if (cfg.qkNorm) {
      this.qNorm = this.registerModule('qNorm', new RMSNorm(hd, cfg.rmsNormEps));
      this.kNorm = this.registerModule('kNorm', new RMSNorm(hd, cfg.rmsNormEps));
    }
  }

  /** q (B, T, nh hd) and k (B, T, nkv hd) with each head normed (Qwen3), else as given. */
  normHeads(q: Tensor, k: Tensor): [Tensor, Tensor] {
    if (!this.qNorm) return [q, k];
    const hd = this.headDim;
    const per = (n: RMSNorm, t: Tensor) => {
      const [B, T, W] = t.shape as [number, number, number];
      return n.call(t.view(B, T, W / hd, hd)).view(B, T, W);
    };
    return [per(this.qNorm, q), per(this.kNorm!, k)];
  }

  /** x: (B, T, C) at positions offset .. offset + T - 1. */
  forward(x: Tensor, offset = 0): Tensor {
    // One cast of the normed input for q, k and v (their own casts are then no-ops): under
    // bf16-mixed that is two casts fewer each way than autocast's cast per op, for one more
    // bfloat16 rounding of the input's gradient (summed in bfloat16; autocast sums in float32).
    // (Under tp the plan's prepareInput casts before communicating, and this cast is a no-op.)
    const [xc] = castFor('linear', x) as [Tensor];
    const [q, k] = this.normHeads(this.q.call(xc), this.k.call(xc)), v = this.v.call(xc);
    // Selective checkpointing recomputes the core (rotary, scores, softmax) in backward; it has no parameters.
    const y = activationCheckpointMode() === 'selective' && isGradEnabled()
      ? checkpointRegion(this, [q, k, v], (a, b, c) => this.core(a, b, c, offset), () => [], { dropout: this.attnDrop.p > 0 })
      : this.core(q, k, v, offset);
    return this.o.call(y);
  }

  /**
   * q (B, T, nh hd), k and v (B, T, nkv hd), the projections' outputs, to the heads' concatenated
   * output (B, T, nh hd). `positions`: an offset (the tokens are at offset .. offset + T - 1), or
   * each token's position (B, T) int64.
   */
  core(q: Tensor, k: Tensor, v: Tensor, positions: number | Tensor = 0): Tensor {
    const [B, T, Cq] = q.shape as [number, number, number];
    const hd = this.headDim, nh = Cq / hd, nkv = k.shape[2]! / hd, group = nh / nkv;
    // Rotary in float32 at least (float64 for a float64 model), whatever dtype the projections ran in.
    const rd: DType = q.dtype === 'float64' ? 'float64' : 'float32';
    // Under context parallelism the tokens are chunks of longer sequences, rotated at their global
    // positions, and attention over the whole sequence comes from the shard ([Note: sequence shard]).
    // Packed rows restart positions at each document ([Note: documents]; under a shard, this rank's chunks of them).
    const shard = sequenceShard(), docs = documents(), window = this.window;
    const { cos, sinSigned } = docs ? this.rope.at(rd, docs.positions)
      : shard ? this.rope.at(rd, shard.positions(T).view(1, T))
        : typeof positions === 'number' ? this.rope.slice(rd, positions, T) : this.rope.at(rd, positions);
    // bfloat16 q, k times float32 tables promote to float32 in the same kernels (no separate cast).
    const fused = kernelChoice() === 'fused';
    const rot = (t: Tensor, n: number) => (fused ? fusedRotary : applyRotary)(t.view(B, T, n, hd), cos, sinSigned);
    // Cast before the heads are made contiguous, so that copy moves bfloat16 under bf16-mixed.
    const [qr, kr] = castFor('matmul', rot(q, nh), rot(k, nkv)) as [Tensor, Tensor];
    if (shard) {
      const [vc] = castFor('matmul', v) as [Tensor];
      const heads = (t: Tensor) => t.transpose(1, 2); // (B, n, T, hd)
      return shard.attention(heads(qr), heads(kr), heads(vc.view(B, T, nkv, hd)), 1 / Math.sqrt(hd), window).transpose(1, 2).reshape(B, T, nh * hd);
    }
    // The fused kernel ([Note: kernel choice]): the heads as they are, kv heads read in place, the
    // documents and window as its arguments; memory linear in T.
    if (fused && (this.attnDrop.p === 0 || !this.attnDrop.training)) {
      const [vc] = castFor('matmul', v) as [Tensor];
      const heads = (t: Tensor, n: number) => t.view(B, T, n, hd).transpose(1, 2); // (B, n, T, hd)
      const y = fusedAttention(heads(qr, nh), heads(kr, nkv), heads(vc, nkv), { window, qDocs: docs?.ids, kDocs: docs?.ids });
      return y.transpose(1, 2).reshape(B, T, nh * hd);
    }
    // Query head h uses key/value head h / group (repeat_kv's order): the group's query heads are
    // stacked along the rows, so k and v are never repeated. q: (B nkv, group T, hd), k^T: (B nkv, hd, T).
    const qg = qr.view(B, T, nkv, group, hd).permute(0, 2, 3, 1, 4).reshape(B * nkv, group * T, hd);
    const kt = kr.transpose(1, 2).reshape(B * nkv, T, hd).transpose(1, 2);
    // One baddbmm: the scale is the GEMM's alpha (applied to the accumulated product, as matmul then
    // mul would), the causal mask an additive 0 / -inf bias: no separate passes over the (T, T) scores.
    // Packed rows: causal within each document (and its window), a bias per row, kept for every layer.
    const bias = docs ? docs.bias(qg.dtype, nkv, group, window) : this.rope.causalBias(qg.dtype, T, group, window).expand(B * nkv, group * T, T);
    let att = bias
      .baddbmm(qg, kt, { alpha: 1 / Math.sqrt(hd) })
      .view(B, nh, T, T);
    let vh = v.view(B, T, nkv, hd).transpose(1, 2);
    [att] = castFor('softmax', att) as [Tensor];
    att = this.attnDrop.call(att.softmax(-1));
    [att, vh] = castFor('matmul', att, vh) as [Tensor, Tensor];
    const y = att.view(B, nkv, group * T, T).matmul(vh); // (B, nkv, group T, hd)
    return y.view(B, nh, T, hd).transpose(1, 2).reshape(B, T, nh * hd);
  }
}

/**
 * Generation: the attention of new tokens x (B, T, C) over the cache's keys and values and their
 * own ([Note: kv cache] in src/nn/kv_cache.ts); keys are stored rotated, at each row's positions.
 */
export function llamaAttentionDecode(a: LlamaAttention, x: Tensor, cache: KVCache, layer: number, allowed: Tensor | undefined): Tensor {
  const [q, k] = a.normHeads(a.q.call(x), a.k.call(x)), v = a.v.call(x);
  const [B, T, Cq] = q.shape as [number, number, number];
  const hd = a.headDim, nh = Cq / hd, nkv = k.shape[2]! / hd, group = nh / nkv;
  const rd: DType = q.dtype === 'float64' ? 'float64' : 'float32';
  // Without padding every row is at the same positions: two views of the tables, no gather.
  const { cos, sinSigned } = cache.isPadded ? a.rope.at(rd, cache.positions(T)) : a.rope.slice(rd, cache.length, T);
  // Under fused kernels the one-pass rotary ([Note: kernel choice]), which computes in the promoted dtype itself.
  const fused = kernelChoice() === 'fused';
  const rot = (t: Tensor, n: number) => (fused
    ? fusedRotary(t.view(B, T, n, hd), cos, sinSigned)
    : applyRotary((t.dtype === rd ? t : t.to(rd)).view(B, T, n, hd), cos, sinSigned)).to(q.dtype);
  const qh = rot(q, nh).transpose(1, 2); // (B, nh, T, hd)
  const [K, V] = cache.append(layer, rot(k, nkv).transpose(1, 2), v.view(B, T, nkv, hd).transpose(1, 2)); // (B, nkv, Tk, hd)
  const Tk = K.shape[2]!;
  if (fused) {
    // The fused kernel ([Note: kernel choice]): kv heads read in place, the new queries at the
    // cache's positions, the window its argument, padding as documents (built once per step by the cache).
    const [qc, kc, vc] = castFor('matmul', qh, K, V) as [Tensor, Tensor, Tensor];
    const docs = cache.documentIds(T);
    const y = fusedAttention(qc, kc, vc, { offset: cache.length, window: a.rope.cfg.slidingWindow, qDocs: docs?.q, kDocs: docs?.k });
    return a.o.call(y.transpose(1, 2).reshape(B, T, nh * hd));
  }
  const [qg, kc] = castFor('matmul', qh.reshape(B, nkv, group * T, hd), K) as [Tensor, Tensor];
  let att = qg.matmul(kc.transpose(-2, -1)).view(B, nh, T, Tk).mul(1 / Math.sqrt(hd));
  if (allowed) att = att.maskedFill(allowed.logicalNot(), -Infinity);
  [att] = castFor('softmax', att) as [Tensor];
  const [p, vc] = castFor('matmul', att.softmax(-1), V) as [Tensor, Tensor];
  const y = p.view(B, nkv, group * T, Tk).matmul(vc); // (B, nkv, group T, hd)
  return a.o.call(y.view(B, nh, T, hd).transpose(1, 2).reshape(B, T, nh * hd));
}

/** The SwiGLU MLP: down(silu(gate(x)) * up(x)). */
export class LlamaMLP extends Module {
  readonly gate: Linear;
  readonly up: Linear;
  readonly down: Linear;
  constructor(cfg: LlamaLayerConfig) {
    super();
    this.gate = this.registerModule('gate', new Linear(cfg.nEmbd, cfg.intermediateSize, { bias: false }));
    this.up = this.registerModule('up', new Linear(cfg.nEmbd, cfg.intermediateSize, { bias: false }));
    this.down = this.registerModule('down', new Linear(cfg.intermediateSize, cfg.nEmbd, { bias: false }));
  }
  forward(x: Tensor): Tensor {
    // One cast for gate and up (as in LlamaAttention.forward); silu and the product in the
    // policy's dtype for SwiGLU (float32 under bf16-mixed), rounded once by down's cast.
    const [xc] = castFor('linear', x) as [Tensor];
    const [g] = castFor('swiglu', this.gate.call(xc)) as [Tensor];
    // Elementwise, so under tensor parallelism each rank's column shards of gate and up fuse alone.
    const up = this.up.call(xc);
    return this.down.call(kernelChoice() === 'fused' ? fusedSwiglu(g, up) : g.silu().mul(up));
  }
}

/** Pre-norm Llama block: x + attn(attnNorm(x)), then x + mlp(mlpNorm(x)); the MLP is a mixture of SwiGLU experts with `{ moe: true }`. */
export class LlamaBlock extends Module {
  readonly attnNorm: RMSNorm;
  readonly attn: LlamaAttention;
  readonly mlpNorm: RMSNorm;
  readonly mlp: LlamaMLP | MoE;
  readonly dropout: number;
  constructor(cfg: LlamaLayerConfig, rope: RotaryTables, opts: LlamaBlockOptions = {}) {
    super();
    this.attnNorm = this.registerModule('attnNorm', new RMSNorm(cfg.nEmbd, cfg.rmsNormEps));
    this.attn = this.registerModule('attn', new LlamaAttention(cfg, rope, opts.window ?? 0));
    this.mlpNorm = this.registerModule('mlpNorm', new RMSNorm(cfg.nEmbd, cfg.rmsNormEps));
    if (opts.moe && !cfg.moe) throw new Error('LlamaBlock: { moe: true } needs cfg.moe (the mixture-of-experts settings)');
    this.mlp = this.registerModule('mlp', opts.moe ? new MoE(cfg.moe!, cfg.nEmbd, cfg.intermediateSize, 'swiglu', false) : new LlamaMLP(cfg));
    this.dropout = cfg.dropout;
  }
  /** Full activation checkpointing wraps the whole block inside call() (see Block in src/nn/transformer.ts). */
  forward(x: Tensor, offset = 0): Tensor {
    if (activationCheckpointMode() === 'full' && isGradEnabled()) {
      return checkpointBlock(this, x, (y) => this.body(y, offset), { dropout: this.dropout > 0 });
    }
    return this.body(x, offset);
  }
  private body(x: Tensor, offset: number): Tensor {
    const h = x.add(this.attn.call(this.attnNorm.call(x), offset));
    return h.add(this.mlp.call(this.mlpNorm.call(h)));
  }
}

/** A run of blocks registered under their global indices ("2", "3", ...). */
export class LlamaLayers extends Module {
  constructor(readonly first: number, readonly items: LlamaBlock[]) {
    super();
    items.forEach((b, i) => this.registerModule(String(first + i), b));
  }
}


/** What a whole Llama or one stage of it is made of; forward lives in the subclasses. */
abstract class LlamaParts extends Module {
  readonly cfg: LlamaConfig;
  readonly spec: GPTStageSpec;
  readonly rope: RotaryTables;
  readonly wte?: Embedding;
  readonly layers!: LlamaLayers;
  readonly norm?: RMSNorm;
  readonly head?: LMHead;

  protected constructor(cfg: Partial<LlamaConfig>, spec: GPTStageSpec, opts: GPTBuildOptions) {
    super();
    const c = (this.cfg = resolveLlamaConfig(cfg));
    const [first, end] = spec.layers;
    if (!Number.isInteger(first) || !Number.isInteger(end) || first < 0 || end > c.nLayer || first > end) {
      throw new Error(`Llama stage: layers [${first}, ${end}) are not a range of the model's ${c.nLayer} blocks`);
    }
    this.spec = { layers: [first, end], embed: spec.embed, head: spec.head };
    this.rope = new RotaryTables(c);
    if (opts.deferInit && opts.initSeed === undefined) {
      throw new Error('Llama: deferInit needs initSeed (each parameter is initialised later from the seed and its name): pass { initSeed, deferInit: true }');
    }
    if (opts.deferInit) {
      deferParameters(() => this.buildParts(c));
      const seed = opts.initSeed!;
      this.deferredInit = { init: (name, out) => noGrad(() => this.initParameter(this.fullName(name), out, seed)) };
    } else {
      this.buildParts(c);
      noGrad(() => {
        for (const [local, p] of this.namedParameters()) this.initParameter(this.fullName(local), p, opts.initSeed);
      });
    }
  }

  private buildParts(c: LlamaConfig): void {
    const [first, end] = this.spec.layers;
    const self = this as { -readonly [K in 'wte' | 'layers' | 'norm' | 'head']: LlamaParts[K] };
    if (this.spec.embed) self.wte = this.registerModule('wte', new Embedding(c.vocabSize, c.nEmbd));
    self.layers = this.registerModule('layers', new LlamaLayers(first, Array.from({ length: end - first }, (_, i) => new LlamaBlock(c, this.rope, { moe: isMoELayer(c.moe, first + i), window: layerWindow(c, first + i) }))));
    if (this.spec.head) {
      self.norm = this.registerModule('norm', new RMSNorm(c.nEmbd, c.rmsNormEps));
      // Tied: the head reuses the embedding matrix; a last stage without the embedding holds a copy
      // the pipeline keeps equal (declared tied in llama_parallel.ts).
      const shared = c.tieEmbeddings ? this.wte?.weight : undefined;
      self.head = this.registerModule('head', new LMHead(c.nEmbd, c.vocabSize, { bias: false, weight: shared }));
    }
  }

  /** True when this stage's head holds its own copy of a weight tied to the first stage's embedding. */
  get hasTiedHeadCopy(): boolean {
    return this.cfg.tieEmbeddings && this.spec.head && !this.spec.embed;
  }

  /** The parameter's name in the whole model (the tied head copy is 'wte.weight'). */
  fullName(localName: string): string {
    return this.hasTiedHeadCopy && localName === 'head.weight' ? 'wte.weight' : localName;
  }

  /** transformers' Llama init: N(0, 0.02) matrices, RMSNorm weights 1, biases 0; seeded by name when initSeed is given. */
  private initParameter(name: string, p: Tensor, initSeed: number | undefined): void {
    if (initSeed !== undefined) seedParameter(initSeed, name);
    if (/(^|\.)(attnNorm|mlpNorm|norm|qNorm|kNorm)\.weight$/.test(name)) p.fill_(1);
    else if (name.endsWith('.bias')) p.zero_();
    else p.normal_(0, 0.02);
  }

  /** Token ids (B, T) where this part embeds, else hidden states (B, T, C); logits where it holds the head. */
  protected runParts(input: Tensor): Tensor {
    let x = input;
    if (this.wte) {
      const T = input.shape[1]!;
      if (T > this.cfg.blockSize) throw new Error(`Llama: sequence length ${T} exceeds blockSize ${this.cfg.blockSize}`);
      x = this.wte.call(input);
    }
    for (const b of this.layers.items) x = b.call(x);
    if (this.head) x = runHead(this.head, this.norm!.call(x)); // [Note: deferred head]
    return x;
  }

  dispose(): void {
    super.dispose();
    this.rope.dispose();
  }
}

/** The whole Llama on one process. */
export class Llama extends LlamaParts {
  declare readonly wte: Embedding;
  declare readonly norm: RMSNorm;
  declare readonly head: LMHead;

  constructor(cfg: Partial<LlamaConfig> = {}, opts: GPTBuildOptions = {}) {
    const c = resolveLlamaConfig(cfg);
    super(c, { layers: [0, c.nLayer], embed: true, head: true }, opts);
  }

  /** Generation's cache for this model: one layer per block, at most blockSize positions. */
  newCache(batch: number, maxLen = this.cfg.blockSize, pad?: readonly number[]): KVCache {
    return new KVCache(this.cfg.nLayer, batch, Math.min(maxLen, this.cfg.blockSize), pad);
  }

  /** Longest context the model takes (its rotary tables). */
  get contextLength(): number {
    return this.cfg.blockSize;
  }

  /** Generation: logits (B, T, vocab) of the new tokens, earlier ones' keys and values from the cache, which then holds these too. */
  decode(idx: Tensor, cache: KVCache): Tensor {
    const T = idx.shape[1]!;
    if (cache.length + T > this.cfg.blockSize) throw new Error(`Llama: ${cache.length + T} positions exceed blockSize ${this.cfg.blockSize}`);
    let x = this.wte.call(idx);
    // A sliding window masks keys older than the window; the cache keeps them (memory as without one).
    // Blocks may differ in window (model.windowFrom): one mask per window.
    const allowed = new Map<number, Tensor | undefined>();
    this.layers.items.forEach((b, i) => {
      const w = b.attn.window;
      if (!allowed.has(w)) allowed.set(w, cache.allowed(T, w));
      const h = x.add(llamaAttentionDecode(b.attn, b.attnNorm.call(x), cache, i, allowed.get(w)));
      x = h.add(b.mlp.call(b.mlpNorm.call(h)));
    });
    cache.advance(T);
    return this.head.call(this.norm.call(x));
  }

  /** idx: (B, T) int64 token ids. With targets (B, T) also returns the mean cross-entropy loss. */
  forward(idx: Tensor, targets?: Tensor): { logits: Tensor; loss?: Tensor } {
    const logits = this.runParts(idx);
    if (!targets) return { logits };
    return { logits, loss: gptLoss(logits, targets) };
  }
}

/** One pipeline stage of a Llama: only the parts `spec` names are built. */
export class LlamaStage extends LlamaParts {
  constructor(cfg: Partial<LlamaConfig>, spec: GPTStageSpec, opts: GPTBuildOptions = {}) {
    super(cfg, spec, opts);
  }
  forward(input: Tensor): Tensor {
    return this.runParts(input);
  }
}
