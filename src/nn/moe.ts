// The mixture-of-experts MLP: a router picks topK experts per token, the experts run as one grouped
// computation (a batched matmul over an (experts, tokens, width) stack), and the outputs come back
// weighted by the router's scores. Settings are moe_config.ts's.
//
// [Note: moe routing]
// - Scores are float32 at least (float64 in a float64 model), whatever the precision policy
//   gives the experts: a bf16 rounding can flip which expert wins.
// - Selection is a stable descending sort of the scores (plus the expert bias under
//   balance = "bias"), so equal scores go to the lower expert index on every rank and every run.
// - A token's weight for an expert is that expert's score (softmax probability or sigmoid), not
//   renormalised over the chosen ones, so the router learns from the main loss at topK = 1 too;
//   normTopK renormalises them to sum 1 over the chosen ones (Mixtral's and Qwen3-MoE's forward).
// - Capacity (capacityFactor > 0): an expert takes ceil(factor x topK x tokens / experts)
//   assignments; first choices go before second ones, then tokens in order; the rest are dropped
//   (the token keeps its residual). Which assignment went where is integer bookkeeping on the host:
//   the counts decide the stack's shape anyway.
// - The experts' stack has one row block per expert, padded to the largest one; padding rows are
//   computed and never read back, so every expert parameter gets a gradient (zeros for an expert
//   that got no token) and data-parallel readiness never waits on an idle expert.
//
// [Note: moe routing under a sequence shard] Under context parallelism a rank holds a part of each
// sequence, but the batch a router decides on is the whole sequences, as in one process: the
// layer gathers every rank's choices (sequenceShard().wholeSequences), routes the whole batch (the
// capacity counts every token, in the global token order) and keeps its own tokens' assignments.
// The balance loss takes each expert's share f_e of the whole batch's assignments and this rank's
// mean score P_e: the ranks' values average to the whole batch's E x sum_e f_e P_e (they hold as
// many tokens each), and so do their gradients, which the data-parallel reduction averages over
// the cp ranks with the main loss's. Statistics stay this rank's counts; the trainer sums ranks.
//
// [Note: moe auxiliary loss] The Switch balance loss, E x sum_e f_e P_e (f_e: share of assignments
// routed to e, P_e: mean score of e, scores normalised per token), does not travel to the criterion:
// its gradient, auxCoeff x the step's loss scale, is added to the router's in backward by a
// pass-through node on the layer's output. So it reaches the router wherever the layer runs (any
// pipeline stage) and whatever loss the layout applies. The layouts set the scale with
// withMoELossScale to 1 / micro-batches: the balance loss is a per-micro-batch quantity, so it is
// averaged over micro-batches (the language-model loss, a sum over trained tokens, is instead
// divided by the global count: [Note: global loss reduction]); outside it the scale is 1, as for
// loss + auxCoeff x aux.
import { type Tensor, type DType, zeros, tensor, noGrad, isGradEnabled, defineFunction, tidy } from '../tensor/index.js';
import { Module } from './module.js';
import * as F from './functional.js';
import { castFor, castParam, readsParametersThroughPolicy } from './precision.js';
import { Dropout } from './layers.js';
import type { MoEConfig } from './moe_config.js';
import { isRecomputing } from './checkpoint.js';
import { sequenceShard, type SequenceShard } from './sequence_shard.js';
import { kernelChoice } from './kernels/choice.js';
import { fusedGelu, fusedSwiglu } from './kernels/pointwise.js';

export { defaultMoEConfig, isMoELayer, moeProblems, checkMoEConfig, type MoEConfig } from './moe_config.js';

let lossScale = 1;

/** Runs fn with the auxiliary loss's gradient scaled by `scale` ([Note: moe auxiliary loss]). */
export function withMoELossScale<T>(scale: number, fn: () => T): T {
  const prev = lossScale;
  lossScale = scale;
  try {
    return fn();
  } finally {
    lossScale = prev;
  }
}

// Passes x through; backward adds d(total)/d(aux) = coeff to aux's gradient.
const addAuxGradient = defineFunction<[Tensor, Tensor, number]>({
  forward(ctx, x, aux, coeff) {
    ctx.state.coeff = coeff;
    ctx.state.auxShape = aux.shape;
    ctx.state.auxDtype = aux.dtype;
    return x;
  },
  backward(ctx, g) {
    return [g, zeros(ctx.state.auxShape as number[], { dtype: ctx.state.auxDtype as DType }).fill_(ctx.state.coeff as number), undefined];
  },
}, 'MoEAuxLoss');

