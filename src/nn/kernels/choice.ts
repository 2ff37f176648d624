// [Note: kernel choice] Which kernels the models run: "eager" (op by op, the default) or "fused"
// (the blocked attention, src/nn/kernels/attention.ts, and the one-pass RMSNorm, LayerNorm, SwiGLU,
// GELU and rotary, src/nn/kernels/pointwise.ts). An ambient setting like the activation checkpoint
// mode: the trainer sets it from [train] kernels around each step, and the layers read it where they
// compute. Attention with dropout, the context-parallel ring, the MoE experts and generation's decode
// stay eager.
export const KERNEL_CHOICES = ['eager', 'fused'] as const;
export type KernelChoice = (typeof KERNEL_CHOICES)[number];

const choices: KernelChoice[] = [];

/** Runs fn with the models' attention computed by `choice`. */
export function withKernels<T>(choice: KernelChoice, fn: () => T): T {
  if (!KERNEL_CHOICES.includes(choice)) throw new Error(`kernels "${choice}" is not one of ${KERNEL_CHOICES.map((m) => `"${m}"`).join(', ')}`);
  choices.push(choice);
  try {
    return fn();
  } finally {
    choices.pop();
  }
}

/** The kernels in effect ("eager" outside withKernels). */
export function kernelChoice(): KernelChoice {
  return choices[choices.length - 1] ?? 'eager';
}
