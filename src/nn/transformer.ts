// Transformer pieces for decoder-only models: causal self-attention, MLP, pre-norm block.
import { Tensor, ones, isGradEnabled } from '../tensor/index.js';
import { attentionScores } from './functional.js';
import { Module } from './module.js';
import { Linear, LayerNorm, Dropout } from './layers.js';
import { castFor } from './precision.js';
import { activationCheckpointMode, checkpointBlock, checkpointRegion } from './checkpoint.js';
import type { KVCache } from './kv_cache.js';
import { MoE } from './moe.js';
import { sequenceShard } from './sequence_shard.js';
import { documents } from './documents.js';
import { kernelChoice } from './kernels/choice.js';
import { fusedGelu } from './kernels/pointwise.js';
import { fusedAttention } from './kernels/attention.js';
import type { MoEConfig } from './moe_config.js';

export interface BlockConfig {
  nEmbd: number;
  nHead: number;
  blockSize: number;
  dropout: number;
  bias: boolean;
  /** The MLP's GELU: 'exact' (erf; the default) or 'tanh' (GPT-2's approximation). */
  gelu?: 'exact' | 'tanh';
  /** Mixture-of-experts settings; a block built with `{ moe: true }` uses them for its MLP. */
  moe?: MoEConfig;
}

export class CausalSelfAttention extends Module {
  readonly qkv: Linear;
  readonly proj: Linear;
  readonly attnDrop: Dropout;
  readonly residDrop: Dropout;
  readonly mask: Tensor; // (blockSize, blockSize) bool, true where attention is allowed
  readonly nHead: number;
  readonly nEmbd: number;

  constructor(cfg: BlockConfig) {
    super();
    if (cfg.nEmbd % cfg.nHead !== 0) throw new Error(`nEmbd (${cfg.nEmbd}) must be divisible by nHead (${cfg.nHead})`);
    this.nHead = cfg.nHead;
    this.nEmbd = cfg.nEmbd;
    this.qkv = this.registerModule('qkv', new Linear(cfg.nEmbd, 3 * cfg.nEmbd, { bias: cfg.bias }));
    this.proj = this.registerModule('proj', new Linear(cfg.nEmbd, cfg.nEmbd, { bias: cfg.bias }));
    this.attnDrop = this.registerModule('attnDrop', new Dropout(cfg.dropout));
    this.residDrop = this.registerModule('residDrop', new Dropout(cfg.dropout));
    const m = ones([cfg.blockSize, cfg.blockSize], { dtype: 'bool' });
    this.mask = this.registerBuffer('mask', m.tril());
    m.dispose();
  }

  forward(x: Tensor): Tensor {
    const qkv = this.qkv.call(x);
    // Selective activation checkpointing recomputes this core in backward ([Note: selective
    // checkpointing] in src/nn/checkpoint.ts); it has no parameters.
    const y = activationCheckpointMode() === 'selective' && isGradEnabled()
      ? checkpointRegion(this, [qkv], (t) => this.core(t), () => [], { dropout: this.attnDrop.p > 0 })
      : this.core(qkv);
    return this.residDrop.call(this.proj.call(y));
  }

  /**
   * Generation: x (B, T, C) holds the new tokens only; the earlier ones' keys and values come from
   * the cache, which keeps these ([Note: kv cache] in kv_cache.ts). `allowed` (B, 1, T, Tk) is
   * the cache's mask for this step, shared by every layer.
   */
  decode(x: Tensor, cache: KVCache, layer: number, allowed: Tensor | undefined): Tensor {
    // A token costs a few dozen small ops, so decoding spends as few as it can: q, k and v become
    // heads with one view, one permute and one unbind, not a split and a view and transpose each.
    const qkv = this.qkv.call(x);
    const [B, T, C3] = qkv.shape as [number, number, number];
    const hs = this.nEmbd / this.nHead, C = C3 / 3, nh = C / hs;
    const [q, k, v] = qkv.view(B, T, 3, nh, hs).permute(2, 0, 3, 1, 4).unbind(0) as [Tensor, Tensor, Tensor]; // (B, nh, T, hs) each
    const [K, V] = cache.append(layer, k, v); // (B, nh, Tk, hs)
    const [qh, kh] = castFor('matmul', q, K) as [Tensor, Tensor];
    if (kernelChoice() === 'fused') {
      // The fused kernel ([Note: kernel choice]): the new queries at the cache's positions, padding as documents.
      const [vh] = castFor('matmul', V) as [Tensor];
      const docs = cache.documentIds(T);
      const o = fusedAttention(qh, kh, vh, { offset: cache.length, qDocs: docs?.q, kDocs: docs?.k });
      return this.residDrop.call(this.proj.call(T === 1 ? o.view(B, 1, C) : o.transpose(1, 2).reshape(B, T, C)));
    }
    let att = qh.matmul(kh.transpose(-2, -1)).mul(1 / Math.sqrt(hs)); // (B, nh, T, Tk)
    if (allowed) att = att.maskedFill(allowed.logicalNot(), -Infinity);
    [att] = castFor('softmax', att) as [Tensor];
    const [attc, vh] = castFor('matmul', att.softmax(-1), V) as [Tensor, Tensor];
    const o = attc.matmul(vh); // (B, nh, T, hs), contiguous
    // One token's heads (B, nh, 1, hs) are already laid out as (B, 1, C).
    const y = T === 1 ? o.view(B, 1, C) : o.transpose(1, 2).reshape(B, T, C);
    return this.residDrop.call(this.proj.call(y));
  }

