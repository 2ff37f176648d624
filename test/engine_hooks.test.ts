// Autograd hooks: the accumulate-grad post hook (what overlapped gradient reduction listens to) and
// tensor gradient hooks (which may replace a gradient); errors thrown inside either reach the caller.
//
// [Note: hook counts] libtorch's engine sums every contribution to a leaf before running its
// AccumulateGrad node, so within ONE backward() the accumulate-grad hook fires once per parameter that
// took part, however many times the graph used it (tied embeddings: once, with both uses summed).
// It fires once per backward() call, so a parameter used in k separate backward passes (micro-batches,
// pieces of a graph run separately) fires k times. The tests below pin both facts down.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { tensor, randn, randint, tidy, keep, zeros, liveTensors, manualSeed, setNumThreads, backward, type Tensor } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { assertClose } from './oracle/check.js';

setNumThreads(1);

test('accumulate-grad hooks fire in backward order, once each, before backward() returns, with .grad final', () => {
  tidy(() => {
    const x = tensor([1, 2, 3], { dtype: 'float32' });
    const w1 = randn([3], { requiresGrad: true }), w2 = randn([3], { requiresGrad: true }), w3 = randn([3], { requiresGrad: true });
    const order: string[] = [];
    const seen = new Map<string, number[]>();
    for (const [name, w] of [['w1', w1], ['w2', w2], ['w3', w3]] as const) {
      w.registerAccumulateGradHook(() => {
        order.push(name);
        seen.set(name, tidy(() => w.grad!.toNumbers()));
      });
    }
    // y = sum(tanh(tanh(x*w1)*w2)*w3): backward reaches w3 first, then w2, then w1.
    x.mul(w1).tanh().mul(w2).tanh().mul(w3).sum().backward();
    assert.deepEqual(order, ['w3', 'w2', 'w1'], 'fired in backward order, all before backward() returned');
    for (const [name, w] of [['w1', w1], ['w2', w2], ['w3', w3]] as const) {
      assert.deepEqual(seen.get(name), w.grad!.toNumbers(), `${name}: .grad already held its gradient when the hook ran`);
    }
  });
});

test('a parameter used twice in one graph fires once, after both uses are summed (see [Note: hook counts])', () => {
  tidy(() => {
    const w = randn([4], { requiresGrad: true });
    const a = tensor([1, 2, 3, 4], { dtype: 'float32' }), b = tensor([10, 20, 30, 40], { dtype: 'float32' });
    let calls = 0;
    let atHook: number[] = [];
    w.registerAccumulateGradHook(() => {
      calls++;
      atHook = tidy(() => w.grad!.toNumbers());
    });
    w.mul(a).sum().add(w.mul(b).sum()).backward();
    assert.equal(calls, 1);
    assert.deepEqual(atHook, [11, 22, 33, 44], 'both contributions were in .grad when the hook fired');
  });
});

test('GPT with tied embeddings: every parameter fires once per backward, wte last, layers in reverse', () => {
  manualSeed(3);
  const m = new GPT({ vocabSize: 17, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 8, tieEmbeddings: true });
  const calls: string[] = [];
  const removers = m.namedParameters().map(([n, p]) => p.registerAccumulateGradHook(() => calls.push(n)));
  tidy(() => {
    const idx = randint(0, 17, [2, 8]);
    m.forward(idx, idx).loss!.backward();
  });
  const names = m.namedParameters().map(([n]) => n);
  assert.deepEqual([...calls].sort(), [...names].sort(), 'each parameter exactly once (the tied one included)');
  const pos = (n: string) => calls.indexOf(n);
  assert.equal(calls.at(-1), 'wte.weight', 'the tied weight fires when its last use (the embedding) is done');
  assert.ok(pos('lnF.weight') < pos('layers.1.mlp.proj.weight'));
  assert.ok(pos('layers.1.ln1.weight') < pos('layers.0.mlp.proj.weight'), 'layer 1 before layer 0');
  assert.ok(pos('layers.0.attn.qkv.weight') < pos('wpe.weight'));
  // Two micro-batches, two backward passes: two calls each, gradients accumulated.
  calls.length = 0;
  tidy(() => {
    for (let i = 0; i < 2; i++) {
      const idx = randint(0, 17, [2, 8]);
      m.forward(idx, idx).loss!.backward();
    }
  });
  assert.equal(calls.filter((n) => n === 'wte.weight').length, 2);
  assert.equal(calls.length, 2 * names.length);
  // Removed hooks stay silent.
  for (const r of removers) r();
  calls.length = 0;
  tidy(() => {
    const idx = randint(0, 17, [1, 4]);
    m.forward(idx, idx).loss!.backward();
  });
  assert.deepEqual(calls, []);
  m.dispose();
});

test('multi-root backward fires each hook once', () => {
  tidy(() => {
    const w = randn([2], { requiresGrad: true });
    let calls = 0;
    w.registerAccumulateGradHook(() => calls++);
    backward([w.mul(2).sum(), w.mul(3).sum()]);
    assert.equal(calls, 1);
    assert.deepEqual(w.grad!.toNumbers(), [5, 5]);
  });
});

