// Numeric checks shared by the tests: closeness with a report of the worst element, a seeded JS
// random source, and a central-difference gradient check in float64.
import assert from 'node:assert/strict';
import { Tensor, tensor, tidy, noGrad, keep, setDefaultDtype } from '../../src/tensor/index.js';

/** Runs fn with float64 as the default dtype (the oracles' precision), float32 again after. */
export function withFloat64<T>(fn: () => T): T {
  setDefaultDtype('float64');
  try {
    return fn();
  } finally {
    setDefaultDtype('float32');
  }
}

/** Deterministic uniform [0, 1) numbers (mulberry32), independent of the tensor generator. */
export function seededRandom(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** n numbers in [lo, hi) from a seeded source. */
export function uniformArray(n: number, seed: number, lo = -1, hi = 1): number[] {
  const r = seededRandom(seed);
  return Array.from({ length: n }, () => lo + (hi - lo) * r());
}

function numbers(x: Tensor | ArrayLike<number | bigint>): number[] {
  return x instanceof Tensor ? x.toNumbers() : Array.from(x, Number);
}

/**
 * Asserts |a - b| <= atol + rtol * |b| elementwise (b is the reference); the message names the worst
 * element and the largest relative error seen.
 */
export function assertClose(
  actual: Tensor | ArrayLike<number | bigint>, expected: Tensor | ArrayLike<number | bigint>,
  opts: { rtol?: number; atol?: number } = {}, what = 'values',
): void {
  const a = numbers(actual), b = numbers(expected);
  assert.equal(a.length, b.length, `${what}: ${a.length} elements vs ${b.length} expected`);
  const rtol = opts.rtol ?? 1e-5, atol = opts.atol ?? 0;
  let worst = -1, worstExcess = 0;
  for (let i = 0; i < a.length; i++) {
    const ai = a[i]!, bi = b[i]!;
    if (Number.isNaN(ai) !== Number.isNaN(bi)) { worst = i; worstExcess = Infinity; break; }
    if (ai === bi) continue; // also equal infinities
    const excess = Math.abs(ai - bi) - (atol + rtol * Math.abs(bi));
    if (!(excess <= 0) && (worst < 0 || excess > worstExcess)) { worst = i; worstExcess = excess; }
  }
  if (worst >= 0) {
    assert.fail(`${what}: element ${worst} is ${a[worst]}, expected ${b[worst]} (rtol ${rtol}, atol ${atol}; ` +
      `max relative error ${maxRelErr(a, b).toExponential(2)} over ${a.length} elements)`);
  }
}

/** max |a - b| / max |b|: an error relative to the tensor's scale. */
export function scaledErr(actual: Tensor | ArrayLike<number>, expected: Tensor | ArrayLike<number>): number {
  const a = numbers(actual), b = numbers(expected);
  let d = 0, m = 0;
  for (let i = 0; i < a.length; i++) {
    d = Math.max(d, Math.abs(a[i]! - b[i]!));
    m = Math.max(m, Math.abs(b[i]!));
  }
  return m === 0 ? d : d / m;
}

function maxRelErr(a: number[], b: number[]): number {
  let r = 0;
  for (let i = 0; i < a.length; i++) r = Math.max(r, Math.abs(a[i]! - b[i]!) / Math.max(Math.abs(b[i]!), 1e-300));
  return r;
}

export interface GradcheckInput {
  /** float64 values that will be perturbed, or a fixed tensor (indices, masks) passed as is. */
  data: number[] | Tensor;
  shape?: number[];
}

/**
 * Compares the autograd gradient of sum_k w_k * f(x)_k (fixed random w, so every output element
 * matters) with central differences, for every float input given as numbers. Runs in float64.
 */
export function gradcheck(
  name: string,
  f: (...xs: Tensor[]) => Tensor | Tensor[],
  inputs: GradcheckInput[],
  opts: { eps?: number; rtol?: number; atol?: number } = {},
): void {
  const eps = opts.eps ?? 1e-6;
  const make = (i: number, values?: number[]): Tensor => {
    const inp = inputs[i]!;
    if (inp.data instanceof Tensor) return inp.data;
    const v = values ?? inp.data;
    return tensor(Float64Array.from(v), { shape: inp.shape ?? [v.length] });
  };
  // Output weights, fixed per output element.
  let weights: Tensor[] | undefined;
  const objective = (outs: Tensor | Tensor[]): Tensor => {
    const list = Array.isArray(outs) ? outs : [outs];
    if (!weights) {
      weights = list.map((o, k) => keep(noGrad(() => tensor(Float64Array.from(uniformArray(o.numel(), 1000 + k, 0.5, 1.5)), { shape: o.shape }))));
    }
    return list.map((o, k) => o.mul(weights![k]!).sum()).reduce((a, b) => a.add(b));
  };
  const analytic: (number[] | undefined)[] = tidy(() => {
    const xs = inputs.map((inp, i) => {
      const t = make(i);
      if (!(inp.data instanceof Tensor)) t.requiresGrad = true;
      return t;
    });
    objective(f(...xs)).backward();
    return xs.map((x, i) => {
      if (inputs[i]!.data instanceof Tensor) return undefined;
      const g = x.grad;
      assert.ok(g, `${name}: input ${i} got no gradient`);
      return g.toNumbers();
    });
  });
  const evalAt = (i: number, values: number[]): number =>
    tidy(() => noGrad(() => objective(f(...inputs.map((_, j) => make(j, j === i ? values : undefined)))).item()));
  inputs.forEach((inp, i) => {
    if (inp.data instanceof Tensor) return;
    const base = [...inp.data];
    const numeric = base.map((v, j) => {
      base[j] = v + eps;
      const up = evalAt(i, base);
      base[j] = v - eps;
      const down = evalAt(i, base);
      base[j] = v;
      return (up - down) / (2 * eps);
    });
    assertClose(analytic[i]!, numeric, { rtol: opts.rtol ?? 1e-5, atol: opts.atol ?? 1e-7 }, `${name}: d/d(input ${i})`);
  });
  for (const w of weights ?? []) w.dispose();
}
