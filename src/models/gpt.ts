// The reference model: a GPT-2 style decoder (learned positions, pre-norm blocks, GELU MLP,
// optional tied input/output embedding). Layers are keyed by string ids ("layers.0", ...) and the
// embedding and head are separate, optional parts, so a pipeline stage is "the model minus what
// this stage does not own": GPTStage holds some blocks (named by their global index), the
// embeddings only on the first stage and the final norm + head only on the last. The loss lives
// outside forward (gptLoss), applied by whoever holds the head.
import { type Tensor, noGrad } from '../tensor/index.js';
import { seedParameter } from '../nn/init.js';
import { Module, Embedding, LayerNorm, Linear, Dropout, Block, F, deferParameters } from '../nn/index.js';
import { castFor } from '../nn/precision.js';
import { LMHead, runHead, headOutput } from '../nn/kernels/lm_head.js';
import { IGNORE_INDEX } from '../parallel/parallel_model.js';
import { isMoELayer } from '../nn/moe_config.js';
import { KVCache } from '../nn/kv_cache.js';
import { tokenPositions } from '../nn/sequence_shard.js';
import { checkGPTConfig as checkConfig, type GPTConfig } from './gpt_config.js';

export { defaultGPTConfig, gptNumParams, type GPTConfig } from './gpt_config.js';

/** Which parts of the GPT one pipeline stage holds. */
export interface GPTStageSpec {
  /** Blocks [first, end) by global index. */
  layers: readonly [number, number];
  /** Token and position embeddings (the first stage). */
  embed: boolean;
  /** Final norm and output head (the last stage). */
  head: boolean;
}

export interface GPTBuildOptions {
  /**
   * Initialise every parameter from its own generator state, seeded by (initSeed, full-model
   * name), instead of one draw sequence over the whole model. Any split into stages then gets
   * exactly the weights the whole model gets, without any rank building the whole model. Leaves
   * the global generator reseeded (call manualSeed afterwards for data).
   */
  initSeed?: number;
  /**
   * Build without giving the parameters memory ([Note: deferred init] in src/nn/module.ts): each
   * parameter's values come later from (initSeed, its name), when ZeRO-3 makes this rank's shards
   * a bucket at a time, or from materialize(). The weights are bit-identical to an eager build
   * with the same initSeed, which it needs.
   */
  deferInit?: boolean;
}

/** A run of blocks registered under their global indices ("2", "3", ...). */
export class BlockRange extends Module {
  readonly items: Block[];
  constructor(readonly first: number, blocks: Block[]) {
    super();
    this.items = blocks;
    blocks.forEach((b, i) => this.registerModule(String(first + i), b));
  }
}


/** The parts a GPT (or one stage of it) is made of; forward lives in the subclasses. */
abstract class GPTParts extends Module {
  readonly cfg: GPTConfig;
  readonly spec: GPTStageSpec;
  readonly wte?: Embedding;
  readonly wpe?: Embedding;
  readonly drop?: Dropout;
  readonly layers!: BlockRange;
  readonly lnF?: LayerNorm;
  readonly head?: LMHead;

  protected constructor(cfg: Partial<GPTConfig>, spec: GPTStageSpec, opts: GPTBuildOptions) {
    super();
    const c = (this.cfg = checkConfig(cfg));
    const [first, end] = spec.layers;
    if (!Number.isInteger(first) || !Number.isInteger(end) || first < 0 || end > c.nLayer || first > end) {
      throw new Error(`GPT stage: layers [${first}, ${end}) are not a range of the model's ${c.nLayer} blocks`);
    }
    this.spec = { layers: [first, end], embed: spec.embed, head: spec.head };
    if (opts.deferInit && opts.initSeed === undefined) {
      throw new Error('GPT: deferInit needs initSeed (each parameter is initialised later from the seed and its name): pass { initSeed, deferInit: true }');
    }
    if (opts.deferInit) {
      deferParameters(() => this.buildParts(c, spec));
      const seed = opts.initSeed!;
      this.deferredInit = { init: (name, out) => noGrad(() => this.initParameter(this.fullName(name), out, seed)) };
    } else {
      this.buildParts(c, spec);
      this.initWeights(opts.initSeed);
    }
  }

