// [Note: kernel choice] Which attention the models run: "eager" (op by op, the default) or "fused"
// (the blocked kernel, src/nn/kernels/attention.ts). An ambient setting like the activation
// checkpoint mode: the trainer sets it from [train] kernels around each step, and the models read it
// where attention is computed (the context-parallel ring too: [Note: ring kernel]). Attention with
// active dropout stays eager.
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
