// Mistakes a user can make with shapes and dtypes raise a JS Error that names the op and its inputs;
// nothing leaks and the process carries on.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { tensor, randn, zeros, tidy, scopeDepth, liveTensors, setNumThreads } from '../src/tensor/index.js';
import { F, Linear } from '../src/nn/index.js';
import { GPT } from '../src/models/gpt.js';

setNumThreads(1);

/** Asserts fn throws a real Error whose message matches every pattern. */
function throwsNaming(fn: () => unknown, ...patterns: RegExp[]): string {
  let caught: unknown;
  try {
    fn();
  } catch (e) {
    caught = e;
  }
  assert.ok(caught instanceof Error, `expected an Error, got ${String(caught)}`);
  for (const p of patterns) assert.match(caught.message, p);
  return caught.message;
}

test('matmul of [2,3] and [4,5] names the op, both shapes and the reason', () => {
  const a = randn([2, 3]), b = randn([4, 5]);
  const before = liveTensors();
  const msg = throwsNaming(() => a.matmul(b), /aten::matmul/, /float32\[2, 3\]/, /float32\[4, 5\]/, /cannot be multiplied \(2x3 and 4x5\)/);
  assert.doesNotMatch(msg, /Exception raised from/, 'no C++ backtrace by default');
  assert.equal(liveTensors(), before, 'a failed op leaks no handle');
  // The process carries on: the same tensors still work.
  assert.deepEqual(a.matmul(b.narrow(0, 0, 3)).shape, [2, 5]);
  a.dispose();
  b.dispose();
});

test('shape mistakes in common ops', () => {
  tidy(() => {
    const x = randn([2, 3]);
    throwsNaming(() => x.add(randn([4])), /aten::add\.Tensor\(float32\[2, 3\], float32\[4\]/, /size of tensor a \(3\) must match the size of tensor b \(4\)/);
    throwsNaming(() => x.view(7), /aten::view\(float32\[2, 3\], \[7\]\)/, /shape '\[7\]' is invalid for input of size 6/);
    throwsNaming(() => x.narrow(1, 2, 5), /aten::narrow/, /float32\[2, 3\]/);
    throwsNaming(() => x.mm(randn([2, 3])), /aten::mm\(float32\[2, 3\], float32\[2, 3\]\)/);
    throwsNaming(() => x.bmm(randn([2, 3, 4])), /aten::bmm/, /batch1 must be a 3D tensor/);
    throwsNaming(() => x.softmax(3), /aten::softmax/, /Dimension out of range/);
    throwsNaming(() => x.transpose(0, 5), /aten::transpose/, /out of range/);
    throwsNaming(() => F.layerNorm(x, [4]), /aten::layer_norm/, /float32\[2, 3\]/);
    const lin = new Linear(4, 5);
    throwsNaming(() => lin.forward(x), /aten::linear\(float32\[2, 3\], float32\[5, 4\], float32\[5\]\)/);
    lin.dispose();
    throwsNaming(() => F.crossEntropy(randn([4, 3]), tensor([0, 1, 2])), /aten::cross_entropy_loss\(float32\[4, 3\], int64\[3\]/);
  });
});

test('dtype mistakes name the dtypes', () => {
  tidy(() => {
    const f = randn([2, 2]);
    throwsNaming(() => f.mm(randn([2, 2], { dtype: 'float64' })), /aten::mm\(float32\[2, 2\], float64\[2, 2\]\)/, /(Float|Double)/);
    throwsNaming(() => F.embedding(tensor([0.5, 1.5]), f), /aten::embedding\(float32\[2, 2\], float32\[2\]\)/, /indices/);
    throwsNaming(() => F.crossEntropy(randn([3, 4]), tensor([1, 2, 3], { dtype: 'int32' })), /aten::cross_entropy_loss/, /int32\[3\]/, /Long/);
    throwsNaming(() => tensor([1, 2]).mul_(2.5), /aten::mul_\.Scalar\(int64\[2\], 2\.5\)/, /result type Float can't be cast to the desired output type Long/);
    throwsNaming(() => { f.grad = zeros([2, 2], { dtype: 'float64' }); }, /setGrad: grad dtype float64\[2, 2\] does not match tensor float32\[2, 2\]/);
    throwsNaming(() => { f.grad = zeros([4]); }, /setGrad: grad shape float32\[4\] does not match tensor float32\[2, 2\]/);
  });
});

test('argument conversion errors name the argument', () => {
  tidy(() => {
    const x = randn([4]);
    throwsNaming(() => x.view(2.5, 2), /aten::view/, /argument 'size': expected an integer, got 2\.5/);
    throwsNaming(() => zeros([2, -1]), /zeros: shape \[2, -1\] must hold non-negative integers/);
    throwsNaming(() => tensor([[1, 2], [3]]), /ragged/);
    throwsNaming(() => x.to('float128' as 'float32'), /unknown dtype 'float128'/);
  });
});

test('autograd misuse: backward of a non-scalar, of a tensor without grad', () => {
  tidy(() => {
    const w = randn([3], { requiresGrad: true });
    throwsNaming(() => w.mul(2).backward(), /backward/, /grad can be implicitly created only for scalar outputs/);
    throwsNaming(() => randn([1]).sum().backward(), /backward/, /does not require grad/);
    // and then a correct backward works
    w.mul(2).sum().backward();
    assert.deepEqual(w.grad!.toNumbers(), [2, 2, 2]);
  });
});

test('model-level mistakes: a sequence longer than the context', () => {
  const m = new GPT({ vocabSize: 10, blockSize: 4, nLayer: 1, nHead: 1, nEmbd: 4 });
  tidy(() => throwsNaming(() => m.forward(tensor([[1, 2, 3, 4, 5]])), /GPT: sequence length 5 exceeds blockSize 4/));
  assert.throws(() => new GPT({ nEmbd: 10, nHead: 3 }), /nEmbd \(10\) must be divisible by nHead \(3\)/);
  assert.throws(() => new GPT({ nLayer: 0 }), /nLayer must be a positive integer, got 0/);
  m.dispose();
});

test('an error inside tidy() frees the scope and leaves no scope open', () => {
  const before = liveTensors();
  assert.throws(() => tidy(() => {
    const a = randn([3, 3]);
    a.add(1).mul(2);
    return a.matmul(randn([2, 2]));
  }), /aten::matmul/);
  assert.equal(scopeDepth(), 0);
  assert.equal(liveTensors(), before);
  // Many failures in a row do not degrade anything.
  for (let i = 0; i < 200; i++) assert.throws(() => tidy(() => randn([2, 3]).matmul(randn([4, 5]))));
  assert.equal(liveTensors(), before);
});

test('a tensor whose storage was freed (a sharded parameter outside its unit) is an error naming the fix, not a crash', () => {
  tidy(() => {
    const full = zeros([64]);
    const p = full.narrow(0, 0, 32).view(4, 8);
    full.resizeStorage_(0);
    for (const use of [() => p.sum(), () => p.toNumbers(), () => p.matmul(zeros([8, 2])), () => F.linear(zeros([1, 8]), p)]) {
      throwsNaming(use, /float32\[4, 8\] has no storage/, /withFullParameters\(\)/);
    }
    full.resizeStorage_(64 * 4); // given its bytes back, the same view works again
    assert.equal(p.sum().item(), p.sum().item());
  });
});
