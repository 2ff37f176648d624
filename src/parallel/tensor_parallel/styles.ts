// Tensor parallelism applied to a model from outside, as torchtitan's parallelize_module: a plan
// maps module paths to styles, and each style shards the module's parameters over the
// tensor-parallel group and wraps its forward with the communication ops of comm.ts. Models know
// nothing about ranks; the one thing a model must do is size its work from the tensors it is given
// (attention takes its local head count from the width of its projection's output).
//
// [Note: tp styles] (g = the tensor-parallel group, n = its size, r = this rank)
//   colwise         Linear (out, in): rows [r*out/n, (r+1)*out/n) (per chunk when the layer fuses
//                   several outputs, e.g. q, k, v: `chunks: 3`). Input replicated (copyToRegion),
//                   sequence-sharded (gatherSequence), or `prepared` by its parent (no communication
//                   here); output sharded on its last dim, or gathered.
//   prepareInput    a module whose Linears share one input (attention's q, k, v; an MLP's gate and
//                   up): the input enters the region once, for all of them (torchtitan's
//                   PrepareModuleInput). Their input gradients are summed locally and communicated
//                   once, and under sequence parallelism one gathered copy is saved for their weight
//                   gradients instead of one per Linear. The input is cast as the Linears cast it
//                   first, so the collectives move the compute dtype.
//   rowwise         Linear (out, in): columns [r*in/n, ...); input sharded on its last dim; the
//                   partial outputs are summed (reduceFromRegion) or, with sequence parallelism,
//                   reduce-scattered over tokens; the bias is replicated and added after the sum.
//   vocabEmbedding  Embedding (V, C): rows [r*V/n, ...); ids outside them give zero rows, the sum
//                   over ranks is the lookup (all-reduce, or reduce-scatter over tokens).
//   sequenceParallel  a module on sequence-sharded activations (LayerNorm, RMSNorm, Dropout): its
//                   parameters are replicated and its gradients partial, so they are all-reduced
//                   over g as they arrive; `input: 'replicated'` takes this rank's tokens first.
//                   (Also a norm within each head on head-sharded activations, Qwen3's q/k norms:
//                   the same partial gradients, nothing to scatter.)
//   localRng        a Dropout on sharded activations: a mask of its own on every rank.
//   lossParallel    the output head: colwise with the logits left sharded over the vocabulary; the
//                   criterion's cross-entropy becomes the vocab-parallel one (loss.ts).
//
// [Note: LoRA under tp] An adapted Linear (y = W x + scale B A x, [Note: LoRA] in src/nn/lora.ts)
// is split with its base, so that B A has W's slice shape and the adapter adds to exactly the
// outputs the base computes here:
//   colwise  B (out, r) by W's output rows (per chunk for a fused q, k, v), A whole. dA is a sum of
//            every rank's B slice's part: A is replicated with a partial gradient, all-reduced
//            over g like a sequence-parallel norm's. The input (replicated or gathered) is the same
//            on every rank, and so is the adapter's dropout mask (the common stream).
//   rowwise  A (r, in) by W's input columns, B whole. A_r x_r is partial, and B (sum_r A_r x_r) =
//            sum_r B A_r x_r, so each rank's delta is added before the base's all-reduce (or
//            reduce-scatter) and summed with it; dB is partial and all-reduced. The adapter's
//            dropout draws the mask for the whole input from the common stream, as one process
//            draws it, and keeps this rank's columns: tp draws one process's masks (data-parallel
//            ranks, as for any dropout, each draw for their own rows).
// Both adapter Linears count as styled: their gradients, partly reduced by hooks, stay in I.
// Merging works on the slices (B_r A, or B A_r, is W's slice of B A).
//
// [Note: tp dropout] Dropout masks must be the same on every rank where activations are replicated
// and different where they are sharded (Megatron's RNG tracker). Every rank of g draws the same
// stream, so replicated-region dropout agrees by itself; a sharded-region dropout draws one seed
// from that stream, reseeds with it and the rank, and reseeds the common stream afterwards from the
// seed alone, so the ranks' streams stay equal. Activation checkpointing replays it (it reseeds the
// common stream before the recompute).
//
// Weights: a style slices the tensor the model built, so a tp run starts from exactly the weights
// of one process (GPT draws each parameter from its own seed). A parameter tensor keeps its
// identity (set_ onto the slice), so tied uses stay tied and are sliced once.
import { type Tensor, cat, manualSeed, noGrad, ones, randint, tidy } from '../../tensor/index.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import { Module } from '../../nn/module.js';
import { Dropout, Embedding, LayerNorm, Linear, RMSNorm } from '../../nn/layers.js';
import * as F from '../../nn/functional.js';
import { castFor, castParam } from '../../nn/precision.js';
import { allReduceInPlace, allReduceSum, copyToRegion, gatherLastDim, gatherSequence, reduceFromRegion, reduceScatterSequence, scatterSequence } from './comm.js';
import type { HeadLossRequest } from '../../nn/kernels/lm_head.js';
import type { VocabShard } from '../../nn/kernels/linear_cross_entropy.js';
import { loraAdapterOf } from '../../nn/lora.js';

