// The TypeScript autograd Function (src/tensor/function.ts) against central finite differences in
// float64: several inputs and outputs, a non-tensor argument, a non-differentiable output, an unused
// output, inputs that need no gradient, and use inside a larger graph; then what the native node
// guarantees: outputs are the forward's memory (an aliased buffer's storage changes are seen),
// backward with inputs over a retained graph, and no handle left behind.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { defineFunction, tensor, randn, tidy, noGrad, manualSeed, liveTensors, backward, type Tensor } from '../src/tensor/index.js';
import { assertClose } from './oracle/check.js';

// f(x, w, s) = (tanh(x @ w) * s, argmax of x rows as int64 (non-differentiable), sum(x * x))
const fn = defineFunction<[Tensor, Tensor, number]>({
  forward(ctx, x, w, s) {
    const y = x.matmul(w).tanh();
    ctx.saveForBackward(x, w, y);
    ctx.state.s = s;
    const idx = x.argmax(1);
    ctx.markNonDifferentiable(idx);
    return [y.mul(s), idx, x.mul(x).sum()];
  },
  backward(ctx, gy, gsq) {
    const [x, w, y] = ctx.savedTensors as [Tensor, Tensor, Tensor];
    const s = ctx.state.s as number;
    const gz = gy.mul(s).mul(y.square().neg().add(1)); // d tanh = 1 - tanh^2
    const gx = gz.matmul(w.t()).add(x.mul(gsq.mul(2)));
    const gw = x.t().matmul(gz);
    return [ctx.needsInputGrad[0] ? gx : undefined, ctx.needsInputGrad[1] ? gw : undefined, undefined];
  },
}, 'TanhMatmul');

function loss(x: Tensor, w: Tensor, useSq = true): Tensor {
  const [y, idx, sq] = fn(x, w, 1.5) as [Tensor, Tensor, Tensor];
  assert.equal(idx.dtype, 'int64');
  assert.equal(idx.requiresGrad, false);
  // Used inside a larger graph: a second use of x outside the function too.
  const l = y.sin().sum().add(x.cos().sum());
  return useSq ? l.add(sq.mul(0.3)) : l;
}

function numericGrad(f: () => number, t: Tensor): number[] {
  const eps = 1e-6;
  const n = t.numel();
  const flat = t.view(-1);
  const out: number[] = [];
  for (let i = 0; i < n; i++) {
    const v = flat.narrow(0, i, 1);
    const x0 = v.item();
    noGrad(() => v.fill_(x0 + eps));
    const a = f();
    noGrad(() => v.fill_(x0 - eps));
    const b = f();
    noGrad(() => v.fill_(x0));
    out.push((a - b) / (2 * eps));
  }
  return out;
}

for (const useSq of [true, false]) {
  test(`defineFunction: gradients match finite differences in float64 (${useSq ? 'every output used' : 'one output unused'})`, () => {
    manualSeed(7);
    tidy(() => {
      const x = randn([4, 3], { dtype: 'float64' }).requiresGrad_();
      const w = randn([3, 5], { dtype: 'float64' }).requiresGrad_();
      loss(x, w, useSq).backward();
      const gx = x.grad!, gw = w.grad!;
      const f = () => noGrad(() => tidy(() => loss(x, w, useSq).item()));
      assertClose(gx, numericGrad(f, x), { rtol: 1e-6, atol: 1e-8 }, 'dx');
      assertClose(gw, numericGrad(f, w), { rtol: 1e-6, atol: 1e-8 }, 'dw');
    });
  });
}

test('defineFunction: an input that needs no gradient gets none, and nothing leaks', () => {
  manualSeed(8);
  const before = liveTensors();
  tidy(() => {
    const x = randn([4, 3], { dtype: 'float64' });
    const w = randn([3, 5], { dtype: 'float64' }).requiresGrad_();
    loss(x, w).backward();
    assert.equal(x.grad, undefined);
    assert.ok(w.grad);
    // Without grad mode, the function is its forward.
    const [y] = noGrad(() => fn(x, w, 2)) as Tensor[];
    assert.equal(y!.requiresGrad, false);
  });
  assert.equal(liveTensors(), before);
});

test('defineFunction: outputs carry the forward bits exactly, -0 included', () => {
  const id = defineFunction<[Tensor]>({ forward: (_c, x) => x.clone(), backward: (_c, g) => [g] });
  tidy(() => {
    const x = tensor([-0, 0, 1.5, -2], { dtype: 'float32' }).requiresGrad_();
    const y = id(x) as Tensor;
    assert.deepEqual(Array.from(new Uint32Array(y.detach().toArray().buffer as ArrayBuffer)), Array.from(new Uint32Array(x.detach().toArray().buffer as ArrayBuffer)));
  });
});

