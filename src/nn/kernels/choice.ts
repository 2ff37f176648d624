// [Note: kernel choice] Which kernels the models and the optimizer run: "eager" (op by op) or
// "fused" (attention as one blocked kernel, src/nn/kernels/attention.ts; the training
// loss from the hidden state, [Note: deferred head] in lm_head.ts; RMSNorm, LayerNorm, SwiGLU, GELU
// and rotary as one pass each, src/nn/kernels/pointwise.ts; the optimizer's update as one pass per
// flat bucket, src/optim/fused.ts). An ambient setting like the activation checkpoint mode: the
// trainer sets it from [train] kernels around each step (forward and backward) and around its
// optimizer step, and the models read it where attention, the norms, the MLP (the MoE experts' too)
// and the head run (the context-parallel ring's blocks too: [Note: ring kernel]; generation's decode
// too, its attention and rotary against the cache), the optimizer in its step. Attention with dropout
// stays eager.
// `[train] kernels` defaults to "fused", so `flotilla train` and train() run the kernels; outside
// withKernels the setting is "eager": a model called in a loop of the user's own returns its logits
// as any module does (the fused loss defers the head to the criterion, [Note: deferred head]), and
// such a loop opts in by running its step inside withKernels('fused', ...).
import { ambientChoice } from '../ambient_choice.js';

export const KERNEL_CHOICES = ['eager', 'fused'] as const;
export type KernelChoice = (typeof KERNEL_CHOICES)[number];

const setting = ambientChoice('kernels', KERNEL_CHOICES, 'eager');

/** Runs fn with the models' kernels and the optimizer's update chosen by `choice`. */
export function withKernels<T>(choice: KernelChoice, fn: () => T): T {
  return setting.with(choice, fn);
}

/** The kernels in effect ("eager" outside withKernels). */
export function kernelChoice(): KernelChoice {
  return setting.current();
}
