// Dtypes: creation and read-back for each, tensor() inference, conversions, and seeded random draws
// (reproducible, and the same numbers torch.manual_seed gives).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import {
  tensor, zeros, ones, full, empty, arange, rand, randn, randint, randnLike, manualSeed, tidy, empty as emptyT,
  isFloating, elementSize, setNumThreads, type DType,
} from '../src/tensor/index.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';

setNumThreads(1);

const ARRAY_TYPE: Record<DType, string> = {
  float32: 'Float32Array', float64: 'Float64Array', bfloat16: 'Float32Array', float16: 'Float32Array', int64: 'BigInt64Array',
  int32: 'Int32Array', int16: 'Int16Array', int8: 'Int8Array', uint8: 'Uint8Array', bool: 'Uint8Array',
};

test('creation in every dtype: dtype, shape, element size and the typed array that comes back', () => {
  tidy(() => {
    for (const d of Object.keys(ARRAY_TYPE) as DType[]) {
      const z = zeros([2, 3], { dtype: d });
      assert.equal(z.dtype, d);
      assert.deepEqual(z.shape, [2, 3]);
      const arr = ones([2, 3], { dtype: d }).toArray();
      assert.equal(arr.constructor.name, ARRAY_TYPE[d], `${d} comes back as ${ARRAY_TYPE[d]}`);
      assert.deepEqual(Array.from(arr as ArrayLike<number | bigint>, Number), [1, 1, 1, 1, 1, 1], `${d} ones`);
      assert.deepEqual(full([2], d === 'bool' ? 1 : 5, { dtype: d }).toNumbers(), d === 'bool' ? [1, 1] : [5, 5], `${d} full`);
      assert.equal(emptyT([4], { dtype: d }).numel(), 4);
      assert.equal(isFloating(d), ['float32', 'float64', 'bfloat16', 'float16'].includes(d));
      assert.equal(elementSize(d), { float64: 8, int64: 8, float32: 4, int32: 4, bfloat16: 2, float16: 2, int16: 2 }[d as string] ?? 1);
    }
    assert.equal(empty([3]).dtype, 'float32', 'float32 by default');
  });
});

test('values survive each dtype; bfloat16 and float16 round as IEEE says; int64 keeps 64 bits', () => {
  tidy(() => {
    assert.deepEqual(tensor([1.5, -2.25], { dtype: 'float64' }).toArray(), Float64Array.from([1.5, -2.25]));
    assert.deepEqual(tensor([0.1], { dtype: 'float32' }).toArray(), Float32Array.from([0.1]));
    // bfloat16 keeps 8 significant bits: 1 + 2^-8 is a tie and rounds to even (1); 1 + 3*2^-8 rounds up.
    assert.deepEqual(tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.140625]).to('bfloat16').toNumbers(), [1, 1 + 2 ** -6, 3.140625]);
    assert.deepEqual(tensor([65504, 1 + 2 ** -11]).to('float16').toNumbers(), [65504, 1]);
    const big = tensor(new BigInt64Array([2n ** 62n + 1n, -(2n ** 63n)]));
    assert.equal(big.dtype, 'int64');
    assert.deepEqual(Array.from(big.toArray() as BigInt64Array), [2n ** 62n + 1n, -(2n ** 63n)]);
    assert.deepEqual(tensor([true, false, true]).toArray(), Uint8Array.from([1, 0, 1]));
    assert.equal(tensor([7], { dtype: 'int32' }).sum().item(), 7);
    assert.equal(tensor([true]).item(), 1);
    assert.deepEqual(tensor([2.7, -2.7]).to('int32').toNumbers(), [2, -2], 'float to int truncates toward zero');
    assert.deepEqual(tensor([0, 3, -1]).to('bool').toNumbers(), [0, 1, 1]);
    assert.deepEqual(tensor([3, 4], { dtype: 'int32' }).div(tensor([2, 8], { dtype: 'int32' })).toArray(), Float32Array.from([1.5, 0.5]),
      'true division of ints promotes to float32');
  });
});