  /** Attention from the qkv projection's output to the heads' concatenated output (B, T, C). */
  private core(qkv: Tensor): Tensor {
    // Sizes come from the projection's output, not from x or the config: under tensor parallelism
    // qkv holds this rank's heads only, and with sequence parallelism x holds this rank's tokens.
    const [B, T, C3] = qkv.shape as [number, number, number];
    const hs = this.nEmbd / this.nHead, C = C3 / 3, nh = C / hs;
    const [q, k, v] = qkv.split(C, 2) as [Tensor, Tensor, Tensor];
    const heads = (t: Tensor) => t.view(B, T, nh, hs).transpose(1, 2); // (B, nh, T, hs)
    // Dtypes per op come from the precision policy (src/nn/precision.ts): under bf16-mixed the two
    // products and the softmax run in bfloat16.
    const [qh, kh] = castFor('matmul', heads(q), heads(k)) as [Tensor, Tensor];
    // A part of each sequence (context parallelism): attention over the whole sequence comes from
    // the shard ([Note: sequence shard] in sequence_shard.ts).
    const shard = sequenceShard();
    if (shard) {
      const [vh] = castFor('matmul', heads(v)) as [Tensor];
      return shard.attention(qh, kh, vh, 1 / Math.sqrt(hs)).transpose(1, 2).contiguous().view(B, T, C);
    }
    const docs = documents();
    // The fused kernel ([Note: kernel choice]): causal within each document from its ids.
    if (kernelChoice() === 'fused' && (this.attnDrop.p === 0 || !this.attnDrop.training)) {
      const [vh] = castFor('matmul', heads(v)) as [Tensor];
      return fusedAttention(qh, kh, vh, { qDocs: docs?.ids, kDocs: docs?.ids }).transpose(1, 2).contiguous().view(B, T, C);
    }
    // Packed rows ([Note: documents]): causal within each document, one mask for every layer.
    const allowed = docs ? docs.allowed() : this.mask.narrow(0, 0, T).narrow(1, 0, T);
    const bias = docs && qh.dtype === 'bfloat16' ? docs.bias('bfloat16', nh, 1) : undefined;
    let att = attentionScores(qh, kh, allowed, 1 / Math.sqrt(hs), bias); // (B, nh, T, T)
    [att] = castFor('softmax', att) as [Tensor];
    att = att.softmax(-1);
    att = this.attnDrop.call(att);
    const [attc, vh] = castFor('matmul', att, heads(v)) as [Tensor, Tensor];
    return attc.matmul(vh).transpose(1, 2).contiguous().view(B, T, C); // (B, T, C)
  }
}

export class MLP extends Module {
  readonly fc: Linear;
  readonly proj: Linear;
  readonly drop: Dropout;
  readonly approximate: 'none' | 'tanh';
  constructor(cfg: BlockConfig) {
    super();
    this.approximate = cfg.gelu === 'tanh' ? 'tanh' : 'none';
    this.fc = this.registerModule('fc', new Linear(cfg.nEmbd, 4 * cfg.nEmbd, { bias: cfg.bias }));
    this.proj = this.registerModule('proj', new Linear(4 * cfg.nEmbd, cfg.nEmbd, { bias: cfg.bias }));
    this.drop = this.registerModule('drop', new Dropout(cfg.dropout));
  }
  forward(x: Tensor): Tensor {
    const [h] = castFor('gelu', this.fc.call(x)) as [Tensor];
    const a = kernelChoice() === 'fused' ? fusedGelu(h, this.approximate) : h.gelu(this.approximate);
    return this.drop.call(this.proj.call(a));
  }
}

/** Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)); the MLP is a mixture of experts with `{ moe: true }`. */
export class Block extends Module {
  readonly ln1: LayerNorm;
  readonly attn: CausalSelfAttention;
  readonly ln2: LayerNorm;
  readonly mlp: MLP | MoE;
  constructor(cfg: BlockConfig, opts: { moe?: boolean } = {}) {
    super();
    this.ln1 = this.registerModule('ln1', new LayerNorm(cfg.nEmbd, { bias: cfg.bias }));
    this.attn = this.registerModule('attn', new CausalSelfAttention(cfg));
    this.ln2 = this.registerModule('ln2', new LayerNorm(cfg.nEmbd, { bias: cfg.bias }));
    if (opts.moe && !cfg.moe) throw new Error('Block: { moe: true } needs cfg.moe (the mixture-of-experts settings)');
    this.mlp = this.registerModule('mlp', opts.moe
      ? new MoE(cfg.moe!, cfg.nEmbd, 4 * cfg.nEmbd, cfg.gelu === 'tanh' ? 'gelu-tanh' : 'gelu', cfg.bias, { dropout: cfg.dropout })
      : new MLP(cfg));
    this.dropout = cfg.dropout;
  }
  readonly dropout: number;
  /**
   * Inside call(), so a parallel wrapper's hooks are around it: under ZeRO-3 the parameters are
   * gathered while the checkpoint node is built, and its backward pre-hook regathers them before the
   * recompute ([Note: activation checkpoint]). "selective" is the attention's business.
   */
  forward(x: Tensor): Tensor {
    if (activationCheckpointMode() === 'full' && isGradEnabled()) {
      return checkpointBlock(this, x, (y) => this.body(y), { dropout: this.dropout > 0 });
    }
    return this.body(x);
  }
  private body(x: Tensor): Tensor {
    const h = x.add(this.attn.call(this.ln1.call(x)));
    return h.add(this.mlp.call(this.ln2.call(h)));
  }
  /** The block on new tokens, with earlier keys and values from the cache (CausalSelfAttention.decode). */
  decode(x: Tensor, cache: KVCache, layer: number, allowed: Tensor | undefined): Tensor {
    const h = x.add(this.attn.decode(this.ln1.call(x), cache, layer, allowed));
    return h.add(this.mlp.call(this.ln2.call(h)));
  }
}