/** The expert MLP's form: the GPT's GELU MLP with biases, or the Llama's SwiGLU. */
export type ExpertKind = 'gelu' | 'gelu-tanh' | 'swiglu';

/** Which projection of an expert an adapter is on (the stack's field). */
export type ExpertProjection = 'w1' | 'w2' | 'w3';

/** What a grouped projection adds to x W (G, L, in) -> (G, L, out): LoRA on experts (lora_experts.ts). */
export interface GroupedDelta {
  enabled: boolean;
  merged: boolean;
  delta(x: Tensor): Tensor;
  /** The same adapter on experts [first, first + count) only, attached to `into` (keepExperts). */
  keep(into: GroupedExperts, first: number, count: number): void;
}

/**
 * G expert MLPs held as stacks: (G, in, out) weights, applied to x (G, L, C) -> (G, L, C), each
 * expert to its own row block, with one batched matmul per projection.
 */
export class GroupedExperts extends Module {
  readonly w1: Tensor; // (G, C, H): gelu's fc, swiglu's gate
  readonly w3?: Tensor; // (G, C, H): swiglu's up
  readonly w2: Tensor; // (G, H, C): the projection back
  readonly b1?: Tensor; // (G, H)
  readonly b2?: Tensor; // (G, C)
  /** Adapters on projections (applyLora on expert targets, [Note: LoRA on experts] in lora_experts.ts). */
  readonly adapters: Partial<Record<ExpertProjection, GroupedDelta>> = {};
  /** `opts.from`: take experts [first, first + groups) of another stack's values instead of drawing them. */
  constructor(readonly groups: number, readonly nEmbd: number, readonly hidden: number, readonly kind: ExpertKind, bias: boolean, opts: { from?: GroupedExperts; first?: number } = {}) {
    super();
    const G = groups, C = nEmbd, H = hidden, src = opts.from, first = opts.first ?? 0;
    // PyTorch Linear's default init per expert; the models re-initialise by name.
    // tidy: the slice's view goes now; left to the GC it kept the whole stack resident after keepExperts.
    const u = (shape: number[], fanIn: number, of: Tensor | undefined) => tidy(() => noGrad(() =>
      of ? of.narrow(0, first, G).clone() : zeros(shape).uniform_(-1 / Math.sqrt(fanIn), 1 / Math.sqrt(fanIn))));
    const swiglu = kind === 'swiglu';
    this.w1 = this.registerParameter(swiglu ? 'gate' : 'fc', u([G, C, H], C, src?.w1));
    if (swiglu) this.w3 = this.registerParameter('up', u([G, C, H], C, src?.w3));
    this.w2 = this.registerParameter(swiglu ? 'down' : 'proj', u([G, H, C], H, src?.w2));
    if (bias && !swiglu) {
      this.b1 = this.registerParameter('fcBias', u([G, H], C, src?.b1));
      this.b2 = this.registerParameter('projBias', u([G, C], H, src?.b2));
    }
  }

  forward(x: Tensor): Tensor {
    const [xc] = castFor('linear', x) as [Tensor];
    const w = (p: Tensor) => castParam('linear', p);
    const bmm = (x: Tensor, proj: ExpertProjection): Tensor => {
      const y = x.bmm(w(this[proj]!));
      const a = this.adapters[proj];
      return a && a.enabled && !a.merged ? y.add(a.delta(x)) : y;
    };
    const addBias = (h: Tensor, b: Tensor | undefined) => (b ? h.add(castParam('linear', b).unsqueeze(1)) : h);
    if (this.kind === 'swiglu') {
      const [g] = castFor('swiglu', bmm(xc, 'w1')) as [Tensor];
      const up = bmm(xc, 'w3');
      const [h] = castFor('linear', kernelChoice() === 'fused' ? fusedSwiglu(g, up) : g.silu().mul(up)) as [Tensor]; // (G, L, H)
      return bmm(h, 'w2');
    }
    let [h] = castFor('gelu', addBias(bmm(xc, 'w1'), this.b1)) as [Tensor];
    const approximate = this.kind === 'gelu-tanh' ? 'tanh' : 'none';
    h = kernelChoice() === 'fused' ? fusedGelu(h, approximate) : h.gelu(approximate);
    const [hc] = castFor('linear', h) as [Tensor];
    return addBias(bmm(hc, 'w2'), this.b2); // (G, L, C)
  }
}

