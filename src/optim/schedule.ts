// Learning-rate schedules as pure functions of the step.

/** Linear warmup from 0 to maxLr over warmupSteps, then cosine decay to minLr at maxSteps. */
export function warmupCosine(o: { warmupSteps: number; maxSteps: number; maxLr: number; minLr: number }): (step: number) => number {
  if (o.warmupSteps < 0 || o.maxSteps <= 0) throw new Error('warmupCosine: warmupSteps >= 0 and maxSteps > 0 required');
  return (step: number) => {
    if (step < o.warmupSteps) return (o.maxLr * (step + 1)) / o.warmupSteps;
    if (step >= o.maxSteps) return o.minLr;
    const span = Math.max(1, o.maxSteps - o.warmupSteps);
    const ratio = (step - o.warmupSteps) / span;
    return o.minLr + 0.5 * (1 + Math.cos(Math.PI * ratio)) * (o.maxLr - o.minLr);
  };
}

export function constant(lr: number): (step: number) => number {
  return () => lr;
}