  private buildParts(c: GPTConfig, spec: GPTStageSpec): void {
    const [first, end] = spec.layers;
    // The parts are assigned once, here (the constructor's only caller): readonly from outside.
    const self = this as { -readonly [K in 'wte' | 'wpe' | 'drop' | 'layers' | 'lnF' | 'head']: GPTParts[K] };
    if (spec.embed) {
      self.wte = this.registerModule('wte', new Embedding(c.vocabSize, c.nEmbd));
      self.wpe = this.registerModule('wpe', new Embedding(c.blockSize, c.nEmbd));
      self.drop = this.registerModule('drop', new Dropout(c.dropout));
    }
    self.layers = this.registerModule('layers', new BlockRange(first, Array.from({ length: end - first }, (_, i) => new Block(c, { moe: isMoELayer(c.moe, first + i) }))));
    if (spec.head) {
      self.lnF = this.registerModule('lnF', new LayerNorm(c.nEmbd, { bias: c.bias }));
      // Tied: the head reuses the embedding matrix, one leaf tensor used twice in the graph. A
      // stage with the head but not the embedding holds its own copy (same initial values); the
      // pipeline sums the two copies' gradients (declared tied in src/models/gpt_parallel.ts).
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

  /** GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 nLayer). */
  private initWeights(initSeed: number | undefined): void {
    noGrad(() => {
      for (const [local, p] of this.namedParameters()) this.initParameter(this.fullName(local), p, initSeed);
    });
  }

  /** One parameter's initial values, by full-model name, into `p` (its own tensor or a view of the same shape). */
  private initParameter(name: string, p: Tensor, initSeed: number | undefined): void {
    if (initSeed !== undefined) seedParameter(initSeed, name);
    if (name.endsWith('.bias') || name.endsWith('Bias')) p.zero_(); // experts' biases are fcBias, projBias
    else if (/ln1|ln2|lnF/.test(name)) p.fill_(1);
    else if (/(attn\.proj\.weight|mlp\.proj\.weight|mlp\.(experts|shared)\.proj)$/.test(name)) p.normal_(0, 0.02 / Math.sqrt(2 * this.cfg.nLayer));
    else p.normal_(0, 0.02);
  }

  /**
   * input: (B, T) int64 token ids where this part holds the embeddings, else hidden states
   * (B, T, C). Returns logits (B, T, vocab) where it holds the head (in a fused training forward,
   * the final norm's output waiting for its head, [Note: deferred head]), else hidden states (B, T, C).
   */
  protected runParts(input: Tensor): Tensor {
    let x = input;
    if (this.wte) {
      const T = input.shape[1]!;
      if (T > this.cfg.blockSize) throw new Error(`GPT: sequence length ${T} exceeds blockSize ${this.cfg.blockSize}`);
      const pos = tokenPositions(T); // 0 .. T-1, or each token's global index under context parallelism
      x = this.drop!.call(this.wte.call(input).add(this.wpe!.call(pos))); // (B, T, C)
    }
    // Each block checkpoints itself when activation checkpointing is on (Block.forward, src/nn/checkpoint.ts).
    for (const b of this.layers.items) x = b.call(x);
    if (this.head) x = runHead(this.head, this.lnF!.call(x)); // (B, T, vocab)
    return x;
  }
}

/**
 * Cross-entropy of logits (B, T, vocab), or of a hidden state waiting for its head, against targets
 * (B, T), IGNORE_INDEX (-100) targets left out: the mean over the trained targets, or their sum with { reduction: 'sum' } (what the layouts
 * divide by the global batch's trained tokens).
 */
export function gptLoss(output: Tensor, targets: Tensor, o: { reduction?: 'mean' | 'sum' } = {}): Tensor {
  const logits = headOutput(output, { targets }); // the summed loss itself from a waiting head ([Note: deferred head])
  if (logits.ndim === 0) return o.reduction === 'sum' ? logits : logits.div(targets.ne(IGNORE_INDEX).sum());
  const [B, T, V] = logits.shape as [number, number, number];
  const [l] = castFor('loss', logits) as [Tensor]; // float32 under bf16-mixed (src/nn/precision.ts)
  return F.crossEntropy(l.view(B * T, V), targets.reshape(B * T), { reduction: o.reduction ?? 'mean' });
}

/** The whole model on one process. */
export class GPT extends GPTParts {
  declare readonly wte: Embedding;
  declare readonly wpe: Embedding;
  declare readonly drop: Dropout;
  declare readonly lnF: LayerNorm;
  declare readonly head: LMHead;

  constructor(cfg: Partial<GPTConfig> = {}, opts: GPTBuildOptions = {}) {
    const c = checkConfig(cfg);
    super(c, { layers: [0, c.nLayer], embed: true, head: true }, opts);
  }

  /** Generation's cache for this model: one layer per block, at most blockSize positions. */
  newCache(batch: number, maxLen = this.cfg.blockSize, pad?: readonly number[]): KVCache {
    return new KVCache(this.cfg.nLayer, batch, Math.min(maxLen, this.cfg.blockSize), pad);
  }

  /** Longest context the model takes (its learned positions). */
  get contextLength(): number {
    return this.cfg.blockSize;
  }

  /**
   * Generation: the logits (B, T, vocab) of the new tokens idx (B, T), earlier ones' keys and values
   * from the cache, which then holds these too ([Note: kv cache] in src/nn/kv_cache.ts).
   */
  decode(idx: Tensor, cache: KVCache): Tensor {
    const T = idx.shape[1]!;
    if (cache.length + T > this.cfg.blockSize) throw new Error(`GPT: ${cache.length + T} positions exceed blockSize ${this.cfg.blockSize}`);
    let x = this.drop.call(this.wte.call(idx).add(this.wpe.call(cache.positions(T)))); // (B, T, C)
    const allowed = cache.allowed(T);
    this.layers.items.forEach((b, i) => (x = b.decode(x, cache, i, allowed)));
    cache.advance(T);
    return this.head.call(this.lnF.call(x));
  }

  /**
   * idx: (B, T) int64 token ids. With targets (B, T) also returns the mean cross-entropy loss. Under
   * kernels "fused" ([Note: kernel choice]), a forward with gradients on returns the final norm's output as `logits`,
   * for gptLoss (logitsOf makes the logits of it).
   */
  forward(idx: Tensor, targets?: Tensor): { logits: Tensor; loss?: Tensor } {
    const logits = this.runParts(idx);
    if (!targets) return { logits };
    return { logits, loss: gptLoss(logits, targets) };
  }
}

/** One pipeline stage of a GPT: only the parts `spec` names are built. */
export class GPTStage extends GPTParts {
  constructor(cfg: Partial<GPTConfig>, spec: GPTStageSpec, opts: GPTBuildOptions = {}) {
    super(cfg, spec, opts);
  }

  /** Token ids or hidden states in; hidden states or logits out (see runParts). */
  forward(input: Tensor): Tensor {
    return this.runParts(input);
  }
}