test('defineFunction: a backward that returns the wrong count names the fix', () => {
  const bad = defineFunction<[Tensor, Tensor]>({ forward: (_c, a, b) => a.mul(b), backward: (_c, g) => [g] }, 'Bad');
  tidy(() => {
    const a = randn([2]).requiresGrad_(), b = randn([2]).requiresGrad_();
    assert.throws(() => (bad(a, b) as Tensor).sum().backward(), /Bad.backward returned 1 gradient\(s\) for 2 argument\(s\)/);
  });
});

test('defineFunction: an output that aliases a buffer is that buffer: its storage freed and refilled is what backward reads', () => {
  // ZeRO-3's pattern: forward returns a view of a gathered bucket, the bucket's storage is freed after
  // forward and gathered again before backward; the tensors autograd saved from the output see it.
  const gathered = defineFunction<[Tensor, Tensor]>({
    forward: (_c, _w, bucket) => bucket.narrow(0, 2, 4).view(2, 2),
    backward: (_c, g) => [g, undefined],
  }, 'Gathered');
  tidy(() => {
    const bucket = tensor([0, 0, 1, 2, 3, 4, 0, 0], { dtype: 'float64' });
    const w = tensor([[0, 0], [0, 0]], { dtype: 'float64' }).requiresGrad_();
    const x = tensor([[1, 1], [1, 1]], { dtype: 'float64' }).requiresGrad_();
    const y = gathered(w, bucket) as Tensor;
    assert.equal(y.gradFn, 'Gathered');
    assert.equal(y.dataPtr(), bucket.narrow(0, 2, 1).dataPtr(), 'the output is the bucket\'s memory, not a copy');
    const z = y.mul(x); // saves y for x's gradient
    bucket.resizeStorage_(0);
    assert.equal(y.storageNbytes(), 0, 'freeing the bucket frees the output');
    bucket.resizeStorage_(8 * 8);
    noGrad(() => bucket.variableData().copy_(tensor([0, 0, 5, 6, 7, 8, 0, 0], { dtype: 'float64' })));
    z.sum().backward();
    assert.deepEqual(Array.from(x.grad!.toArray() as Float64Array), [5, 6, 7, 8], 'x.grad reads the refilled bucket');
    assert.deepEqual(Array.from(w.grad!.toArray() as Float64Array), [1, 1, 1, 1]);
  });
});

test('defineFunction: backward with inputs over a retained graph computes backward once, each input in its pass', () => {
  let calls = 0;
  const before = liveTensors();
  tidy(() => {
    const a = tensor([1, 2], { dtype: 'float64' }).requiresGrad_(), b = tensor([3, 4], { dtype: 'float64' }).requiresGrad_();
    const ff = defineFunction<[Tensor, Tensor]>({
      forward(ctx, p, q) {
        ctx.saveForBackward(p, q);
        return p.mul(q);
      },
      backward(ctx, g) {
        calls++;
        const [p, q] = ctx.savedTensors as [Tensor, Tensor];
        return [g.mul(q), g.mul(p)];
      },
    }, 'Mul');
    const l = (ff(a, b) as Tensor).sum();
    backward([l], undefined, { inputs: [a], retainGraph: true });
    assert.deepEqual(Array.from(a.grad!.toArray() as Float64Array), [3, 4]);
    assert.equal(b.grad, undefined, 'the first pass does not reach b');
    backward([l], undefined, { inputs: [b] });
    assert.deepEqual(Array.from(b.grad!.toArray() as Float64Array), [1, 2]);
    assert.equal(calls, 1);
    // Without a retained graph, a second pass names the fix.
    const l2 = (ff(a, b) as Tensor).sum();
    l2.backward();
    assert.throws(() => l2.backward(), /retainGraph/);
  });
  assert.equal(liveTensors(), before);
});

test('defineFunction: a graph dropped without backward leaves no tensor handle behind', () => {
  const sq = defineFunction<[Tensor]>({
    forward(ctx, x) {
      ctx.saveForBackward(x.mul(2));
      return x.square();
    },
    backward: (ctx, g) => [g.mul(ctx.savedTensors[0]!)],
  }, 'Square');
  const before = liveTensors();
  tidy(() => {
    const x = randn([3], { dtype: 'float64' }).requiresGrad_();
    (sq(x) as Tensor).sum();
  });
  assert.equal(liveTensors(), before);
});

test('defineFunction: a gradient backward returns from elsewhere stays its owner\'s', () => {
  const fixed = tensor([7, 8], { dtype: 'float64' });
  const f = defineFunction<[Tensor]>({ forward: (_c, x) => x.mul(2), backward: () => [fixed] }, 'Fixed');
  tidy(() => {
    const x = tensor([1, 2], { dtype: 'float64' }).requiresGrad_();
    (f(x) as Tensor).sum().backward();
    assert.deepEqual(Array.from(x.grad!.toArray() as Float64Array), [7, 8]);
  });
  assert.deepEqual(Array.from(fixed.toArray() as Float64Array), [7, 8], 'still usable after backward');
  fixed.dispose();
});