test('tensor() infers dtype and shape', () => {
  tidy(() => {
    assert.equal(tensor([1, 2, 3]).dtype, 'int64');
    assert.equal(tensor([1, 2.5]).dtype, 'float32');
    assert.equal(tensor([true, false]).dtype, 'bool');
    assert.equal(tensor([[1], [2]], { dtype: 'float64' }).dtype, 'float64');
    assert.deepEqual(tensor([[[1, 2]], [[3, 4]], [[5, 6]]]).shape, [3, 1, 2]);
    assert.deepEqual(tensor(5).shape, [], 'a bare number is a 0-d tensor');
    assert.equal(tensor(5).item(), 5);
    assert.deepEqual(tensor([]).shape, [0]);
    assert.equal(tensor(new Float64Array(4)).dtype, 'float64');
    assert.equal(tensor(new Int32Array(4)).dtype, 'int32');
    assert.equal(tensor(new Uint8Array(4)).dtype, 'uint8');
    assert.deepEqual(tensor(new Float32Array(6), { shape: [2, 3] }).shape, [2, 3]);
    assert.equal(tensor(new Float32Array([1.5]), { dtype: 'float64' }).dtype, 'float64');
    assert.throws(() => tensor(new Float32Array(6), { shape: [4] }), /fromBuffer: buffer has 24 bytes, shape needs 16/);
    assert.throws(() => tensor([[1, 2], 3] as never), /ragged nested array/);
  });
});

test('arange follows PyTorch: int64 for integer arguments, float32 otherwise', () => {
  tidy(() => {
    assert.deepEqual(arange(5).toNumbers(), [0, 1, 2, 3, 4]);
    assert.equal(arange(5).dtype, 'int64');
    assert.deepEqual(arange(2, 11, 3).toNumbers(), [2, 5, 8]);
    assert.equal(arange(0, 1, 0.25).dtype, 'float32');
    assert.deepEqual(arange(0, 1, 0.25).toNumbers(), [0, 0.25, 0.5, 0.75]);
    assert.equal(arange(0, 3, 1, { dtype: 'float64' }).dtype, 'float64');
  });
});

test('seeded draws repeat exactly, and another seed differs', () => {
  tidy(() => {
    const draw = (seed: number) => {
      manualSeed(seed);
      return [randn([4, 3]).toNumbers(), rand([5]).toNumbers(), randint(0, 100, [6]).toNumbers(), randnLike(zeros([3])).toNumbers()];
    };
    assert.deepEqual(draw(42), draw(42));
    assert.notDeepEqual(draw(42), draw(43));
    const u = rand([1000]).toNumbers();
    assert.ok(u.every((v) => v >= 0 && v < 1));
    const n = randn([4000], { dtype: 'float64' });
    assert.ok(Math.abs(n.mean().item()) < 0.1 && Math.abs(n.var().item() - 1) < 0.1, 'standard normal moments');
    assert.ok(randint(3, 7, [500]).toNumbers().every((v) => v >= 3 && v < 7));
  });
});

test('the same seed gives the same numbers as torch.manual_seed', { skip: oracleMissing() }, () => {
  tidy(() => {
    manualSeed(2024);
    const ours = {
      randn: randn([5, 7]), rand: rand([20]), randint: randint(0, 10, [12]), randn64: randn([3, 3], { dtype: 'float64' }),
      normal_: empty([40]).normal_(1, 0.5), uniform_: empty([8]).uniform_(-2, 2),
    };
    const ref = runOracle('seeded_draws', {}, { seed: 2024 }).tensors;
    for (const [k, t] of Object.entries(ours)) {
      assert.equal(t.dtype, ref[k]!.dtype, k);
      assert.deepEqual(t.toArray(), ref[k]!.toArray(), `${k} equals PyTorch's draw`);
    }
  });
});
