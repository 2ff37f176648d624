// Expert parallelism: the routed experts of every MoE layer split over the `ep` group (neighbouring
// ranks of dpShard x cp, which hold the same dense parameters), tokens sent to their experts' ranks
// and back by all-to-all, expert gradients reduced over the ranks that hold the same experts (`edp`).
//
// [Note: expert parallelism]
// - A rank of the ep group holds experts [epRank x E/ep, (epRank + 1) x E/ep) of every MoE layer;
//   the router and the shared experts stay whole (data-parallel like every dense parameter).
// - Routing (and capacity) happens where the tokens are, as without ep; the kept rows, sorted by
//   expert, go to their experts' ranks. Each rank first learns how many rows it gets from whom for
//   each of its experts (an all-to-all of the per-expert counts), then the rows move by one
//   all-to-all of variable sizes, run through the rank's experts as one grouped computation, and
//   come back by the reverse all-to-all. Backward is the same two all-to-alls reversed.
// - An expert's gradient on its rank is then the sum over the ep group's tokens of their
//   contributions; summed over `edp` (the ranks holding the same experts in other ep groups) it
//   covers the global batch, so it is scaled by 1 / (every rank of the dense reduction: the
//   data-parallel ranks x cp) before that sum, where a dense gradient is averaged over that group.
// - Under context parallelism an ep group may hold parts of the same sequences: routing is decided
//   over the whole sequences before the rows move ([Note: moe routing under a sequence shard] in
//   src/nn/moe.ts), and the rows a rank sends are its own tokens' as without cp.
// - Gradients stay in flat buffers: one DataParallel over the dense parameters (data-parallel group)
//   and one over the experts (edp group, the experts excluded from the first). The norm sums the
//   dense pieces as before and the expert pieces also over ep (each expert counted once); the
//   placements give each expert parameter its whole shape and its slice along the expert dim, so a
//   checkpoint holds experts by global index and loads under another ep degree.
import { type Tensor, cat, defineFunction, empty, tensor, noGrad, tidy, zeros } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import { MoE, applyGrouped, moeLayers, type ExpertDispatch } from '../nn/moe.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { DataParallel } from './data_parallel/data_parallel.js';
import type { GradShard, GradientSource, StepPiece } from './grads.js';
import type { MemoryReport } from './data_parallel/memory.js';
import { placementsOf, type ParamPlacement } from './placement.js';
import { DataParallelModel } from './data_parallel/model.js';
import type { Criterion, LossFn } from './parallel_model.js';
import { axisStride, computeBytes, crossesHosts, type PlanAxis } from '../distributed/plan_terms.js';

// rows (n, C) to the group's ranks: `send[r]` rows to rank r, `recv[r]` rows from it; backward the reverse.
const allToAllRows = defineFunction<[Tensor, ProcessGroup, number[], number[]]>({
  forward(ctx, x, group, send, recv) {
    ctx.state.group = group;
    ctx.state.send = send;
    ctx.state.recv = recv;
    return exchange(group, x, send, recv);
  },
  backward(ctx, g) {
    return [exchange(ctx.state.group as ProcessGroup, g, ctx.state.recv as number[], ctx.state.send as number[]), undefined, undefined, undefined];
  },
}, 'AllToAllRows');

function exchange(group: ProcessGroup, x: Tensor, send: number[], recv: number[]): Tensor {
  const rows = recv.reduce((a, b) => a + b, 0);
  const out = empty([rows, ...x.shape.slice(1)], { dtype: x.dtype });
  group.allToAll(out, x.contiguous(), recv, send).wait();
  return out;
}

/** The all-to-all dispatch of one MoE layer over the ep group ([Note: expert parallelism]). */
export class AllToAllDispatch implements ExpertDispatch {
  constructor(readonly group: ProcessGroup) {}