export type Activation = 'replicated' | 'sequenceSharded';

export type TpStyle =
  | { kind: 'colwise'; input?: Activation | 'prepared'; output?: 'sharded' | 'replicated'; chunks?: number }
  | { kind: 'prepareInput'; input?: Activation }
  | { kind: 'rowwise'; output?: Activation }
  | { kind: 'vocabEmbedding'; output?: Activation }
  | { kind: 'sequenceParallel'; input?: Activation }
  | { kind: 'localRng' }
  | { kind: 'lossParallel'; input?: Activation };

export type TpStyleName = 'colwise' | 'prepareInput' | 'rowwise' | 'vocabEmbedding' | 'sequenceParallel' | 'localRng' | 'lossParallel';

/** Module path -> style. Paths are dotted module names; `*` matches one name (e.g. `layers.*.mlp.fc`). */
export type TpPlan = Record<string, TpStyle | TpStyleName>;

/** How a parameter lies over the tensor-parallel group. */
export type TpPlacement =
  | { kind: 'shard'; group: ProcessGroup; dim: number; chunks: number }
  | { kind: 'replicate'; group: ProcessGroup; partialGrad: boolean };

/**
 * What applying a plan did: the group, whether the loss is vocab-parallel, the parameters it placed
 * and the modules it restyled. The only record of them: readers get it from the ParallelModel
 * (placements()) or from whoever applied the plan, never from a registry.
 */
export interface TensorParallelApplied {
  group: ProcessGroup;
  lossParallel: boolean;
  /** Every parameter of the module and its placement (unplanned parameters are replicated). */
  placements: ReadonlyMap<Tensor, TpPlacement>;
  /**
   * Modules whose forward a style replaced: their input and output are not their matmul's (a
   * communication op sits between), so the zero-bubble schedule keeps their weight gradients in I.
   */
  styled: ReadonlySet<Module>;
  /** Removes the gradient hooks (the module is being disposed). */
  dispose(): void;
}

/** A plan that cannot be applied: every problem, each naming the fix. */
export class TensorParallelError extends Error {
  constructor(problems: string[]) {
    super(`tensor parallelism cannot be applied:\n  - ${problems.join('\n  - ')}`);
    this.name = 'TensorParallelError';
  }
}

function styleOf(s: TpStyle | TpStyleName): TpStyle {
  return typeof s === 'string' ? ({ kind: s } as TpStyle) : s;
}

function pathRegex(path: string): RegExp {
  const esc = path.split('.').map((part) => (part === '*' ? '[^.]+' : part.replace(/[$()*+.?[\\\]^{|}]/g, '\\$&')));
  return new RegExp(`^${esc.join('\\.')}$`);
}

