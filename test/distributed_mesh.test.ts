// DeviceMesh rank arithmetic, checked without processes on many layouts (up to 64 ranks).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { MeshLayout, MeshError } from '../src/distributed/mesh.js';
import { dpRank } from '../src/distributed/partition.js';

/** Every factorisation of n into k ordered factors. */
function factorisations(n: number, k: number): number[][] {
  if (k === 1) return [[n]];
  const out: number[][] = [];
  for (let f = 1; f <= n; f++) if (n % f === 0) for (const rest of factorisations(n / f, k - 1)) out.push([f, ...rest]);
  return out;
}

/** Checks the invariants of one layout exhaustively. */
function checkLayout(L: MeshLayout): void {
  const W = L.worldSize;
  const names = L.names;
  for (let r = 0; r < W; r++) {
    const c = L.coords(r);
    assert.equal(L.rankAt(c), r, `${L} rank ${r} round trip`);
    assert.equal(L.rankAt(L.coordsByName(r)), r);
  }
  // Every run of adjacent dims: groups partition the world, members are sorted, ranks are row-major.
  for (let i = 0; i < names.length; i++) {
    for (let j = i; j < names.length; j++) {
      const dims = names.slice(i, j + 1);
      const size = dims.reduce((a, d) => a * L.size(d), 1);
      const groups = L.groups(dims);
      assert.equal(groups.length, W / size, `${L} [${dims}] group count`);
      const seen = new Set<number>();
      for (const g of groups) {
        assert.equal(g.length, size);
        assert.deepEqual([...g].sort((a, b) => a - b), g, 'members ascending');
        for (const m of g) {
          assert.ok(!seen.has(m), `${L} [${dims}] rank ${m} in two groups`);
          seen.add(m);
        }
        g.forEach((m, k) => {
          assert.deepEqual(L.groupOf(m, dims), g);
          assert.equal(L.rankIn(m, dims), k, `${L} [${dims}] rank ${m} position`);
          // Members differ only in the flattened dims' coordinates.
          const cm = L.coords(m), c0 = L.coords(g[0]!);
          names.forEach((_, d) => { if (d < i || d > j) assert.equal(cm[d], c0[d]); });
          // Row-major over the dims: e.g. dp = replicate * shard_size + shard.
          assert.equal(dims.reduce((acc, d) => acc * L.size(d) + L.coord(m, d), 0), k);
        });
      }
      assert.equal(seen.size, W);
    }
  }
}

test('rank maps hold for every 2-, 3- and 4-dim layout of 1, 2, 8, 12 and 16 ranks', () => {
  let count = 0;
  for (const W of [1, 2, 8, 12, 16]) {
    for (const k of [2, 3, 4]) {
      for (const sizes of factorisations(W, k)) {
        const names = ['pp', 'dp_replicate', 'dp_shard', 'tp'].slice(4 - k);
        checkLayout(MeshLayout.create(Object.fromEntries(names.map((n, i) => [n, sizes[i]!])), W));
        count++;
      }
    }
  }
  assert.ok(count > 100, `${count} layouts`);
});

test('64 ranks as pp 2 × dp_replicate 2 × dp_shard 4 × tp 4', () => {
  const L = MeshLayout.create({ pp: 2, dp_replicate: 2, dp_shard: -1, tp: 4 }, 64);
  assert.deepEqual(L.sizes, [2, 2, 4, 4]);
  assert.deepEqual(L.coordsByName(37), { pp: 1, dp_replicate: 0, dp_shard: 1, tp: 1 });
  assert.deepEqual(L.groupOf(37, 'tp'), [36, 37, 38, 39]);
  assert.deepEqual(L.groupOf(37, 'dp_shard'), [33, 37, 41, 45]);
  assert.deepEqual(L.groupOf(37, 'dp_replicate'), [37, 53]);
  assert.deepEqual(L.groupOf(37, 'pp'), [5, 37]);
  assert.deepEqual(L.groupOf(37, ['dp_replicate', 'dp_shard']), [33, 37, 41, 45, 49, 53, 57, 61]);
  assert.equal(L.rankIn(53, ['dp_replicate', 'dp_shard']), dpRank(1, 1, 4));
  assert.equal(L.groups('tp').length, 16);
  assert.deepEqual(L.groups('pp')[0], [0, 32]);
  checkLayout(L);
});

test('-1 takes the rest; a spec may be an ordered list of pairs', () => {
  assert.deepEqual(MeshLayout.create({ dp: -1 }, 6).sizes, [6]);
  assert.deepEqual(MeshLayout.create({ pp: 1, dp_replicate: 2, dp_shard: -1, tp: 1 }, 8).sizes, [1, 2, 4, 1]);
  const L = MeshLayout.create([['tp', 2], ['dp', -1]], 8);
  assert.deepEqual(L.names, ['tp', 'dp']);
  assert.deepEqual(L.groupOf(1, 'dp'), [0, 1, 2, 3]); // the last dim is innermost
  assert.deepEqual(L.groupOf(1, 'tp'), [1, 5]);
});

test('invalid meshes are rejected once, with the fix', () => {
  const bad: [Parameters<typeof MeshLayout.create>[0], number, RegExp][] = [
    [{ dp: 2, tp: 2 }, 8, /sizes multiply to 4; make them multiply to 8/],
    [{ dp: -1, tp: -1 }, 8, /only one dim may be -1.*dp and tp/],
    [{ dp: -1, tp: 3 }, 8, /multiply to 3, which does not divide 8/],
    [{ dp: 0, tp: -1 }, 8, /dp = 0 must be a positive integer or -1/],
    [{ dp: 1.5, tp: -1 }, 8, /dp = 1.5/],
    [{ '2d': 8 }, 8, /dim name '2d' must be an identifier/],
    [[['dp', 2], ['dp', 4]], 8, /'dp' appears twice/],
    [{}, 8, /at least one dim/],
  ];
  for (const [spec, W, re] of bad) {
    assert.throws(() => MeshLayout.create(spec, W), (e: Error) => e instanceof MeshError && re.test(e.message), `${JSON.stringify(spec)}: ${re}`);
  }
});

test('unknown names list the valid ones; only adjacent dims in mesh order flatten', () => {
  const L = MeshLayout.create({ pp: 2, dp_replicate: 2, dp_shard: 2, tp: 2 }, 16);
  assert.throws(() => L.size('dp'), /no dim 'dp'; valid names: pp, dp_replicate, dp_shard, tp/);
  assert.throws(() => L.groupOf(0, ['pp', 'dp_shard']), /cannot flatten \[pp, dp_shard\]: they must be adjacent and in mesh order/);
  assert.throws(() => L.groupOf(0, ['dp_shard', 'dp_replicate']), /must be adjacent and in mesh order/);
  assert.throws(() => L.coords(16), /outside the mesh/);
  assert.throws(() => L.rankAt({ pp: 0, dp_replicate: 0, dp_shard: 2, tp: 0 }), /dp_shard = 2 is outside 0..1/);
});
