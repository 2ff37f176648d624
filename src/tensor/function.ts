// Custom autograd functions with a TypeScript forward and backward (torch.autograd.Function style):
// saved tensors, non-differentiable outputs, needsInputGrad. Activation checkpointing is built on it
// (src/nn/checkpoint.ts), and so will tensor parallelism's communication ops.
//
// [Note: function node] There is no native custom-node binding: the node is made of engine
// primitives that exist already, tensor hooks that may replace a gradient.
//   - forward runs with recording off; its outputs are detached results.
//   - every input that needs a gradient gets a carrier c_i = x_i.view(shape) (identity, ViewBackward).
//   - k = sum_i |sum(c_i)| * 0 is a scalar +0 that depends on every carrier; each output is
//     returned as o_j - k, the same bits as o_j (x - (+0) == x for every x, -0 included), now with a
//     path back to every input.
//   - a hook on each returned output records its incoming gradient; the engine runs k's node only
//     after every output it reaches has been processed, so when the first carrier's hook fires all
//     output gradients are known: that hook calls backward once and each carrier's hook replaces
//     its (zero) gradient with backward's answer for that input, which then flows on to x_i (to its
//     AccumulateGrad, for a parameter: readiness hooks fire as for any other use).
// The cost is a reduction over each input in forward and a broadcast zero in backward: small next to
// any op worth writing a custom function for. Inputs with inf/NaN make k NaN (0 * inf), as they
// would make the loss NaN anyway.
//
// A backward run with `inputs` (the zero-bubble pipeline's input-gradient pass, then its
// weight-gradient pass on the retained graph) reaches some carriers in one pass and the rest in the
// next: backward is computed once and each carrier takes its answer when it is reached.
import { native } from './native.js';
import { Tensor } from './tensor.js';
import { noGrad, isGradEnabled } from './autograd.js';
import { keep, tidy } from './scope.js';
import { zeros } from './creation.js';

export interface FunctionCtx {
  /** Per argument: true when it is a tensor that requires grad (and grad mode is on). */
  readonly needsInputGrad: readonly boolean[];
  /** Keeps tensors for backward (they outlive forward's scope and are freed after backward). */
  saveForBackward(...ts: Tensor[]): void;
  readonly savedTensors: readonly Tensor[];
  /** Outputs that get no gradient (indices, masks): returned as they are, with no path back. */
  markNonDifferentiable(...outs: Tensor[]): void;
  /** Anything else backward needs (shapes, scalars, a closure). */
  state: Record<string, unknown>;
}

export interface FunctionDef<A extends unknown[]> {
  /** Runs with gradient recording off. Returns one tensor or a list of them. */
  forward(ctx: FunctionCtx, ...args: A): Tensor | Tensor[];
  /**
   * One gradient per differentiable output (zeros for an output backward did not reach); returns
   * one gradient per argument (undefined for non-tensors and inputs that need none). Runs with
   * gradient recording on, so it may use autograd itself (checkpointing does).
   */
  backward(ctx: FunctionCtx, ...gradOutputs: Tensor[]): (Tensor | undefined)[] | Tensor | undefined;
}

class Ctx implements FunctionCtx {
  saved: Tensor[] = [];
  nonDiff = new Set<Tensor>();
  state: Record<string, unknown> = {};
  constructor(readonly needsInputGrad: boolean[]) {}
  saveForBackward(...ts: Tensor[]): void {
    // Own handles (aliases of the same storage): freeing them after backward leaves the caller's alone.
    for (const t of ts) this.saved.push(keep(t.detach()));
  }
  get savedTensors(): readonly Tensor[] {
    return this.saved;
  }
  markNonDifferentiable(...outs: Tensor[]): void {
    for (const o of outs) this.nonDiff.add(o);
  }
}

/**
 * Makes a differentiable function from a TypeScript forward and backward:
 * `const f = defineFunction({ forward(ctx, x) {...}, backward(ctx, g) {...} }); const y = f(x);`
 * Single-use graphs, as PyTorch's default (no double backward through it).
 */
