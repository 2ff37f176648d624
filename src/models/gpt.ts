// The reference model: a GPT-2 style decoder (learned positions, pre-norm blocks, GELU MLP,
// optional tied input/output embedding). Layers are keyed by string ids ("layers.0", ...) and the
// embedding and head are separate modules, so a pipeline stage can own a subset later.
import { type Tensor, arange, noGrad } from '../tensor/index.js';
import { Module, Embedding, LayerNorm, Linear, Dropout, Block, ModuleList, F } from '../nn/index.js';

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
}

export const defaultGPTConfig: GPTConfig = {
  vocabSize: 256, blockSize: 128, nLayer: 4, nHead: 4, nEmbd: 128, dropout: 0, bias: true, tieEmbeddings: false,
};

export class GPT extends Module {
  readonly cfg: GPTConfig;
  readonly wte: Embedding;
  readonly wpe: Embedding;
  readonly drop: Dropout;
  readonly layers: ModuleList<Block>;
  readonly lnF: LayerNorm;
  readonly head: Linear;

  constructor(cfg: Partial<GPTConfig> = {}) {
    super();
    const c = (this.cfg = { ...defaultGPTConfig, ...cfg });
    for (const k of ['vocabSize', 'blockSize', 'nLayer', 'nHead', 'nEmbd'] as const) {
      if (!Number.isInteger(c[k]) || c[k] <= 0) throw new Error(`GPT: ${k} must be a positive integer, got ${c[k]}`);
    }
    this.wte = this.registerModule('wte', new Embedding(c.vocabSize, c.nEmbd));
    this.wpe = this.registerModule('wpe', new Embedding(c.blockSize, c.nEmbd));
    this.drop = this.registerModule('drop', new Dropout(c.dropout));
    this.layers = this.registerModule('layers', new ModuleList(Array.from({ length: c.nLayer }, () => new Block(c))));
    this.lnF = this.registerModule('lnF', new LayerNorm(c.nEmbd, { bias: c.bias }));
    // Tied: the head reuses the embedding matrix, one leaf tensor used twice in the graph.
    const shared = c.tieEmbeddings ? this.wte.weight : undefined;
    this.head = this.registerModule('head', new Linear(c.nEmbd, c.vocabSize, { bias: false, weight: shared }));
    this.initWeights();
  }

  /** GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 nLayer). */
  private initWeights(): void {
    noGrad(() => {
      for (const [name, p] of this.namedParameters()) {
        if (name.endsWith('.bias')) p.zero_();
        else if (/ln1|ln2|lnF/.test(name)) p.fill_(1);
        else if (name.endsWith('attn.proj.weight') || name.endsWith('mlp.proj.weight')) p.normal_(0, 0.02 / Math.sqrt(2 * this.cfg.nLayer));
        else p.normal_(0, 0.02);
      }
    });
  }

  /** idx: (B, T) int64 token ids. With targets (B, T) also returns the mean cross-entropy loss. */
  forward(idx: Tensor, targets?: Tensor): { logits: Tensor; loss?: Tensor } {
    const [B, T] = idx.shape as [number, number];
    if (T > this.cfg.blockSize) throw new Error(`GPT: sequence length ${T} exceeds blockSize ${this.cfg.blockSize}`);
    const pos = arange(0, T);
    let x = this.drop.call(this.wte.call(idx).add(this.wpe.call(pos))); // (B, T, C)
    for (const b of this.layers.items) x = b.call(x);
    const logits = this.head.call(this.lnF.call(x)); // (B, T, vocab)
    if (!targets) return { logits };
    const loss = F.crossEntropy(logits.view(B * T, this.cfg.vocabSize), targets.reshape(B * T));
    return { logits, loss };
  }
}
