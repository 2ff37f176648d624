// Activation checkpointing: a transformer block's forward runs without keeping its activations and
// runs again in backward to get them (torch.utils.checkpoint, non-reentrant in effect: one outer
// backward; the recompute's own backward is an autograd.grad inside the node's backward).
//
// [Note: activation checkpoint]
// - Built on defineFunction (src/tensor/function.ts): the node's inputs are the block input and the
//   block's parameters, so parameter gradients come out of the node and are accumulated by the
//   outer backward into the float32 .grad views: data-parallel readiness hooks fire as without
//   checkpointing, and nothing reduces a gradient from inside the nested pass.
// - Forward keeps only the input (an alias, no copy). The node is built inside the block's call(),
//   so parallel wrappers' hooks surround it: ZeRO-3 has the parameters gathered while the node
//   takes its parameter inputs, and its backward pre-hook on the block's output regathers them
//   before the node's backward recomputes the block (one gather for recompute and backward).
// - Dropout replays the same mask: when the block is training with dropout, forward draws a seed
//   from the generator and reseeds before the block and before its recompute.
// - In float32 the recompute repeats the same kernels on the same values, so gradients are
//   bit-identical to running without checkpointing (test/checkpointing_activation.test.ts); for
//   "selective" see [Note: selective checkpointing].
import { type Tensor, defineFunction, grad, keep, manualSeed, randint } from '../tensor/index.js';
import type { Module } from './module.js';

export type ActivationCheckpoint = 'none' | 'full' | 'selective';
export const ACTIVATION_CHECKPOINTS: readonly ActivationCheckpoint[] = ['none', 'full', 'selective'];

const modes: ActivationCheckpoint[] = [];

/** Runs fn with activation checkpointing of transformer blocks set to mode (the trainer opens it per step). */
export function withActivationCheckpoint<T>(mode: ActivationCheckpoint, fn: () => T): T {
  if (!ACTIVATION_CHECKPOINTS.includes(mode)) throw new Error(`activationCheckpoint "${mode}" is not one of ${ACTIVATION_CHECKPOINTS.map((m) => `"${m}"`).join(', ')}`);
  modes.push(mode);
  try {
    return fn();
  } finally {
    modes.pop();
  }
}

export function activationCheckpointMode(): ActivationCheckpoint {
  return modes[modes.length - 1] ?? 'none';
}

type Body = (x: Tensor) => Tensor;

// [Note: selective checkpointing] "selective" keeps each Linear's output (qkv, attention proj, fc,
// MLP proj: the matmuls that dominate the FLOPs) and recomputes the rest: LayerNorms, the attention
// core (its two products, softmax, dropout; the (B, nh, T, T) tensors are the big activations, as
// in Megatron's selective recompute) and GELU. In the recompute a Linear returns its kept output
// through a node whose backward is the linear's (dx = dy W, dW = dy^T x, db = sum dy), so the
// Linear's matmul is not run again. Those formulas are not ATen's addmm backward kernel for kernel,
// so selective gradients agree with no checkpointing to float32 rounding, not bit for bit.
let recording: Tensor[] | undefined;
let replaying: { list: Tensor[]; i: number } | undefined;

const linearFromOutput = defineFunction<[Tensor, Tensor, Tensor, Tensor | undefined]>({
  forward(ctx, y, x, w, b) {
    ctx.saveForBackward(x, w);
    ctx.state.bias = b !== undefined;
    return y.detach();
  },
  backward(ctx, g) {
    const [x, w] = ctx.savedTensors as [Tensor, Tensor];
    const out = w.shape[0]!, inn = w.shape[1]!;
    const g2 = g.reshape(-1, out);
    const gx = ctx.needsInputGrad[1] ? g.matmul(w) : undefined;
    const gw = ctx.needsInputGrad[2] ? g2.t().mm(x.reshape(-1, inn)) : undefined;
    const gb = ctx.state.bias && ctx.needsInputGrad[3] ? g2.sum(0) : undefined;
    return [undefined, gx, gw, gb];
  },
}, 'SelectiveLinear');

/** A Linear's output: computed, kept (selective forward) or taken from what was kept (selective recompute). */
export function linearOutput(x: Tensor, w: Tensor, b: Tensor | undefined, compute: () => Tensor): Tensor {
  if (replaying) {
    const y = replaying.list[replaying.i++];
    if (!y) throw new Error('selective checkpointing: the recompute ran more Linear layers than the forward');
    return linearFromOutput(y, x, w, b) as Tensor;
  }
  const y = compute();
  if (recording) recording.push(keep(y.detach()));
  return y;
}

const blockFn = defineFunction<[Module, Body, { seed?: number; selective?: boolean }, Tensor, ...Tensor[]]>({
  forward(ctx, block, body, rng, x) {
    ctx.state.args = [block, body];
    if (rng.seed !== undefined) manualSeed(rng.seed);
    const prev = recording;
    recording = rng.selective ? [] : undefined;
    let out: Tensor;
    try {
      out = body(x);
      ctx.state.kept = recording;
    } finally {
      recording = prev;
    }
    ctx.saveForBackward(x);
    ctx.state.seed = rng.seed;
    return out;
  },
  backward(ctx, g) {
    const [block, body] = ctx.state.args as [Module, Body];
    const seed = ctx.state.seed as number | undefined;
    const x = ctx.savedTensors[0]!.detach().requiresGrad_(ctx.needsInputGrad[3] ?? false);
    const params = block.parameters();
    const want = params.map((_, i) => ctx.needsInputGrad[4 + i] ?? false);
    if (seed !== undefined) manualSeed(seed);
    const kept = ctx.state.kept as Tensor[] | undefined;
    const prev = replaying;
    replaying = kept ? { list: kept, i: 0 } : undefined;
    let out: Tensor;
    try {
      out = body(x);
    } finally {
      replaying = prev;
    }
    const inputs = [...(x.requiresGrad ? [x] : []), ...params.filter((_, i) => want[i])];
    let gs: (Tensor | undefined)[];
    try {
      gs = grad([out], inputs, { gradOutputs: [g], allowUnused: true });
    } finally {
      for (const t of kept ?? []) t.dispose();
    }
    let k = 0;
    const gx = x.requiresGrad ? gs[k++] : undefined;
    const gp = params.map((_, i) => (want[i] ? gs[k++] : undefined));
    return [undefined, undefined, undefined, gx, ...gp];
  },
}, 'ActivationCheckpoint');

/**
 * body(x) (a block's forward, called from inside the block's call()) with its activations
 * recomputed in backward ([Note: activation checkpoint]). The node's inputs are x and all of the
 * block's parameters(), which body may use.
 */
export function checkpointBlock(block: Module, x: Tensor, body: Body, opts: { dropout?: boolean; selective?: boolean } = {}): Tensor {
  // A seed only when dropout draws: otherwise the generator's stream is left as without checkpointing.
  const rng = {
    ...(opts.dropout && block.training ? { seed: randint(0, 2 ** 31 - 1, [1]).item() } : {}),
    ...(opts.selective ? { selective: true } : {}),
  };
  return blockFn(block, body, rng, x, ...block.parameters()) as Tensor;
}