/** Which modules each plan entry names (an entry that names none is an error). */
function resolvePlan(module: Module, plan: TpPlan): [string, Module, TpStyle][] {
  const mods = module.namedModules();
  const out: [string, Module, TpStyle][] = [];
  const problems: string[] = [];
  const taken = new Map<string, string>();
  for (const [key, s] of Object.entries(plan)) {
    const re = pathRegex(key);
    const hits = mods.filter(([name]) => re.test(name));
    if (hits.length === 0) problems.push(`plan entry '${key}' names no module (module paths look like ${mods.slice(1, 4).map(([n]) => `'${n}'`).join(', ')})`);
    for (const [name, m] of hits) {
      if (taken.has(name)) problems.push(`module '${name}' is named by two plan entries ('${taken.get(name)}' and '${key}')`);
      taken.set(name, key);
      out.push([name, m, styleOf(s)]);
    }
  }
  if (problems.length) throw new TensorParallelError(problems);
  return out;
}

/**
 * Applies a tensor-parallel plan to a module over group g (every rank of g calls it with the same
 * plan, on the same model). Parameters the plan does not name are replicated.
 */
export function parallelizeModule(module: Module, g: ProcessGroup, plan: TpPlan): TensorParallelApplied {
  const n = g.size;
  const placed = new Map<Tensor, TpPlacement>();
  const styled = new Set<Module>();
  const wrap = (m: Module, make: (orig: Forward) => Forward): void => {
    styled.add(m);
    restyle(m, make);
  };
  const removers: (() => void)[] = [];
  const sharded = new Set<Tensor>();
  const problems: string[] = [];
  let lossParallel = false;

  // A parameter becomes its slice once, keeping its identity (tied uses share it).
  const shard = (where: string, p: Tensor, dim: number, chunks = 1): void => {
    if (sharded.has(p)) return;
    const size = p.shape[dim]!;
    if (size % (n * chunks) !== 0) {
      problems.push(`${where}: dimension ${dim} of size ${size} does not divide by ${chunks > 1 ? `${chunks} chunks x ` : ''}the tensor-parallel degree ${n}; choose parallel.tp dividing it`);
      return;
    }
    // In one tidy scope: every view and copy made on the way goes now, not when the GC collects its
    // handle (a view left to the GC kept the whole unsharded weight resident through the first steps:
    // 95 MiB of the 25M GPT at tp 2).
    tidy(() => noGrad(() => {
      const part = size / chunks / n;
      const pieces = Array.from({ length: chunks }, (_, c) => p.narrow(dim, c * (size / chunks) + g.rank * part, part));
      // A copy of its own in both cases (cat of one contiguous view may keep the whole weight's storage).
      p.set_(pieces.length === 1 ? pieces[0]!.contiguous().clone() : cat(pieces, dim));
    }));
    sharded.add(p);
    placed.set(p, { kind: 'shard', group: g, dim, chunks });
  };
  const partial = (p: Tensor | undefined): void => {
    if (!p || placed.get(p)?.kind === 'shard') return;
    placed.set(p, { kind: 'replicate', group: g, partialGrad: true });
  };

  const entries = resolvePlan(module, plan);
  // A prepared input is communicated by an enclosing prepareInput; without one it would not be at all.
  const preparers = entries.filter(([, , st]) => st.kind === 'prepareInput').map(([nm]) => nm);
  for (const [name, , st] of entries) {
    if (st.kind === 'colwise' && st.input === 'prepared' && !preparers.some((p) => p === '' || name.startsWith(`${p}.`))) {
      problems.push(`'${name}' (colwise) takes a prepared input, and no module enclosing it has the prepareInput style; add one for the module that shares its input, or give '${name}' input 'replicated' or 'sequenceSharded'`);
    }
  }
  for (const [name, m, style] of entries) {
    const where = `'${name}' (${style.kind})`;
    const need = (cls: Function, what: string): boolean => {
      if (m instanceof cls) return true;
      problems.push(`${where}: the style applies to ${what}, and '${name}' is a ${m.constructor.name}`);
      return false;
    };
    switch (style.kind) {
      case 'colwise':
      case 'lossParallel': {
        if (!need(Linear, 'a Linear')) break;
        const lin = m as Linear;
        shard(`${name}.weight`, lin.weight, 0, style.kind === 'colwise' ? style.chunks ?? 1 : 1);
        if (lin.bias) shard(`${name}.bias`, lin.bias, 0, style.kind === 'colwise' ? style.chunks ?? 1 : 1);
        const lora = loraAdapterOf(lin);
        if (lora) {
          // [Note: LoRA under tp] B's rows are the output rows W has here (per chunk), A is whole.
          shard(`${name}.loraB.weight`, lora.B.weight, 0, style.kind === 'colwise' ? style.chunks ?? 1 : 1);
          partial(lora.A.weight);
          styled.add(lora.A).add(lora.B);
        }
        const input = style.input ?? 'replicated';
        const gather = style.kind === 'colwise' && style.output === 'replicated';
        const chunks = style.kind === 'colwise' ? style.chunks ?? 1 : 1;
        if (style.kind === 'lossParallel') lossParallel = true;
        // A prepared input needs nothing here: the Linear stays a plain matmul (the zero-bubble
        // schedule can then split its weight gradient).
        if (input === 'prepared' && !gather) break;
        // A loss request to the head ([Note: deferred head]) reaches it under lossParallel only, with
        // this rank's vocabulary shard; a head that gathers its logits computes them.
        const shardOf: VocabShard = { index: g.rank, parts: n, allReduce: (t, op) => allReduceInPlace(t, g, op) };
        wrap(lin, (orig) => (x: Tensor, ...rest: unknown[]) => {
          const req = style.kind === 'lossParallel' && rest[0] ? [{ ...(rest[0] as HeadLossRequest), vocabShard: shardOf }] : [];
          const y = orig(input === 'prepared' ? x : input === 'sequenceSharded' ? gatherSequence(x, g) : copyToRegion(x, g), ...req);
          if (!gather) return y;
          // A fused layer gathers each output separately: q, k, v, not rank 0's q k v then rank 1's.
          return chunks === 1 ? gatherLastDim(y, g) : cat(y.chunk(chunks, -1).map((c) => gatherLastDim(c, g)), -1);
        });
        break;
      }
      case 'prepareInput': {
        const input = style.input ?? 'replicated';
        wrap(m, (orig) => (x: Tensor, ...rest: unknown[]) => {
          const [xc] = castFor('linear', x) as [Tensor];
          return orig(input === 'sequenceSharded' ? gatherSequence(xc, g) : copyToRegion(xc, g), ...rest);
        });
        break;
      }
      case 'rowwise': {
        if (!need(Linear, 'a Linear')) break;
        const lin = m as Linear;
        shard(`${name}.weight`, lin.weight, 1);
        const output = style.output ?? 'replicated';
        if (output === 'sequenceSharded') partial(lin.bias);
        const lora = loraAdapterOf(lin);
        if (lora) {
          // [Note: LoRA under tp] A's columns are the input columns W has here, B is whole.
          shard(`${name}.loraA.weight`, lora.A.weight, 1);
          partial(lora.B.weight);
          styled.add(lora.A).add(lora.B);
          wrap(lora.dropout, () => (x: Tensor) => wideDropout(lora.dropout, x, g));
        }
        // The bias is added once, after the partial products are summed; so is the adapter's
        // partial delta B (A_r x_r), which rides in the same sum.
        wrap(lin, () => (x: Tensor) => {
          const [xc] = castFor('linear', x) as [Tensor];
          const w = castParam('linear', lin.weight);
          const base = F.linear(xc, w);
          const y = lora && lora.enabled && !lora.merged ? base.add(lora.delta(x)) : base;
          const sum = output === 'sequenceSharded' ? reduceScatterSequence(y, g) : reduceFromRegion(y, g);
          return lin.bias ? sum.add(castParam('linear', lin.bias)) : sum;
        });
        break;
      }
      case 'vocabEmbedding': {
        if (!need(Embedding, 'an Embedding')) break;
        const emb = m as Embedding;
        const V = emb.numEmbeddings;
        shard(`${name}.weight`, emb.weight, 0);
        const rows = V / n, lo = g.rank * rows;
        const output = style.output ?? 'replicated';
        wrap(emb, () => (ids: Tensor) => {
          // Ids this rank does not hold look up row 0 and are zeroed; the sum over ranks is the lookup.
          const mine = ids.ge(lo).to(emb.weight.dtype).mul(ids.lt(lo + rows).to(emb.weight.dtype));
          const out = F.embedding(ids.sub(lo).clamp(0, rows - 1), castParam('embedding', emb.weight)).mul(mine.unsqueeze(-1));
          return output === 'sequenceSharded' ? reduceScatterSequence(out, g) : reduceFromRegion(out, g);
        });
        break;
      }
      case 'sequenceParallel': {
        if (!(m instanceof LayerNorm || m instanceof RMSNorm || m instanceof Dropout)) {
          problems.push(`${where}: sequence parallelism applies to LayerNorm, RMSNorm and Dropout, and '${name}' is a ${m.constructor.name}`);
          break;
        }
        for (const [, p] of m.namedParameters()) partial(p);
        const scatter = style.input === 'replicated';
        const local = m instanceof Dropout;
        wrap(m, (orig) => (x: Tensor) => {
          const xs = scatter ? scatterSequence(x, g) : x;
          return local ? withLocalRng(m as Dropout, g, () => orig(xs)) : orig(xs);
        });
        break;
      }
      case 'localRng': {
        if (!need(Dropout, 'a Dropout')) break;
        wrap(m, (orig) => (x: Tensor) => withLocalRng(m as Dropout, g, () => orig(x)));
        break;
      }
      default:
        problems.push(`${where}: unknown style; use one of colwise, prepareInput, rowwise, vocabEmbedding, sequenceParallel, localRng, lossParallel`);
    }
  }
  if (problems.length) throw new TensorParallelError(problems);

  // Unplanned parameters are replicated with whole gradients; partial ones are summed over g as
  // each use's gradient arrives (before it is accumulated, so every rank's .grad is the whole one).
  for (const [, p] of module.namedParameters()) {
    const pl = placed.get(p) ?? { kind: 'replicate', group: g, partialGrad: false };
    placed.set(p, pl);
    // A frozen one (a LoRA run's base norms under sequence parallelism) has no gradient to sum.
    if (pl.kind === 'replicate' && pl.partialGrad && p.requiresGrad && n > 1) removers.push(p.registerHook((grad) => allReduceSum(grad, g)));
  }
  return {
    group: g,
    lossParallel,
    placements: placed,
    styled,
    dispose: () => {
      for (const r of removers.splice(0)) r();
    },
  };
}

