// Custom autograd functions with a TypeScript forward and backward (torch.autograd.Function style):
// saved tensors, non-differentiable outputs, needsInputGrad. Activation checkpointing is built on it
// (src/nn/checkpoint.ts), and so will tensor parallelism's communication ops.
//
// [Note: function node] The node is native ([Note: native function node] in native/autograd.cc): a
// torch::autograd::Node whose apply calls back into TypeScript synchronously, as tensor hooks do.
//   - forward runs with recording off; each differentiable output is returned as an alias of what
//     forward returned (the same storage, no copy, also when that is another buffer's) whose
//     grad_fn is the node, with an edge to every input that needs a gradient.
//   - the node holds the saved tensors (freed with the graph, also when backward never runs) and
//     only the outputs' shapes, never the outputs.
//   - the engine calls the node once every output's gradient is known; an output backward did not
//     reach gets zeros here, so backward always sees one gradient per output.
// A backward run with `inputs` (the zero-bubble pipeline's input-gradient pass, then its
// weight-gradient pass on the retained graph) may reach some inputs in one pass and the rest in
// the next: backward is computed once, each input takes its answer in the pass that asks for it,
// and answers still unclaimed when the engine frees the graph are dropped.
import { native, type TensorHandle } from './native.js';
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
    const diffIdx = outs.flatMap((o, j) => (!ctx.nonDiff.has(o) && isFloatingTensor(o) ? [j] : []));
    if (needIdx.length === 0 || diffIdx.length === 0) {
      for (const t of ctx.saved) t.dispose();
      ctx.saved = [];
      return raw;
    }
    // Shapes only: backward must not keep the inputs or outputs alive (a checkpointed block would
    // hold its output twice), and an input may be freed by the time backward runs.
    const inMeta = needIdx.map((i) => ({ shape: (args[i] as Tensor).shape, dtype: (args[i] as Tensor).dtype }));
    const outMeta = diffIdx.map((j) => ({ shape: outs[j]!.shape, dtype: outs[j]!.dtype }));
    // Per input edge: undefined until backward ran, then its answer until handed over.
    let answers: (Tensor | undefined)[] | undefined;
    const run = (gradHs: (TensorHandle | undefined)[], savedHs: TensorHandle[]): (Tensor | undefined)[] => {
      // The engine runs a node with grad mode off (create_graph = false); backward may use autograd.
      // Its temporaries die with this scope; the answers are kept until the engine has taken them.
      const prev = native.setGradEnabled(true);
      try {
        return tidy(() => {
          ctx.saved = savedHs.map((h) => new Tensor(h)); // the node's handles, released after the call
          const gs = gradHs.map((h, k) => (h === undefined ? zeros(outMeta[k]!.shape, { dtype: outMeta[k]!.dtype }) : new Tensor(h)));
          const r = def.backward(ctx, ...gs);
          ctx.saved = [];
          const list = r === undefined || r instanceof Tensor ? [r] : r;
          if (list.length !== args.length) {
            throw new Error(`${name}.backward returned ${list.length} gradient(s) for ${args.length} argument(s): return one per argument (undefined where none)`);
          }
          return needIdx.map((i, e) => {
            const g = list[i];
            if (g === undefined) return undefined;
            const want = inMeta[e]!;
            if (g.shape.join(',') !== want.shape.join(',')) {
              throw new Error(`${name}.backward: gradient ${i} has shape [${g.shape}], its input [${want.shape}]`);
            }
            // A handle of our own (backward may return a tensor its caller owns), freed once handed over.
            return g.dtype === want.dtype ? g.detach() : g.to(want.dtype);
          });
        }).map((g) => (g ? keep(g) : undefined));
      } finally {
        native.setGradEnabled(prev);
      }
    };
    const handles = native.functionNode(
      name, needIdx.map((i) => (args[i] as Tensor).handle), diffIdx.map((j) => outs[j]!.handle), ctx.saved.map((t) => t.handle),
      (gradHs, wanted, savedHs, last) => {
        releaseHanded();
        answers ??= run(gradHs, savedHs);
        const given = answers.map((a, e) => {
          if (!a || !wanted[e]) return undefined;
          answers![e] = undefined;
          handed.push(a);
          return a.handle;
        });
        if (last) {
          for (const a of answers) a?.dispose();
          answers = [];
        }
        // The engine holds its own reference to what it took once this returns; our handles go at the
        // next function node's backward or when the pass ends, so parameter gradients are not held twice.
        if (handed.length > 0) native.queueBackwardCallback(releaseHanded);
        return given;
      },
    );
    for (const t of ctx.saved) t.dispose(); // the node holds them now
    ctx.saved = [];
    const results = outs.slice();
    diffIdx.forEach((j, k) => (results[j] = new Tensor(handles[k]!)));
    return single ? results[0] : results;
  };
}

const handed: Tensor[] = [];
function releaseHanded(): void {
  for (const t of handed.splice(0)) t.dispose();
}

function isFloatingTensor(t: Tensor): boolean {
  const d = t.dtype;
  return d === 'float32' || d === 'float64' || d === 'bfloat16' || d === 'float16';
}
