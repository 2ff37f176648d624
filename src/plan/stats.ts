// The planner's one statistic: measurements on a shared machine are kept as medians, never means
// (one slow step, process or launch moves a mean as far as it likes).

/** The element of median key (the upper middle of an even count). */
export function medianBy<T>(xs: readonly T[], key: (x: T) => number): T {
  if (xs.length === 0) throw new Error('medianBy: no values');
  return [...xs].sort((a, b) => key(a) - key(b))[Math.floor(xs.length / 2)]!;
}

export const median = (xs: readonly number[]): number => medianBy(xs, (x) => x);