/** A module's forward: a tensor first, then whatever else it takes (attention's position offset). */
type Forward = (x: Tensor, ...rest: unknown[]) => Tensor;

/** Replaces a module instance's forward with one built from the original. */
function restyle(m: Module, make: (orig: Forward) => Forward): void {
  const target = m as unknown as { forward: Forward };
  const orig = target.forward.bind(m);
  target.forward = make(orig);
}

/**
 * The adapter's dropout on a row-parallel Linear's input, sharded on its last dim: this rank's
 * columns of the mask one process draws for the whole input ([Note: LoRA under tp]).
 */
function wideDropout(d: Dropout, x: Tensor, g: ProcessGroup): Tensor {
  if (!d.training || d.p === 0) return x;
  const cols = x.shape[x.ndim - 1]!;
  // dropout(ones) is the mask scaled by 1 / (1 - p), x * mask what dropout(x) computes.
  const mask = noGrad(() => F.dropout(ones([...x.shape.slice(0, -1), cols * g.size], { dtype: x.dtype }), d.p, true).narrow(-1, g.rank * cols, cols));
  return x.mul(mask);
}

const MIX = 0x9e3779b9;
/** Runs a sharded-region dropout with a seed of this rank's own ([Note: tp dropout]). */
function withLocalRng(d: Dropout, g: ProcessGroup, fn: () => Tensor): Tensor {
  if (!d.training || d.p === 0 || g.size === 1) return fn();
  const s = randint(0, 2 ** 31 - 1, [1]).item() as number;
  manualSeed((s ^ Math.imul(g.rank + 1, MIX)) >>> 0);
  try {
    return fn();
  } finally {
    manualSeed((s ^ 0x5bd1e995) >>> 0);
  }
}
