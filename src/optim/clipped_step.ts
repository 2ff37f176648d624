// The step after the gradients are finished: the norm, clipping, and the optimizer's update, the
// same for the trainer and the planner's measured steps under every layout.
import type { GradientSource } from '../parallel/grads.js';
import { clipFactor, clipGradNorm, gradNorm } from '../parallel/grads.js';
import type { Optimizer } from './optimizer.js';

/**
 * Clips the gradients to maxNorm (0: no clipping) and steps the optimizer, unless the global norm
 * is not finite (the same on every rank, so every rank skips alike); returns the norm before
 * clipping. When the step runs the one-pass update ([Note: kernel choice]), clipping's factor goes
 * to it instead of a pass over the gradients ([Note: folded clip] in native/optim.cc): the
 * gradient buffers then keep their unclipped values, which nothing reads after the step (the
 * next step's zeroGrad clears them).
 */
export function clippedStep(grads: GradientSource, optimizer: Optimizer<{ lr: number }>, maxNorm: number): number {
  if (!(maxNorm > 0)) {
    const norm = gradNorm(grads);
    if (Number.isFinite(norm)) optimizer.step();
    return norm;
  }
  const folded = optimizer.fusedInEffect();
  const { norm, scale } = folded ? clipFactor(grads, maxNorm) : clipGradNorm(grads, maxNorm);
  if (Number.isFinite(norm)) optimizer.step(folded ? { gradScale: scale } : {});
  return norm;
}
