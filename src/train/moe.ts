// The trainer's side of mixture-of-experts layers: after each step, what every MoE layer saw on
// every rank (tokens per expert, dropped assignments, the auxiliary loss) summed into one table, the
// expert-bias update that balance = "bias" makes outside the gradient, and the metrics row's fields.
import { tensor } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import { moeLayers, type MoE, type MoEConfig } from '../nn/moe.js';
import type { ProcessGroup } from '../distributed/process_group.js';

/** The metrics row's MoE fields. */
export interface MoEMetrics {
  /** Per MoE layer (by module name), assignments routed to each expert this step over the global batch. */
  expertTokens: Record<string, number[]>;
  /** Sum over MoE layers of the auxiliary loss (mean over micro-batches and ranks), when balance = "aux". */
  auxLoss?: number;
  /** Assignments dropped by the capacity limit this step, over every layer and the global batch (when moe.capacityFactor > 0). */
  droppedTokens?: number;
}

/** The block index in a module name "layers.<i>.mlp". */
function layerIndex(name: string): number {
  const m = /(?:^|\.)layers\.(\d+)\.mlp$/.exec(name);
  if (!m) throw new Error(`MoE layer ${name}: expected a name layers.<i>.mlp`);
  return Number(m[1]);
}

export class MoEBookkeeping {
  private readonly layers: [string, MoE][];

  /**
   * `nLayer`: blocks of the whole model (a pipeline rank holds some); `tp`: ranks that see the same
   * tokens (tensor parallelism), whose counts are one rank's. Context-parallel ranks count their own
   * tokens (routed over the whole sequences, [Note: moe routing under a sequence shard] in
   * src/nn/moe.ts), so the sums cover every token once and the auxiliary loss's mean is the batch's.
   */
  constructor(parts: readonly Module[], private readonly cfg: MoEConfig, private readonly nLayer: number, private readonly tp: number) {
    this.layers = moeLayers(parts);
  }

  /** Whether this rank holds any MoE layer (every rank builds the bookkeeping all the same). */
  get any(): boolean {
    return this.layers.length > 0;
  }

  /**
   * Takes every layer's statistics of the step, sums them over `world` (every rank calls it, MoE
   * layers or not: a pipeline rank without any still joins the collective), moves the expert
   * biases when `stepped` (the optimizer took the step), and returns the metrics fields.
   */
  finishStep(world: ProcessGroup, stepped: boolean): MoEMetrics {
    const E = this.cfg.experts, row = E + 3, L = this.nLayer;
    // Per block: counts (E), dropped, aux sum, forwards. Blocks this rank does not hold stay zero.
    const v = new Float64Array(L * row);
    const held = new Map<number, [string, MoE]>();
    for (const [name, layer] of this.layers) {
      const i = layerIndex(name);
      held.set(i, [name, layer]);
      const s = layer.takeStats();
      s.tokens.forEach((c, e) => (v[i * row + e] = c));
      v[i * row + E] = s.dropped;
      v[i * row + E + 1] = s.auxSum;
      v[i * row + E + 2] = s.forwards;
    }
    sumOverRanks(world, v);
    const out: MoEMetrics = { expertTokens: {} };
    let aux = 0, dropped = 0;
    for (let i = 0; i < L; i++) {
      const forwards = v[i * row + E + 2]!;
      if (forwards === 0) continue; // not an MoE block
      const counts = Array.from(v.subarray(i * row, i * row + E), (c) => c / this.tp);
      out.expertTokens[`layers.${i}.mlp`] = counts;
      dropped += v[i * row + E]! / this.tp;
      aux += v[i * row + E + 1]! / forwards; // the tp copies are in both sums
      if (stepped) held.get(i)?.[1].updateBias(counts);
    }
    if (this.cfg.balance === 'aux') out.auxLoss = aux;
    if (this.cfg.capacityFactor > 0) out.droppedTokens = dropped;
    return out;
  }

  /**
   * Every MoE block's selection bias by block name (balance = "bias"; undefined otherwise), on every
   * rank: a collective over `world`, since a pipeline rank holds only its stages' blocks.
   */
  expertBiases(world: ProcessGroup): Record<string, number[]> | undefined {
    if (this.cfg.balance !== 'bias') return undefined;
    const E = this.cfg.experts, row = E + 1, L = this.nLayer;
    const v = new Float64Array(L * row); // per block: the bias summed over its holders, and how many hold it
    for (const [name, layer] of this.layers) {
      const i = layerIndex(name);
      (layer.expertBias!.to('float64').toArray() as Float64Array).forEach((b, e) => (v[i * row + e] = b));
      v[i * row + E] = 1;
    }
    sumOverRanks(world, v);
    const out: Record<string, number[]> = {};
    for (let i = 0; i < L; i++) {
      const n = v[i * row + E]!;
      if (n > 0) out[`layers.${i}.mlp`] = Array.from(v.subarray(i * row, i * row + E), (b) => b / n);
    }
    return out;
  }

  /** Sets the blocks this rank holds to the saved biases (a checkpoint's; see expertBiases). */
  loadExpertBiases(biases: Record<string, number[]>): void {
    for (const [name, layer] of this.layers) {
      const b = biases[name.replace(/^.*?(layers\.\d+\.mlp)$/, '$1')];
      if (!b || !layer.expertBias) continue;
      if (b.length !== layer.cfg.experts) throw new Error(`checkpoint: MoE block ${name} saved ${b.length} expert biases, this model has ${layer.cfg.experts} experts`);
      layer.expertBias.copy_(tensor(Float64Array.from(b)).to(layer.expertBias.dtype));
    }
  }
}

/** Sums `v` element-wise over the group's ranks, in place (float64). */
function sumOverRanks(group: ProcessGroup, v: Float64Array): void {
  if (group.size === 1) return;
  const t = tensor(v);
  try {
    group.allReduce(t, 'sum').wait();
    v.set(t.toArray() as Float64Array);
  } finally {
    t.dispose();
  }
}