/**
 * Rows through the experts of their groups, as one batched computation: row i goes to group
 * groupOf[i]; the rows are stacked (G, L, C) with L the largest group (padding rows are computed and
 * never read back, [Note: moe routing]). Returns each row's output, in the rows' order.
 */
export function applyGrouped(experts: GroupedExperts, rows: Tensor, groupOf: readonly number[]): Tensor {
  const G = experts.groups, C = rows.shape[1]!;
  const counts = new Array<number>(G).fill(0);
  const slot = new BigInt64Array(groupOf.length);
  let L = 0;
  groupOf.forEach((g) => (L = Math.max(L, ++counts[g]!)));
  counts.fill(0);
  groupOf.forEach((g, i) => (slot[i] = BigInt(g * L + counts[g]!++)));
  const at = tensor(slot);
  const stack = zeros([G * L, C], { dtype: rows.dtype }).indexAdd(0, at, rows).view(G, L, C);
  return experts.call(stack).reshape(G * L, C).indexSelect(0, at);
}

/**
 * How an MoE layer reaches experts it does not hold all of: expert parallelism
 * (src/parallel/expert_parallel.ts) sets one. Without it, the layer runs its own experts.
 */
export interface ExpertDispatch {
  /** rows (kept, C), sorted by expert, `perExpert[e]` rows for global expert e -> their experts' outputs, in the same order. */
  run(layer: MoE, rows: Tensor, perExpert: readonly number[]): Tensor;
}

/** One layer's routing of its tokens ([Note: moe routing]); kept rows in expert order. */
interface Route {
  /** This rank's assignments to each expert, before capacity (its statistics). */
  counts: number[];
  /** This rank's kept assignments per expert, their total, and per kept row its token, expert and k-major assignment index. */
  keptPer: number[];
  kept: number;
  token: BigInt64Array;
  expertOfRow: number[];
  assignment: BigInt64Array;
  /** Assignments to each expert over the batch the routing decided on (the whole sequences under a shard), and their total: the balance loss's shares. */
  batchCounts: number[];
  batchAssignments: number;
}

/** What one MoE layer saw since its statistics were last taken (training forwards only). */
export interface MoEStats {
  /** Assignments routed to each expert (before capacity). */
  tokens: number[];
  /** Assignments dropped by the capacity limit. */
  dropped: number;
  /** Sum of the auxiliary loss values (balance = "aux") and the forwards they came from. */
  auxSum: number;
  forwards: number;
}

export class MoE extends Module {
  readonly router: Tensor; // (E, C)
  readonly experts: GroupedExperts;
  readonly shared?: GroupedExperts;
  /** Added to the scores for selection only (balance = "bias"); moved outside the gradient by updateBias. */
  readonly expertBias?: Tensor;
  /** On the block's output, as the dense MLP's (the GPT's model.dropout; none for the Llama). */
  readonly drop?: Dropout;
  /** Set by expert parallelism: where the routed rows go. */
  dispatch: ExpertDispatch | undefined;
  /** The global index of the first expert this layer holds (keepExperts), and how many it holds. */
  firstExpert = 0;
  private stats: MoEStats;

  constructor(readonly cfg: MoEConfig, readonly nEmbd: number, hidden: number, kind: ExpertKind, bias: boolean, opts: { dropout?: number } = {}) {
    super();
    if ((opts.dropout ?? 0) > 0) this.drop = this.registerModule('drop', new Dropout(opts.dropout!));
    const E = cfg.experts, H = cfg.hidden || hidden;
    this.router = this.registerParameter('router', noGrad(() => zeros([E, nEmbd]).normal_(0, 0.02)));
    this.experts = this.registerModule('experts', new GroupedExperts(E, nEmbd, H, kind, bias));
    if (cfg.sharedExperts > 0) this.shared = this.registerModule('shared', new GroupedExperts(cfg.sharedExperts, nEmbd, H, kind, bias));
    if (cfg.balance === 'bias') this.expertBias = this.registerBuffer('expertBias', zeros([E]));
    this.stats = emptyStats(E);
  }