  run(layer: MoE, rows: Tensor, perExpert: readonly number[]): Tensor {
    const P = this.group.size, E = perExpert.length, local = E / P;
    // Counts first: rank r learns, for each of its experts, how many rows each rank sends it.
    const counts = tensor(Float64Array.from(perExpert));
    const theirs = zeros([E], { dtype: 'float64' });
    this.group.allToAll(theirs, counts).wait();
    const incoming = Array.from(theirs.toArray() as Float64Array); // (source, local expert)
    counts.dispose();
    theirs.dispose();
    const send = Array.from({ length: P }, (_, r) => perExpert.slice(r * local, (r + 1) * local).reduce((a, b) => a + b, 0));
    const recv = Array.from({ length: P }, (_, s) => incoming.slice(s * local, (s + 1) * local).reduce((a, b) => a + b, 0));
    const groupOf: number[] = [];
    for (let s = 0; s < P; s++) for (let j = 0; j < local; j++) for (let i = 0; i < incoming[s * local + j]!; i++) groupOf.push(j);
    const received = allToAllRows(rows, this.group, send, recv) as Tensor;
    const out = applyGrouped(layer.experts, received, groupOf);
    return allToAllRows(out, this.group, recv, send) as Tensor;
  }
}

/**
 * Gives every MoE layer of `model` its share of the experts and the all-to-all dispatch; returns the
 * expert parameters (local slices) with the number of experts each layer holds in all.
 */
export function applyExpertParallel(model: Module, ep: ProcessGroup, opts: { into?: Set<Tensor>; allowNone?: boolean } = {}): Set<Tensor> {
  const out = opts.into ?? new Set<Tensor>();
  const before = out.size;
  for (const [name, layer] of moeLayers([model])) {
    const E = layer.cfg.experts;
    if (E % ep.size !== 0) throw new Error(`expert parallelism: ${name} has ${E} experts, which do not split over ep = ${ep.size} ranks; choose moe.experts a multiple of parallel.ep`);
    const local = E / ep.size;
    noGrad(() => layer.keepExperts(ep.rank * local, local));
    layer.dispatch = new AllToAllDispatch(ep);
    for (const p of layer.experts.parameters()) out.add(p);
  }
  if (out.size === before && !opts.allowNone) throw new Error('expert parallelism: the model has no MoE layer; set moe.experts > 0, or parallel.ep = 1');
  return out;
}

/** Expert placements: the whole stack's shape, this rank's slice of it along the expert dim. */
export function expertPlacements(placements: ParamPlacement[], ep: ProcessGroup): ParamPlacement[] {
  return placements.map((p) => {
    const shape = [...p.shape];
    shape[0] = shape[0]! * ep.size;
    return { ...p, shape, tp: { dim: 0, chunks: 1, parts: ep.size, index: ep.rank } };
  });
}

/** A whole expert stack from this rank's slice (a collective over ep). */
export function gatherExperts(param: Tensor, ep: ProcessGroup): Tensor {
  if (ep.size === 1) return param;
  return tidy(() => {
    const parts = Array.from({ length: ep.size }, () => empty(param.shape, { dtype: param.dtype }));
    ep.allGather(parts, param.detach().contiguous()).wait();
    return cat(parts, 0);
  });
}

/**
 * The optimizer's side of the two flat-buffer wrappers expert parallelism keeps, the dense one and
 * the experts' (absent on a pipeline rank whose stages hold no expert): their pieces as one list,
 * expert pieces renamed so their keys differ from the dense wrapper's (bucket0 ...), and the
 * per-step calls passed to the wrapper that owns each piece. Both gradient sources under ep use it.
 */
export class ExpertStepPieces {
  private readonly renamed = new Map<StepPiece, StepPiece>();
  constructor(private readonly dense: DataParallel, private readonly experts: DataParallel | undefined, private readonly expertParams: ReadonlySet<Tensor>) {}

