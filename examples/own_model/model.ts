// A model of your own under every layout: a small MLP-Mixer that classifies sequences of feature
// vectors. It knows nothing about ranks. Two tensors travel between its layers (the hidden state
// and the embedded input, which the head adds back), so a pipeline split passes both.
import { Module, Linear, LayerNorm, F, manualSeed, type Tensor, type TpPlan } from '../../src/index.js';

export interface MixerConfig {
  tokens: number; // T: sequence length
  features: number; // input features per token
  dim: number; // D: hidden width
  blocks: number;
  classes: number;
}

/** Input (B, T, features) -> [h, h0], both (B, T, D). */
export class Embed extends Module {
  readonly proj: Linear;
  readonly skip: Linear;
  constructor(c: MixerConfig) {
    super();
    this.proj = this.registerModule('proj', new Linear(c.features, c.dim));
    this.skip = this.registerModule('skip', new Linear(c.features, c.dim, { bias: false }));
  }
  forward(x: Tensor): Tensor[] {
    return [this.proj.call(x), this.skip.call(x)];
  }
}

/** Token mixing (across T) then channel mixing (across D), each residual: [h, h0] -> [h', h0]. */
export class MixerBlock extends Module {
  readonly ln1: LayerNorm;
  readonly tok: Linear;
  readonly ln2: LayerNorm;
  readonly fc: Linear;
  readonly out: Linear;
  constructor(c: MixerConfig) {
    super();
    this.ln1 = this.registerModule('ln1', new LayerNorm(c.dim));
    this.tok = this.registerModule('tok', new Linear(c.tokens, c.tokens));
    this.ln2 = this.registerModule('ln2', new LayerNorm(c.dim));
    this.fc = this.registerModule('fc', new Linear(c.dim, 2 * c.dim));
    this.out = this.registerModule('out', new Linear(2 * c.dim, c.dim));
  }
  forward(h: Tensor, h0: Tensor): Tensor[] {
    const t = this.tok.call(this.ln1.call(h).transpose(1, 2)).transpose(1, 2); // (B, T, D)
    const x = h.add(t);
    return [x.add(this.out.call(F.gelu(this.fc.call(this.ln2.call(x))))), h0];
  }
}

/** [h, h0] -> logits (B, classes): the mean over tokens of h + h0, normalised, projected. */
export class Head extends Module {
  readonly ln: LayerNorm;
  readonly fc: Linear;
  constructor(c: MixerConfig) {
    super();
    this.ln = this.registerModule('ln', new LayerNorm(c.dim));
    this.fc = this.registerModule('fc', new Linear(c.dim, c.classes));
  }
  forward(h: Tensor, h0: Tensor): Tensor {
    return this.fc.call(this.ln.call(h.add(h0).mean(1)));
  }
}

/** Layer i of the model (0: Embed, 1..blocks: MixerBlock, last: Head), its weights seeded by i. */
export function mixerLayer(c: MixerConfig, seed: number, i: number): Module {
  manualSeed(seed * 1000 + i); // any split builds exactly the whole model's weights
  if (i === 0) return new Embed(c);
  if (i <= c.blocks) return new MixerBlock(c);
  return new Head(c);
}

/** The whole model on one process: layers registered as '0', '1', ... and called in order. */
export class Mixer extends Module {
  readonly layers: Module[];
  constructor(readonly cfg: MixerConfig, seed: number) {
    super();
    this.layers = Array.from({ length: cfg.blocks + 2 }, (_, i) => this.registerModule(String(i), mixerLayer(cfg, seed, i)));
  }
  forward(x: Tensor): Tensor {
    let v: Tensor[] = [x];
    for (const l of this.layers) {
      const out = (l as unknown as { call: (...a: Tensor[]) => Tensor | Tensor[] }).call(...v);
      v = Array.isArray(out) ? out : [out];
    }
    return v[0]!;
  }
}

/** The model's own loss: cross-entropy of logits (B, classes) against labels (B,) int64. */
export function mixerLoss(logits: Tensor | readonly Tensor[], labels: Tensor | readonly Tensor[]): Tensor {
  return F.crossEntropy(logits as Tensor, labels as Tensor);
}

/**
 * The model's tensor-parallel plan (parallel.tp > 1): each MixerBlock's channel MLP is cut as
 * Megatron cuts a transformer's, fc column-parallel and out row-parallel; the rest is replicated.
 * A function of the part, since a pipeline stage holds only some blocks.
 */
export function mixerTensorPlan(part: Module): TpPlan {
  const blocks = part.namedModules().filter(([, m]) => m instanceof MixerBlock).map(([n]) => n);
  return Object.fromEntries(blocks.flatMap((n) => [[`${n}.fc`, 'colwise'], [`${n}.out`, 'rowwise']]));
}
