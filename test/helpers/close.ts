// Test-side comparison of numbers and number arrays: relative and scaled differences, named in the failure.
import assert from 'node:assert/strict';

/**
 * |a - b| / max(1e-3, |b|) <= rel for every element (the floor keeps near-zero values from
 * inflating the ratio). NaN anywhere fails.
 */
export function assertClose(a: ArrayLike<number>, b: ArrayLike<number>, rel: number, what: string): void {
  assert.equal(a.length, b.length, `${what}: lengths differ`);
  let worst = 0;
  let at = 0;
  for (let i = 0; i < a.length; i++) {
    const d = Math.abs(a[i]! - b[i]!) / Math.max(1e-3, Math.abs(b[i]!));
    if (!(d <= worst)) [worst, at] = [d, i];
  }
  assert.ok(worst <= rel, `${what}: max relative difference ${worst} > ${rel} at element ${at} (${a[at]} vs ${b[at]})`);
}

/** The largest |a - b| / max(1e-3, |b|) over two equal-length arrays (same floor as assertClose). */
export function maxRelDiff(a: ArrayLike<number>, b: ArrayLike<number>): number {
  assert.equal(a.length, b.length, 'arrays of different lengths');
  let w = 0;
  for (let i = 0; i < a.length; i++) w = Math.max(w, Math.abs(a[i]! - b[i]!) / Math.max(1e-3, Math.abs(b[i]!)));
  return w;
}

/** |a - b| / |b|: one number against its reference, no floor. */
export const relDiff = (a: number, b: number): number => Math.abs(a - b) / Math.abs(b);

/** The largest |a - b| over the largest |b|: bf16 noise in a tensor's small elements is not relative to them. */
export function scaledDiff(a: ArrayLike<number>, b: ArrayLike<number>): number {
  let d = 0, m = 0;
  for (let i = 0; i < a.length; i++) [d, m] = [Math.max(d, Math.abs(a[i]! - b[i]!)), Math.max(m, Math.abs(b[i]!))];
  return m === 0 ? d : d / m;
}
