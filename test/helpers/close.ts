// Test-side comparison of number arrays: the worst relative difference, named in the failure.
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