export function defineFunction<A extends unknown[]>(def: FunctionDef<A>, name = 'Function'): (...args: A) => any {
  return (...args: A) => {
    const grad = isGradEnabled();
    const ctx = new Ctx(args.map((a) => grad && a instanceof Tensor && a.requiresGrad));
    const raw = noGrad(() => def.forward(ctx, ...args));
    const single = raw instanceof Tensor;
    const outs = single ? [raw] : raw;
    const needIdx = ctx.needsInputGrad.flatMap((n, i) => (n ? [i] : []));
    if (needIdx.length === 0) {
      for (const t of ctx.saved) t.dispose();
      return raw;
    }
    const inMeta = args.map((a, i) => (ctx.needsInputGrad[i] ? { shape: (a as Tensor).shape.join(','), dtype: (a as Tensor).dtype } : undefined));
    // [Note: function node]
    const carriers = needIdx.map((i) => {
      const x = args[i] as Tensor;
      return x.view(...x.shape);
    });
    const k = tidy(() => carriers.map((c) => c.sum().abs()).reduce((a, b) => a.add(b)).mul(0));
    const diff = outs.map((o) => !ctx.nonDiff.has(o) && isFloatingTensor(o));
    const gradOuts: (Tensor | undefined)[] = outs.map(() => undefined);
    // Shapes only: backward must not keep the forward's outputs alive (each is returned as o - k, a
    // new tensor; holding o too would double what a checkpointed block keeps).
    const outMeta = outs.map((o) => ({ shape: o.shape, dtype: o.dtype }));
    const results = outs.map((o, j) => {
      if (!diff[j]) return o;
      const r = o.sub(k);
      r.registerHook((g) => {
        gradOuts[j]?.dispose();
        gradOuts[j] = keep(g);
      });
      return r;
    });
    let answers: (Tensor | undefined)[] | undefined;
    let pending = carriers.length;
    const release = (): void => {
      for (const t of ctx.saved) t.dispose();
      for (const g of gradOuts) g?.dispose();
      ctx.saved = [];
    };
    carriers.forEach((c, ci) => {
      const argIdx = needIdx[ci]!;
      c.registerHook((zero) => {
        releasePending();
        if (answers === undefined) {
          const gs = outMeta.flatMap((o, j) => (diff[j] ? [gradOuts[j] ?? keep(zeros(o.shape, { dtype: o.dtype }))] : []));
          // The engine runs hooks with grad mode off (create_graph = false); backward may use autograd.
          // Its temporaries die with this scope; the answers are own aliases, freed after backward.
          const prev = native.setGradEnabled(true);
          try {
            answers = tidy(() => {
              const r = def.backward(ctx, ...gs);
              const list = r === undefined || r instanceof Tensor ? [r] : r;
              if (list.length !== args.length) {
                throw new Error(`${name}.backward returned ${list.length} gradient(s) for ${args.length} argument(s): return one per argument (undefined where none)`);
              }
              return list.map((g, i) => {
                if (g === undefined || !ctx.needsInputGrad[i]) return undefined;
                const want = inMeta[i]!; // the input itself may be freed by now (its scope ended)
                if (g.shape.join(',') !== want.shape) {
                  throw new Error(`${name}.backward: gradient ${i} has shape [${g.shape}], its input [${want.shape}]`);
                }
                return g.dtype === want.dtype ? g.detach() : g.to(want.dtype);
              });
            }).map((g) => (g ? keep(g) : undefined));
          } finally {
            native.setGradEnabled(prev);
          }
          for (let j = 0; j < gradOuts.length; j++) gradOuts[j]?.dispose();
          for (const t of ctx.saved) t.dispose();
          ctx.saved = [];
        }
        const a = answers[argIdx];
        answers[argIdx] = undefined;
        pending -= 1;
        // The engine takes its own reference to the replacement as the hook returns, so our handle can
        // go at the next hook of any function (or when backward ends): holding every answer until the
        // end of backward would keep a second copy of all the parameter gradients alive.
        releasePending();
        if (a) {
          pendingRelease.push(a);
          native.queueBackwardCallback(releasePending);
        }
        if (pending === 0) native.queueBackwardCallback(release);
        return a ?? zero;
      });
    });
    for (const c of carriers) c.dispose(); // the graph holds them; the hooks live with their nodes
    return single ? results[0] : results;
  };
}

const pendingRelease: Tensor[] = [];
function releasePending(): void {
  for (const t of pendingRelease.splice(0)) t.dispose();
}

function isFloatingTensor(t: Tensor): boolean {
  const d = t.dtype;
  return d === 'float32' || d === 'float64' || d === 'bfloat16' || d === 'float16';
}