  /**
   * Keeps only experts [first, first + count) of the routed ones (their parameters become slices;
   * shared experts and the router stay whole): what an expert-parallel rank holds.
   */
  keepExperts(first: number, count: number): void {
    const all = this.experts;
    const kept = new GroupedExperts(count, all.nEmbd, all.hidden, all.kind, all.b1 !== undefined, { from: all, first });
    // A slice of a frozen parameter (requiresGrad = false) is frozen too.
    const frozen = new Set(all.namedParameters().filter(([, p]) => !p.requiresGrad).map(([n]) => n));
    for (const [n, p] of kept.namedParameters()) if (frozen.has(n)) p.requiresGrad = false;
    // A rank holds its experts' adapters ([Note: LoRA on experts]).
    for (const a of Object.values(all.adapters)) a!.keep(kept, first, count);
    (this as { experts: GroupedExperts }).experts = this.registerModule('experts', kept);
    this.firstExpert = first;
    all.dispose();
  }

  /** x (B, T, C) -> (B, T, C). */
  forward(x: Tensor): Tensor {
    const [B, T, C] = x.shape as [number, number, number];
    const N = B * T, E = this.cfg.experts, k = this.cfg.topK;
    const xf = x.reshape(N, C);
    // Router in float32 at least ([Note: moe routing]).
    const rd: DType = x.dtype === 'float64' ? 'float64' : 'float32';
    const xr = xf.dtype === rd ? xf : xf.to(rd);
    const rw = castParam('router', this.router);
    const logits = F.linear(xr, rw.dtype === rd ? rw : rw.to(rd)); // (N, E)
    const scores = this.cfg.router === 'softmax' ? logits.softmax(-1) : logits.sigmoid();
    const top = noGrad(() => {
      const choice = this.expertBias ? scores.add(this.expertBias.to(rd)) : scores;
      return choice.sort(-1, true)[1].narrow(1, 0, k).t().contiguous(); // (k, N): first choices, then second ...
    });
    const shard = sequenceShard();
    const route = shard ? this.routeWhole(top, B, T, shard) : this.route(top.toArray() as BigInt64Array, N);
    const chosen = scores.gather(1, top.t()); // (N, k)
    const gates = (this.cfg.normTopK ? chosen.div(chosen.sum(-1, true)) : chosen).t().reshape(k * N); // (k N), k-major as `top`

    // The grouped computation: the kept assignments' rows, sorted by expert, through their experts.
    const tok = tensor(route.token), which = tensor(route.assignment);
    const rows = xf.indexSelect(0, tok); // (kept, C)
    const y = this.dispatch ? this.dispatch.run(this, rows, route.keptPer) : applyGrouped(this.experts, rows, route.expertOfRow);
    const g = gates.indexSelect(0, which).unsqueeze(1);
    const yw = y.mul(y.dtype === g.dtype ? g : g.to(y.dtype));
    let out = zeros([N, C], { dtype: yw.dtype }).indexAdd(0, tok, yw);
    if (this.shared) out = out.add(this.shared.call(xf.unsqueeze(0).expand(this.cfg.sharedExperts, N, C)).sum(0));

    // Statistics of training forwards, once each: not evaluation, not an activation-checkpoint recompute.
    const training = this.training && isGradEnabled() && !isRecomputing();
    if (this.cfg.balance === 'aux' && this.cfg.auxCoeff > 0) {
      // [Note: moe auxiliary loss]
      const norm = this.cfg.router === 'softmax' ? scores : scores.div(scores.sum(-1, true));
      const f = tensor(Float64Array.from(route.batchCounts, (c) => c / route.batchAssignments)).to(rd);
      const aux = norm.mean(0).mul(f).sum().mul(E);
      if (training) this.stats.auxSum += aux.item();
      if (aux.requiresGrad) out = addAuxGradient(out, aux, this.cfg.auxCoeff * lossScale);
    }
    if (training) {
      route.counts.forEach((c, e) => (this.stats.tokens[e]! += c));
      this.stats.dropped += k * N - route.kept;
      this.stats.forwards++;
    }
    if (out.dtype !== x.dtype) out = out.to(x.dtype);
    out = out.view(B, T, C);
    return this.drop ? this.drop.call(out) : out;
  }

