// A ParallelModel under tensor parallelism: the data-parallel or pipeline model built on the
// tensor-parallel parts, with the gradient API extended over the tensor-parallel group
// ([Note: gradient API] in grads.ts):
//   - fullGrad(p) of a sharded parameter gathers its slices over tp (after the inner source
//     gathered over dp when gradients are sharded); a replicated one is the inner source's.
//   - localGradShard(p) names both ranges: the dp shard of the flattened tp slice, and the slice.
//   - the norm counts every element once over tp x pp x dp: tp-sharded parameters contribute their
//     slice on every tp rank, replicated ones (LayerNorm weights, position embeddings, row-parallel
//     biases) only on tp rank 0; the sums run over the inner groups and the tp group, in float64.
import { type Tensor, cat } from '../../tensor/index.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import type { GradShard, GradientSource, StepPiece } from '../grads.js';
import { WrappedModel, type MicroBatch, type ParallelModel, type StageValue } from '../parallel_model.js';
import { slicedOverTp, type ParamPlacement } from '../placement.js';
import { allGatherDim } from './comm.js';
import type { TensorParallelApplied, TpPlacement } from './styles.js';
import { axisStride, computeBytes, crossesHosts, type PlanAxis } from '../../distributed/plan_terms.js';

/** The whole tensor from this rank's slice of it (a collective over the placement's group). */
export function gatherSlices(local: Tensor, pl: TpPlacement): Tensor {
  if (pl.kind !== 'shard' || pl.group.size === 1) return local;
  const parts = pl.chunks === 1 ? [local] : local.chunk(pl.chunks, pl.dim);
  const whole = parts.map((c) => allGatherDim(c, pl.group, pl.dim));
  return whole.length === 1 ? whole[0]! : cat(whole, pl.dim);
}

export class TensorParallelGrads implements GradientSource {
  constructor(
    private readonly inner: GradientSource,
    private readonly params: () => Tensor[],
    private readonly leftOut: ReadonlySet<Tensor>,
    private readonly placements: ReadonlyMap<Tensor, TpPlacement>,
    private readonly tp: ProcessGroup,
  ) {
    if (inner.normGroups && inner.normGroupOf) this.normGroups = () => this.groupsOverTp();
    // The optimizer-facing hooks are the inner source's, unchanged.
    for (const k of ['stepPieces', 'pieceLayout', 'usedParameters', 'pieceStepped', 'afterStep', 'zeroGrad'] as const) {
      const f = inner[k] as ((...a: unknown[]) => unknown) | undefined;
      if (f) (this as Record<string, unknown>)[k] = f.bind(inner);
    }
  }
  stepPieces?(): StepPiece[];
  pieceLayout?(): StepPiece[];
  usedParameters?(): ReadonlySet<Tensor> | undefined;
  pieceStepped?(piece: StepPiece): void;
  afterStep?(): void;
  zeroGrad?(): void;

  fullGrad(param: Tensor): Tensor {
    const g = this.inner.fullGrad(param);
    const pl = this.placements.get(param);
    return pl ? gatherSlices(g, pl) : g;
  }