  stepPieces(): StepPiece[] {
    return [...this.dense.stepPieces(), ...this.expertPieces(this.experts?.stepPieces() ?? [])];
  }
  pieceLayout(): StepPiece[] {
    return [...this.dense.pieceLayout(), ...this.expertPieces(this.experts?.pieceLayout() ?? [])];
  }
  private expertPieces(pieces: StepPiece[]): StepPiece[] {
    return pieces.map((p) => {
      const r = { ...p, key: `experts.${p.key}` };
      this.renamed.set(r, p);
      return r;
    });
  }
  usedParameters(): ReadonlySet<Tensor> | undefined {
    const a = this.dense.usedParameters(), b = this.experts?.usedParameters();
    if (!a && !b) return undefined;
    return new Set([...(a ?? this.dense.parametersWithSlots().map((s) => s.param)), ...(b ?? this.expertParams)]);
  }
  pieceStepped(piece: StepPiece): void {
    const own = this.renamed.get(piece);
    if (own) this.experts!.pieceStepped(own);
    else this.dense.pieceStepped(piece);
  }
  afterStep(): void {
    this.dense.afterStep();
    this.experts?.afterStep();
    this.renamed.clear();
  }
  zeroGrad(): void {
    this.dense.zeroGrad();
    this.experts?.zeroGrad();
  }
}

/** A gradient source's optimizer calls, passed to its ExpertStepPieces (both gradient sources under ep). */
export abstract class ExpertPiecesSource {
  constructor(protected readonly pieces: ExpertStepPieces) {}

  stepPieces(): StepPiece[] {
    return this.pieces.stepPieces();
  }
  pieceLayout(): StepPiece[] {
    return this.pieces.pieceLayout();
  }
  usedParameters(): ReadonlySet<Tensor> | undefined {
    return this.pieces.usedParameters();
  }
  pieceStepped(piece: StepPiece): void {
    this.pieces.pieceStepped(piece);
  }
  afterStep(): void {
    this.pieces.afterStep();
  }
  zeroGrad(): void {
    this.pieces.zeroGrad();
  }
}

/** The gradient API over the dense wrapper and the expert wrapper ([Note: expert parallelism]). */
export class ExpertParallelGrads extends ExpertPiecesSource implements GradientSource {
  constructor(readonly dense: DataParallel, readonly experts: DataParallel, readonly expertParams: ReadonlySet<Tensor>, readonly ep: ProcessGroup) {
    super(new ExpertStepPieces(dense, experts, expertParams));
  }

  private of(p: Tensor): DataParallel {
    return this.expertParams.has(p) ? this.experts : this.dense;
  }
  /** An expert parameter's gradient is its local slice's (the experts this rank holds). */
  fullGrad(param: Tensor): Tensor {
    return this.of(param).fullGrad(param);
  }
  localGradShard(param: Tensor): GradShard {
    return this.of(param).localGradShard(param);
  }
  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    throw new Error('ExpertParallelGrads: its norm has two parts summed over different groups; read normGroups()');
  }
  normGroups(): { tensors: Tensor[]; sumOver: ProcessGroup[] }[] {
    const e = this.experts.normPieces();
    return [this.dense.normPieces(), { tensors: e.tensors, sumOver: [...e.sumOver, this.ep] }];
  }
  normGroupOf(param: Tensor): number {
    return this.expertParams.has(param) ? 1 : 0;
  }
  clipTargets(): Tensor[] {
    return this.normGroups().flatMap((g) => g.tensors);
  }
}

/**
 * A whole model under data parallelism with its experts split over ep (the ParallelModel the trainer
 * runs): DataParallelModel's step over two wrappers, the dense parameters' (`dp`) and the experts'.
 */
export class ExpertParallelModel extends DataParallelModel {
  declare readonly grads: ExpertParallelGrads;
  declare readonly optimizerGrads: ExpertParallelGrads;

  constructor(module: Module, readonly dense: DataParallel, readonly experts: DataParallel, readonly expertParams: ReadonlySet<Tensor>,
    readonly ep: ProcessGroup, loss: LossFn | Criterion) {
    super(module, dense, loss, new ExpertParallelGrads(dense, experts, expertParams, ep));
  }