test('tensor hooks see the gradient and can replace it (leaf and intermediate)', () => {
  tidy(() => {
    const w = tensor([1, 2, 3], { dtype: 'float32', requiresGrad: true });
    let seen: number[] = [];
    const remove = w.registerHook((g) => {
      seen = g.toNumbers();
      return g.mul(10);
    });
    w.mul(tensor([1, 1, 2], { dtype: 'float32' })).sum().backward();
    assert.deepEqual(seen, [1, 1, 2]);
    assert.deepEqual(w.grad!.toNumbers(), [10, 10, 20], 'the replaced gradient was accumulated');
    remove();
    w.grad = undefined;
    w.mul(2).sum().backward();
    assert.deepEqual(w.grad!.toNumbers(), [2, 2, 2], 'removed hook no longer applies');

    // A hook on an intermediate tensor changes what flows to the leaves below it.
    const x = tensor([1, 2], { dtype: 'float32', requiresGrad: true });
    const h = x.mul(3);
    h.registerHook((g) => g.mul(0).add(1)); // replace dL/dh by ones
    h.square().sum().backward();
    assert.deepEqual(x.grad!.toNumbers(), [3, 3]);
    // Returning nothing leaves the gradient alone.
    const z = tensor([1, 2], { dtype: 'float32', requiresGrad: true });
    let called = false;
    z.registerHook(() => { called = true; });
    z.mul(z).sum().backward();
    assert.ok(called);
    assert.deepEqual(z.grad!.toNumbers(), [2, 4]);
  });
});

test("a tensor hook's call is a scope: its gradient and temporaries are freed when it returns, unless returned or kept", () => {
  tidy(() => {
    const w = tensor([1, 2, 3], { dtype: 'float32', requiresGrad: true });
    const seen: Tensor[] = [];
    let temp: Tensor | undefined;
    const remove = w.registerHook((g) => {
      seen.push(g);
      temp = g.mul(2); // made and dropped inside the hook
    });
    w.mul(3).sum().backward();
    // Held by the step's scope until it ended, every parameter's incoming gradient stayed alive
    // through backward: data parallelism's readiness hook held a step's weight gradients twice.
    assert.ok(seen[0]!.isDisposed && temp!.isDisposed, 'the hook\'s gradient and temporaries outlived its call');
    remove();
    // What the hook keeps stays, and what it returns replaces the gradient.
    let kept: Tensor | undefined;
    w.registerHook((g) => { kept = keep(g); return g.mul(10); });
    w.grad = undefined;
    w.mul(1).sum().backward();
    assert.deepEqual(kept!.toNumbers(), [1, 1, 1]);
    assert.deepEqual(w.grad!.toNumbers(), [10, 10, 10]);
    kept!.dispose();
  });
});

test('an exception thrown inside a hook surfaces from backward() with its message; training continues', () => {
  const before = liveTensors();
  tidy(() => {
    const w = randn([3], { requiresGrad: true });
    const remove = w.registerAccumulateGradHook(() => {
      throw new Error('bucket 7 already in flight for layers.3.mlp.fc.weight');
    });
    assert.throws(() => w.mul(2).sum().backward(), (e: unknown) =>
      e instanceof Error && /backward/.test(e.message) && /bucket 7 already in flight for layers\.3\.mlp\.fc\.weight/.test(e.message));
    remove();
    w.grad = undefined;
    w.mul(2).sum().backward();
    assert.deepEqual(w.grad!.toNumbers(), [2, 2, 2]);

    const v = randn([2], { requiresGrad: true });
    const r2 = v.registerHook(() => {
      throw new TypeError('bad gradient hook');
    });
    assert.throws(() => v.square().sum().backward(), /bad gradient hook/);
    r2();
    v.square().sum().backward();
    assertClose(v.grad!, v.mul(2), { rtol: 1e-6 }, 'gradient after the failed pass');
  });
  assert.equal(liveTensors(), before);
});

test('an accumulate-grad hook sees .grad when .grad is a view of a flat buffer', () => {
  tidy(() => {
    const flat = zeros([5]);
    const a = randn([2], { requiresGrad: true }), b = randn([3], { requiresGrad: true });
    a.grad = flat.narrow(0, 0, 2);
    b.grad = flat.narrow(0, 2, 3);
    const snapshots: number[][] = [];
    for (const p of [a, b] as Tensor[]) p.registerAccumulateGradHook(() => snapshots.push(flat.toNumbers()));
    a.mul(2).sum().add(b.mul(3).sum()).backward();
    assert.equal(snapshots.length, 2);
    assert.deepEqual(flat.toNumbers(), [2, 2, 3, 3, 3]);
    // Whichever fired first, its slice of the flat buffer was already filled.
    assert.ok(snapshots[0]!.slice(0, 2).every((v) => v === 2) || snapshots[0]!.slice(2).every((v) => v === 3));
  });
});