  localGradShard(param: Tensor): GradShard {
    const s = this.inner.localGradShard(param);
    const pl = this.placements.get(param);
    if (pl?.kind !== 'shard' || pl.group.size === 1) return s;
    return { ...s, tp: { dim: pl.dim, index: pl.group.rank, parts: pl.group.size, chunks: pl.chunks } };
  }

  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    const tensors: Tensor[] = [];
    for (const p of this.params()) {
      if (this.leftOut.has(p)) continue;
      if (this.placements.get(p)?.kind !== 'shard' && this.tp.rank > 0) continue; // counted on tp rank 0
      const t = this.inner.localGradShard(p).tensor;
      if (t.numel() > 0) tensors.push(t);
    }
    const sumOver = [...this.inner.normPieces().sumOver];
    if (this.tp.size > 1) sumOver.push(this.tp);
    return { tensors, sumOver };
  }

  /** The inner source's groups (expert parallelism's), each parameter's pieces counted once over tp as above. */
  normGroups?(): { tensors: Tensor[]; sumOver: ProcessGroup[] }[];

  private groupsOverTp(): { tensors: Tensor[]; sumOver: ProcessGroup[] }[] {
    const inner = this.inner;
    const groups = inner.normGroups!().map((g) => ({ tensors: [] as Tensor[], sumOver: [...g.sumOver, ...(this.tp.size > 1 ? [this.tp] : [])] }));
    for (const p of this.params()) {
      if (this.leftOut.has(p)) continue;
      if (this.placements.get(p)?.kind !== 'shard' && this.tp.rank > 0) continue;
      const t = inner.localGradShard(p).tensor;
      if (t.numel() > 0) groups[inner.normGroupOf!(p)]!.tensors.push(t);
    }
    return groups;
  }

  clipTargets(): Tensor[] {
    if (this.inner.clipTargets) return this.inner.clipTargets();
    return this.inner.normGroups ? this.inner.normGroups().flatMap((g) => g.tensors) : this.inner.normPieces().tensors;
  }
}

/** The inner layout's model with tensor-parallel gradients, placements, header line and teardown. */
export class TensorParallelModel extends WrappedModel {
  private readonly tpGrads: GradientSource;
  /** Every local parameter's placement, over all parts (a pipeline rank may hold several stages). */
  private readonly tpPlacements = new Map<Tensor, TpPlacement>();

  /**
   * `lossScope`: runs a criterion with the layout's crossEntropy (the vocab-parallel one under loss
   * parallelism, parallelize's); forwardOnly's reader runs inside it too.
   */
  constructor(inner: ParallelModel, private readonly applied: TensorParallelApplied[], private readonly opts: { sequenceParallel: boolean; lossScope?: <T>(fn: () => T) => T }) {
    super(inner);
    for (const a of applied) for (const [p, pl] of a.placements) this.tpPlacements.set(p, pl);
    this.tpGrads = new TensorParallelGrads(inner.grads, () => inner.namedParameters().flatMap(([, p]) => (p.requiresGrad ? [p] : [])), inner.tiedCopiesLeftOutOfNorm, this.tpPlacements, applied[0]!.group);
  }

  override get grads(): GradientSource {
    return this.tpGrads;
  }
  /** The inner layout's placements with each parameter's tensor-parallel slice (or tp rank 0 writing a replicated one). */
  override placements(): ParamPlacement[] {
    return slicedOverTp(this.inner.placements(), this.tpPlacements);
  }
  /** The whole parameter from this rank's slice (a collective over tp for a sharded one). */
  override whole(p: Tensor): Tensor {
    const pl = this.tpPlacements.get(p);
    if (pl?.kind === 'shard') return gatherSlices(p.detach(), pl);
    const w = this.inner.whole(p); // expert parallelism gathers its expert slices
    return w === p && pl ? p.detach() : w;
  }
  override forwardOnly(microBatches: MicroBatch[], read: (output: StageValue, mb: MicroBatch) => Float64Array): Float64Array[] {
    const scope = this.opts.lossScope;
    return this.inner.forwardOnly(microBatches, scope ? (out, mb) => scope(() => read(out, mb)) : read);
  }
  override summary(): string {
    const a = this.applied[0]!;
    const sharded = [...this.tpPlacements.values()].filter((p) => p.kind === 'shard').length;
    return `tensor parallel ${a.group.size} (${sharded} sharded parameter(s)${this.opts.sequenceParallel ? ', sequence parallel' : ''}${a.lossParallel ? ', loss parallel' : ''}); ${this.inner.summary()}`;
  }
  override dispose(): void {
    for (const a of this.applied) a.dispose();
    this.inner.dispose();
  }
}

