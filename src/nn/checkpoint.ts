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
//   bit-identical to running without checkpointing (test/checkpointing_activation.test.ts).
import { type Tensor, defineFunction, grad, manualSeed, randint } from '../tensor/index.js';
import type { Module } from './module.js';

export type ActivationCheckpoint = 'none' | 'full' | 'selective';
export const ACTIVATION_CHECKPOINTS: readonly ActivationCheckpoint[] = ['none', 'full', 'selective'];

const modes: ActivationCheckpoint[] = [];

/** Runs fn with activation checkpointing of transformer blocks set to mode (the trainer opens it per step). */
export function withActivationCheckpoint<T>(mode: ActivationCheckpoint, fn: () => T): T {
  if (!ACTIVATION_CHECKPOINTS.includes(mode)) throw new Error(`activationCheckpoint "${mode}" is not one of ${ACTIVATION_CHECKPOINTS.map((m) => `"${m}"`).join(', ')}`);
  if (mode === 'selective') throw new Error('activation checkpointing "selective" is not implemented yet; use "full" (recompute each block) or "none"');
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

const blockFn = defineFunction<[Module, Body, { seed?: number }, Tensor, ...Tensor[]]>({
  forward(ctx, block, body, rng, x) {
    ctx.state.args = [block, body];
    if (rng.seed !== undefined) manualSeed(rng.seed);
    const out = body(x);
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
    const out = body(x);
    const inputs = [...(x.requiresGrad ? [x] : []), ...params.filter((_, i) => want[i])];
    const gs = grad([out], inputs, { gradOutputs: [g], allowUnused: true });
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
export function checkpointBlock(block: Module, x: Tensor, body: Body, opts: { dropout?: boolean } = {}): Tensor {
  // A seed only when dropout draws: otherwise the generator's stream is left as without checkpointing.
  const rng = opts.dropout && block.training ? { seed: randint(0, 2 ** 31 - 1, [1]).item() } : {};
  return blockFn(block, body, rng, x, ...block.parameters()) as Tensor;
}
