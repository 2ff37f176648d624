// Shape-taking Tensor methods accept the sizes as separate numbers or as one list, as PyTorch does
// (ported code mostly writes x.reshape([-1, V])), and give the same result either way.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { arange } from '../src/tensor/index.js';

test('reshape, view, permute, expand, repeat and flip take one list as well as separate sizes', () => {
  const x = arange(0, 24).reshape(2, 3, 4);
  const same = (a: { shape: readonly number[]; toArray(): unknown }, b: { shape: readonly number[]; toArray(): unknown }, what: string) => {
    assert.deepEqual(a.shape, b.shape, what);
    assert.deepEqual(a.toArray(), b.toArray(), what);
  };
  same(x.reshape([-1, 4]), x.reshape(-1, 4), 'reshape');
  assert.deepEqual(x.reshape([-1, 4]).shape, [6, 4]);
  same(x.view([6, -1]), x.view(6, -1), 'view');
  same(x.permute([2, 0, 1]), x.permute(2, 0, 1), 'permute');
  assert.deepEqual(x.permute([2, 0, 1]).shape, [4, 2, 3]);
  const col = arange(0, 3).reshape([3, 1]);
  same(col.expand([3, 5]), col.expand(3, 5), 'expand');
  same(col.repeat([2, 2]), col.repeat(2, 2), 'repeat');
  same(x.flip([0, 2]), x.flip(0, 2), 'flip');
  // An empty list is a scalar's shape.
  assert.deepEqual(arange(0, 1).reshape([]).shape, []);
  // Both forms at once is a mistake, named.
  assert.throws(() => (x.reshape as (...a: unknown[]) => unknown)([2, 3], 4), /reshape: give the sizes as separate numbers or as one list, not both/);
});