/**
 * What tensor parallelism changes on a rank, for the planner ([Note: plan terms] in
 * src/distributed/plan_terms.ts; [Note: tp styles]): every split Linear and the vocabulary-parallel
 * embedding and head hold 1 / tp of their parameters (norms, counted as split too, are a rounding
 * error; MoE experts stay whole); a block's compute is divided by tp, and of its activations the
 * split half (the residual stream and norms stay replicated). Sequence parallelism shards the two
 * norms' inputs too, but not what the column-parallel Linears save: their input, gathered whole
 * (one per attention and one per MLP, [Note: tp styles]); under full checkpointing only the block's
 * input is kept, sharded. Per micro-batch each block sums two partial outputs forward and two input
 * gradients backward: four all-reduces of samples x tokens x width, or under sequence parallelism
 * an all-gather and a reduce-scatter for each; the embedding sums its lookup, and the head gathers
 * its logits unless lossParallel keeps them split.
 */
/**
 * The share of a block's activations a tensor-parallel rank keeps, after Megatron's count for a GPT
 * block (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
 * 34 sbh + 5 a s^2 b bytes in 16-bit): 10 sbh (the norms' and the column-parallel linears' inputs,
 * the dropout masks) is whole on every tp rank and the rest split. Sequence parallelism splits the
 * norms' inputs and the masks too; the linears' inputs, gathered, are saved whole (4 sbh).
 * Measured on the 25M GPT, 2 ranks: 655 MiB (tp2) and 638 (tp2 + sp) against 671 and 646 priced;
 * an even split of the activations, the rule before, priced 720 and 704.
 */
function tpActivationShare(h: number, heads: number, tokens: number, tp: number, sequenceParallel: boolean): number {
  const whole = 34 * h + 5 * heads * tokens;
  const kept = sequenceParallel ? 4 * h : 10 * h;
  return (kept + (whole - kept) / tp) / whole;
}

export const tensorParallelPlanAxis = {
  name: 'tensor parallel',
  fields: ['tp', 'sequenceParallel', 'lossParallel'] as const,
  apply(b, ctx) {
    const l = ctx.layout;
    const tp = l.tp;
    if (tp === 1) return;
    b.params = (b.params - b.expertParams) / tp + b.expertParams; // routed experts stay whole on every tp rank
    if (b.frozenParams > 0) b.frozenParams = (b.frozenParams - b.expertParams) / tp + b.expertParams; // a LoRA base's experts are frozen too
    b.blockShare = b.blockShare / tp;
    const m = ctx.model;
    const elem = computeBytes(l);
    const act = b.samples * b.tokens * m.nEmbd * elem;
    const full = l.activationCheckpoint === 'full';
    b.activationShare = full ? (l.sequenceParallel ? 1 / tp : (1 + 1 / tp) / 2) : tpActivationShare(m.nEmbd, m.nHead, b.tokens, tp, l.sequenceParallel);
    const cross = crossesHosts(axisStride(l, 'tp'), tp, ctx.ranksPerHost);
    const n = l.microBatches;
    if (l.sequenceParallel) {
      b.comm.push({ what: 'sequence-parallel all-gathers (2 per block each way)', op: 'allGather', group: tp, bytes: act / tp, times: 4 * b.blocks * n, overlaps: 'none', inStep: 'sp', crossHost: cross });
      b.comm.push({ what: 'sequence-parallel reduce-scatters (2 per block each way)', op: 'reduceScatter', group: tp, bytes: act, times: 4 * b.blocks * n, overlaps: 'none', inStep: 'sp', crossHost: cross });
    } else {
      b.comm.push({ what: 'row-parallel sums and input gradients (4 per block)', op: 'allReduce', group: tp, bytes: act, times: 4 * b.blocks * n, overlaps: 'none', inStep: 'tp', crossHost: cross });
    }
    if (b.embed) b.comm.push({ what: 'vocabulary-parallel embedding sum', op: 'allReduce', group: tp, bytes: act, times: n, overlaps: 'none', crossHost: cross });
    if (b.head && !ctx.lossParallel) b.comm.push({ what: 'head logits all-gather', op: 'allGather', group: tp, bytes: b.samples * b.tokens * m.vocabSize * 4 / tp, times: n, overlaps: 'none', crossHost: cross });
  },
} satisfies PlanAxis;
