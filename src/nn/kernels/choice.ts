// [Note: kernel choice] Which kernels the models run: "eager" (op by op, the default) or "fused"
// (attention as one blocked kernel, src/nn/kernels/attention.ts; the training loss from the hidden
// state, [Note: deferred head] in lm_head.ts; RMSNorm, LayerNorm, SwiGLU, GELU and rotary as one pass
// each, src/nn/kernels/pointwise.ts). An ambient setting like the activation checkpoint mode: the
// trainer sets it from [train] kernels around each step (forward and backward), and the models read
// it where attention, the norms, the MLP and the head run (the context-parallel ring's blocks too:
// [Note: ring kernel]). Attention with dropout, the MoE experts and generation's decode stay eager.
import { ambientChoice } from '../ambient_choice.js';

export const KERNEL_CHOICES = ['eager', 'fused'] as const;
export type KernelChoice = (typeof KERNEL_CHOICES)[number];

const setting = ambientChoice('kernels', KERNEL_CHOICES, 'eager');

/** Runs fn with the models' kernels chosen by `choice`. */
export function withKernels<T>(choice: KernelChoice, fn: () => T): T {
  return setting.with(choice, fn);
}

/** The kernels in effect ("eager" outside withKernels). */
export function kernelChoice(): KernelChoice {
  return setting.current();
}
