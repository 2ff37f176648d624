// Activation checkpointing: a transformer block's forward runs without keeping its activations and
// runs again in backward to get them (torch.utils.checkpoint, non-reentrant in effect: one outer
// backward; the recompute's own backward is an autograd.grad inside the node's backward).
//
// [Note: activation checkpoint]
// - Built on defineFunction (src/tensor/function.ts): the node's inputs are the block input and the
//   block's parameters, so parameter gradients come out of the node and are accumulated by the
//   outer backward into the float32 .grad views: data-parallel readiness hooks fire as without
//   checkpointing, and nothing reduces a gradient from inside the nested pass.
// - Forward keeps only the input (an alias, no copy). Backward recomputes through module.call, so
//   parallel wrappers' forward hooks run again (ZeRO-3 gathers the unit's parameters for the
//   recompute, as it must).
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

const blockFn = defineFunction<[Module & { call(x: Tensor): Tensor }, { seed?: number }, Tensor, ...Tensor[]]>({
  forward(ctx, block, rng, x) {
    if (rng.seed !== undefined) manualSeed(rng.seed);
    const out = block.call(x);
    ctx.saveForBackward(x);
    ctx.state.block = block;
    ctx.state.seed = rng.seed;
    return out;
  },
  backward(ctx, g) {
    const block = ctx.state.block as Module & { call(x: Tensor): Tensor };
    const seed = ctx.state.seed as number | undefined;
    const x = ctx.savedTensors[0]!.detach().requiresGrad_(ctx.needsInputGrad[2] ?? false);
    const params = block.parameters();
    const want = params.map((_, i) => ctx.needsInputGrad[3 + i] ?? false);
    if (seed !== undefined) manualSeed(seed);
    const out = block.call(x);
    const inputs = [...(x.requiresGrad ? [x] : []), ...params.filter((_, i) => want[i])];
    const gs = grad([out], inputs, { gradOutputs: [g], allowUnused: true });
    let k = 0;
    const gx = x.requiresGrad ? gs[k++] : undefined;
    const gp = params.map((_, i) => (want[i] ? gs[k++] : undefined));
    return [undefined, undefined, gx, ...gp];
  },
}, 'ActivationCheckpoint');

/**
 * block(x) with its activations recomputed in backward ([Note: activation checkpoint]). The block's
 * parameters are the node's inputs, so they must be its parameters() (all of them).
 */
export function checkpointBlock(block: Module & { call(x: Tensor): Tensor }, x: Tensor, opts: { dropout?: boolean } = {}): Tensor {
  // A seed only when dropout draws: otherwise the generator's stream is left as without checkpointing.
  const rng = opts.dropout && block.training ? { seed: randint(0, 2 ** 31 - 1, [1]).item() } : {};
  return blockFn(block, rng, x, ...block.parameters()) as Tensor;
}