  summary(): string {
    const n = (d: DataParallel) => d.buffers.reduce((a, b) => a + b.buckets.length, 0);
    return `${n(this.dense)} dense bucket(s) over ${this.dense.group.size} data-parallel rank(s), ${n(this.experts)} expert bucket(s) over ${this.experts.group.size}; ` +
      `experts split over ${this.ep.size} expert-parallel rank(s), overlap ${this.dense.overlap ? 'on' : 'off'}`;
  }

  placements(): ParamPlacement[] {
    const named = this.namedParameters();
    const dense = placementsOf(named.filter(([, p]) => !this.expertParams.has(p)), { dp: this.dense });
    return [...dense, ...expertPlacements(placementsOf(named.filter(([, p]) => this.expertParams.has(p)), { dp: this.experts }), this.ep)];
  }

  /** The whole parameter: an expert stack gathered over ep (a collective: every ep rank calls it). */
  whole(param: Tensor): Tensor {
    return this.expertParams.has(param) ? gatherExperts(param, this.ep) : param;
  }

  finishParameterGathers(): void {
    this.dense.waitParams();
    this.experts.waitParams();
  }

  protected noSync<T>(fn: () => T): T {
    return this.dense.noSync(() => this.experts.noSync(fn));
  }

  protected finishGradSync(): void {
    this.dense.finishGradSync();
    this.experts.finishGradSync();
  }

  memory(optimizerBytes = 0): MemoryReport {
    const a = this.dense.memory(optimizerBytes), b = this.experts.memory(0);
    // The two peaks may fall at different moments: their sum is an upper bound.
    return { paramBytes: a.paramBytes + b.paramBytes, gradBytes: a.gradBytes + b.gradBytes, optimizerBytes, peakBytes: a.peakBytes + b.peakBytes };
  }

  withFullParameters<T>(fn: () => T): T {
    return this.dense.withFullParameters(() => this.experts.withFullParameters(fn));
  }

  dispose(): void {
    this.experts.dispose();
    super.dispose();
  }
}

/**
 * What expert parallelism changes on a rank, for the planner ([Note: plan terms] in
 * src/distributed/plan_terms.ts; [Note: expert parallelism]): the rank holds 1 / ep of every MoE
 * layer's routed experts (the router and shared experts stay whole) and computes its experts for
 * the ep group's tokens, so the expert compute per rank is unchanged on a balanced load; each MoE
 * block moves every kept row (tokens x topK x width) to its experts' rank and back by all-to-all,
 * forward and backward. Expert gradients are reduced over the ranks holding the same experts (a
 * data-parallel reduction of 1 / ep of them, counted with the dense ones).
 */
export const expertParallelPlanAxis = {
  name: 'expert parallel',
  fields: ['ep'] as const,
  apply(b, ctx) {
    const l = ctx.layout;
    if (l.ep === 1 || b.expertParams === 0) return;
    const moved = b.expertParams * (1 - 1 / l.ep);
    b.params -= moved;
    if (b.frozenParams > 0) b.frozenParams -= moved; // a LoRA base's experts are frozen too
    b.expertParams -= moved;
    const m = ctx.model;
    const moeShare = m.blockExpertParams.filter((x) => x > 0).length / Math.max(1, m.blockParams.length);
    const elem = computeBytes(l);
    const rows = b.samples * b.tokens * m.topK;
    b.comm.push({
      what: 'expert all-to-alls (dispatch and combine, each way)', op: 'allToAll', group: l.ep, bytes: rows * m.nEmbd * elem, times: 4 * Math.round(b.blocks * moeShare) * l.microBatches, overlaps: 'none',
      crossHost: crossesHosts(axisStride(l, 'dpShard'), l.ep, ctx.ranksPerHost),
    });
  },
} satisfies PlanAxis;
