// Views share storage: parameters that are views of one flat tensor, and gradients that are views of
// one flat buffer which backward accumulates into in place (the never-None gradient buffer).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { tensor, zeros, randint, tidy, noGrad, keep, manualSeed, setNumThreads, type Tensor } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { SGD, AdamW } from '../src/optim/index.js';
import { F } from '../src/nn/index.js';

setNumThreads(1);

test('views alias their base: writes through either side are visible; pointers prove it', () => {
  tidy(() => {
    const flat = zeros([12]);
    const v = flat.narrow(0, 2, 6).view(2, 3);
    assert.equal(v.dataPtr(), flat.dataPtr() + 8n, 'offset of 2 float32 elements');
    assert.equal(v.storageOffset, 2);
    noGrad(() => v.fill_(1));
    assert.deepEqual(flat.toNumbers(), [0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]);
    noGrad(() => flat.narrow(0, 3, 1).fill_(7));
    assert.deepEqual(v.toNumbers(), [1, 7, 1, 1, 1, 1]);
    const t = v.t();
    assert.deepEqual(t.stride(), [1, 3]);
    assert.equal(t.dataPtr(), v.dataPtr());
    const c = t.contiguous();
    assert.notEqual(c.dataPtr(), v.dataPtr(), 'contiguous() of a non-contiguous view copies');
    const s = flat.split(4);
    assert.equal(s[1]!.dataPtr(), flat.dataPtr() + 16n);
    // A disposed base does not free storage that a view still uses.
    const base = tensor([1, 2, 3, 4], { dtype: 'float32' });
    const tail = base.narrow(0, 2, 2);
    base.dispose();
    assert.deepEqual(tail.toNumbers(), [3, 4]);
  });
});

test('parameters that are views of one flat tensor train in place, and the flat tensor sees it', () => {
  tidy(() => {
    const flat = tensor([1, 2, 3, 4, 5, 6, 7, 8], { dtype: 'float32' });
    const w = flat.narrow(0, 0, 6).view(2, 3).requiresGrad_(); // a leaf: its base needs no grad
    const b = flat.narrow(0, 6, 2).requiresGrad_();
    assert.ok(w.isLeaf && b.isLeaf);
    const x = tensor([[1, 0, -1]], { dtype: 'float32' });
    F.linear(x, w, b).sum().backward();
    assert.deepEqual(w.grad!.toNumbers(), [1, 0, -1, 1, 0, -1]);
    const opt = new SGD([w, b], { lr: 0.5 });
    opt.step();
    assert.deepEqual(flat.toNumbers(), [0.5, 2, 3.5, 3.5, 5, 6.5, 6.5, 7.5], 'the update landed in the flat tensor');
    noGrad(() => flat.fill_(0));
    assert.deepEqual(w.toNumbers(), [0, 0, 0, 0, 0, 0], 'writes to the flat tensor show in the parameter');
  });
});

test('.grad as a view of a flat buffer: backward accumulates into it in place; zeroGrad keeps it', () => {
  tidy(() => {
    const a = tensor([1, 2], { dtype: 'float32', requiresGrad: true });
    const b = tensor([[1, 2], [3, 4]], { dtype: 'float32', requiresGrad: true });
    const buf = zeros([6]);
    a.grad = buf.narrow(0, 0, 2);
    b.grad = buf.narrow(0, 2, 4).view(2, 2);
    const ptrs = [a.grad!.dataPtr(), b.grad!.dataPtr()];
    assert.equal(ptrs[0], buf.dataPtr());
    const opt = new SGD([a, b], { lr: 0 });
    for (let it = 0; it < 3; it++) {
      opt.zeroGrad();
      assert.deepEqual(buf.toNumbers(), [0, 0, 0, 0, 0, 0], 'zeroGrad zeroes the buffer');
      assert.deepEqual([a.grad!.dataPtr(), b.grad!.dataPtr()], ptrs, 'zeroGrad keeps the gradients allocated');
      a.mul(3).sum().add(b.square().sum()).backward();
      assert.deepEqual([a.grad!.dataPtr(), b.grad!.dataPtr()], ptrs, `iteration ${it}: same storage`);
      assert.deepEqual(buf.toNumbers(), [3, 3, 2, 4, 6, 8], `iteration ${it}: gradients are in the buffer`);
    }
    // Without zeroGrad a second backward adds on top, still in the buffer.
    a.mul(3).sum().add(b.square().sum()).backward();
    assert.deepEqual(buf.toNumbers(), [6, 6, 4, 8, 12, 16]);
  });
});

test('a whole GPT on one flat gradient buffer gives the same gradients and the same training as separate ones', () => {
  manualSeed(11);
  const cfg = { vocabSize: 19, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 8, tieEmbeddings: true };
  const m1 = new GPT(cfg), m2 = new GPT(cfg);
  m2.loadStateDict(m1.stateDict());
  const params = m2.parameters();
  const total = params.reduce((s, p) => s + p.numel(), 0);
  const buf = keep(zeros([total]));
  let off = 0;
  for (const p of params) {
    p.grad = buf.narrow(0, off, p.numel()).view(...p.shape);
    off += p.numel();
  }
  const ptrs = params.map((p) => tidy(() => p.grad!.dataPtr()));
  const o1 = new AdamW(m1.parameters(), { lr: 1e-2 }), o2 = new AdamW(params, { lr: 1e-2 });
  for (let it = 0; it < 3; it++) {
    tidy(() => {
      const idx = randint(0, 19, [2, 8]);
      for (const [m, o] of [[m1, o1], [m2, o2]] as const) {
        o.zeroGrad();
        m.forward(idx, idx).loss!.backward();
      }
      const flatOf = (ps: Tensor[]) => ps.flatMap((p) => p.grad!.toNumbers());
      assert.deepEqual(buf.toNumbers(), flatOf(m1.parameters()), `iteration ${it}: the flat buffer holds exactly the gradients`);
      assert.deepEqual(params.map((p) => p.grad!.dataPtr()), ptrs, `iteration ${it}: no gradient was reallocated`);
      o1.step();
      o2.step();
    });
  }
  for (const [[n, p1], [, p2]] of m1.namedParameters().map((e, i) => [e, m2.namedParameters()[i]!] as const)) {
    assert.deepEqual(p2.toNumbers(), p1.toNumbers(), `${n} after 3 steps`);
  }
  m1.dispose();
  m2.dispose();
  buf.dispose();
});