  /**
   * The routing's integer side ([Note: moe routing]): for each kept assignment (in expert order),
   * its token, its expert and its index in the k-major assignment list; the counts per expert
   * before and after capacity.
   */
  private route(top: BigInt64Array, N: number): Route {
    const E = this.cfg.experts, k = this.cfg.topK, A = k * N;
    const counts = new Array<number>(E).fill(0);
    for (let a = 0; a < A; a++) counts[Number(top[a])]!++;
    const cap = this.cfg.capacityFactor > 0 ? Math.ceil((this.cfg.capacityFactor * A) / E) : Infinity;
    const keptPer = counts.map((c) => Math.min(c, cap));
    const start: number[] = [];
    let kept = 0;
    for (const c of keptPer) { start.push(kept); kept += c; }
    const token = new BigInt64Array(kept), assignment = new BigInt64Array(kept), expertOfRow = new Array<number>(kept);
    const pos = new Array<number>(E).fill(0);
    for (let a = 0; a < A; a++) {
      const e = Number(top[a]);
      const p = pos[e]!++;
      if (p >= cap) continue;
      const i = start[e]! + p;
      token[i] = BigInt(a % N);
      expertOfRow[i] = e;
      assignment[i] = BigInt(a);
    }
    return { counts, keptPer, kept, token, expertOfRow, assignment, batchCounts: counts, batchAssignments: A };
  }

  /**
   * The routing of this rank's tokens when the layer runs on a part of each sequence ([Note: moe
   * routing under a sequence shard]): top (k, B T) -> the route over the whole sequences, restricted
   * to this rank's tokens.
   */
  private routeWhole(top: Tensor, B: number, T: number, shard: SequenceShard): Route {
    const k = this.cfg.topK, N = B * T;
    const whole = shard.wholeSequences(top.t().reshape(B, T, k)); // (B, Tw, k)
    const Tw = whole.shape[1]!, Nw = B * Tw;
    const all = this.route(whole.reshape(Nw, k).t().contiguous().toArray() as BigInt64Array, Nw);
    // Whole-batch token b Tw + p is this rank's token b T + j when p is its j-th position.
    const mine = new Int32Array(Nw).fill(-1);
    const pos = shard.positions(T).toArray() as BigInt64Array;
    for (let b = 0; b < B; b++) for (let j = 0; j < T; j++) mine[b * Tw + Number(pos[j])] = b * T + j;
    const E = this.cfg.experts;
    const counts = new Array<number>(E).fill(0), keptPer = new Array<number>(E).fill(0);
    const local = top.toArray() as BigInt64Array;
    for (let a = 0; a < k * N; a++) counts[Number(local[a])]!++;
    const token: bigint[] = [], assignment: bigint[] = [], expertOfRow: number[] = [];
    for (let i = 0; i < all.kept; i++) { // in expert order, as the whole route's rows
      const n = mine[Number(all.token[i])]!;
      if (n < 0) continue;
      const e = all.expertOfRow[i]!;
      keptPer[e]!++;
      token.push(BigInt(n));
      expertOfRow.push(e);
      assignment.push(BigInt(Math.floor(Number(all.assignment[i]) / Nw) * N + n)); // (choice, token), k-major
    }
    return {
      counts, keptPer, kept: token.length, token: BigInt64Array.from(token), expertOfRow, assignment: BigInt64Array.from(assignment),
      batchCounts: all.counts, batchAssignments: k * Nw,
    };
  }

  /** What this layer saw since the last call, and a fresh start. */
  takeStats(): MoEStats {
    const s = this.stats;
    this.stats = emptyStats(this.cfg.experts);
    return s;
  }

  /**
   * balance = "bias": after an optimizer step, each expert's selection bias moves by biasRate
   * toward an even load: up when it got fewer than the mean of `tokens` (the step's counts over
   * every data-parallel rank), down when more.
   */
  updateBias(tokens: readonly number[]): void {
    if (!this.expertBias) return;
    const mean = tokens.reduce((a, b) => a + b, 0) / tokens.length;
    const step = Float64Array.from(tokens, (t) => this.cfg.biasRate * Math.sign(mean - t));
    noGrad(() => {
      const d = tensor(step).to(this.expertBias!.dtype);
      this.expertBias!.add_(d);
      d.dispose();
    });
  }
}

function emptyStats(E: number): MoEStats {
  return { tokens: new Array<number>(E).fill(0), dropped: 0, auxSum: 0, forwards: 0 };
}

readsParametersThroughPolicy(GroupedExperts);
readsParametersThroughPolicy(MoE);

/** The MoE layers of some modules, with their names. */
export function moeLayers(parts: readonly Module[]): [string, MoE][] {
  return parts.flatMap((p) => p.namedModules().filter((e): e is [string, MoE] => e[1] instanceof MoE));
}
