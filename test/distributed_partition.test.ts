// The data-partition proof, without processes: checkPartition, dpRank, and the replicate × shard
// rank bug it exists to catch.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { checkPartition, dpRank } from '../src/distributed/partition.js';
import { MeshLayout } from '../src/distributed/mesh.js';

test('a partition passes; collisions, gaps and strays are named', () => {
  assert.equal(checkPartition([[0, 1], [2, 3]], 4).ok, true);
  assert.equal(checkPartition([[3, 0], [], [2, 1]], 4).ok, true);

  const dup = checkPartition([[0, 1], [1, 2], [3]], 4);
  assert.equal(dup.ok, false);
  assert.deepEqual(dup.collisions, [{ sample: 1, ranks: [0, 1] }]);
  assert.match(dup.message, /DP rank 0 and DP rank 1 both read 1/);

  const gap = checkPartition([[0], [2]], 4);
  assert.deepEqual(gap.missing, [1, 3]);
  assert.match(gap.message, /2 sample\(s\) read by no rank: 1, 3/);

  const stray = checkPartition([[0, 1, 4, 5], [2, 3, 1.5]], 4);
  assert.deepEqual(stray.outOfRange, [{ sample: 4, rank: 0 }, { sample: 5, rank: 0 }, { sample: 1.5, rank: 1 }]);
  assert.match(stray.message, /DP rank 0 reads 4\.\.5; DP rank 1 reads 1\.5/);

  const twice = checkPartition([[0, 0, 1], [2, 3]], 4);
  assert.deepEqual(twice.collisions, [{ sample: 0, ranks: [0, 0] }]);

  assert.match(checkPartition([[0], [0]], 2, (i) => `rank #${i}`).message, /rank #0 and rank #1 both read 0/);
  assert.throws(() => checkPartition([[0]], 0), /globalBatchSize = 0/);
});

test('dpRank is replicate_rank * shard_size + shard_rank, with checked arguments', () => {
  assert.equal(dpRank(0, 0, 4), 0);
  assert.equal(dpRank(2, 3, 4), 11);
  assert.throws(() => dpRank(1, 4, 4), /shardRank 4 must be below shardSize 4/);
  assert.throws(() => dpRank(-1, 0, 4), /replicateRank = -1/);
  assert.throws(() => dpRank(0, 0, 0), /shardSize = 0/);
});

type RankFn = (replicateRank: number, shardRank: number, replicateSize: number, shardSize: number) => number;
const right: RankFn = (r, s, _R, S) => dpRank(r, s, S);
const wrong: RankFn = (r, s, R) => r * R + s; // the bug: multiplies by the replicate size

/**
 * Simulates every rank of a replicate × shard world computing its DP rank with `fn` and reading
 * its slice of the global batch, and returns what each DP-group member reads (by group rank).
 */
function simulate(R: number, S: number, fn: RankFn, perRank = 2): number[][] {
  const L = MeshLayout.create({ dp_replicate: R, dp_shard: S }, R * S);
  const reads: number[][] = new Array(R * S);
  for (let g = 0; g < R * S; g++) {
    const d = fn(L.coord(g, 'dp_replicate'), L.coord(g, 'dp_shard'), R, S);
    reads[L.rankIn(g, ['dp_replicate', 'dp_shard'])] = Array.from({ length: perRank }, (_, i) => d * perRank + i);
  }
  return reads;
}

test('the replicate × shard rank bug is caught: 8 × 4 and 2 × 8', () => {
  for (const [R, S] of [[8, 4], [2, 8]] as const) {
    const gbs = R * S * 2;
    assert.equal(checkPartition(simulate(R, S, right), gbs).ok, true, `${R}x${S} with the right rank`);
    const bad = checkPartition(simulate(R, S, wrong), gbs);
    assert.equal(bad.ok, false, `${R}x${S} with the wrong rank must fail`);
    assert.match(bad.message, /data partition check failed over \d+ DP ranks/);
    if (R > S) {
      // 8 × 4: DP ranks 8r + s skip 4..7, 12..15, ...; half the batch is never read, the rest overruns.
      assert.ok(bad.missing.length > 0 && bad.outOfRange.length > 0);
      assert.match(bad.message, /read by no rank: 8\.\.15/);
    } else {
      // 2 × 8: DP ranks 2r + s overlap: replicate 1's shards 0..5 read what replicate 0's shards 2..7 read.
      assert.ok(bad.collisions.length > 0 && bad.missing.length > 0);
      assert.match(bad.message, /DP rank 2 and DP rank 8 both read 4\.\.5/);
    }
  }
});

test('the bug is silent when replicate and shard sizes are equal (why it went unnoticed)', () => {
  assert.equal(checkPartition(simulate(4, 4, wrong), 32).ok, true);
});
