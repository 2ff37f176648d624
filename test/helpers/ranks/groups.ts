// One rank of the sub-group / DeviceMesh / data-partition test (4 ranks).
import { initProcessGroup, newGroup } from '../../../src/distributed/process_group.js';
import { DeviceMesh } from '../../../src/distributed/mesh.js';
import { verifyDataPartition, dpRank } from '../../../src/distributed/partition.js';
import * as T from '../../../src/tensor/index.js';
import { Checks, emitResult } from '../rank.js';

const world = initProcessGroup({ timeoutMs: 30_000 });
const r = world.rank;
const c = new Checks();
if (world.size !== 4) throw new Error('groups.ts expects 4 ranks');
const range = (k: number): number[] => Array.from({ length: k }, (_, i) => i);

// ---- newGroup: every rank calls every newGroup, in the same order
const evens = newGroup([0, 2], { name: 'evens' });
const odds = newGroup([3, 1], { name: 'odds' }); // group ranks follow ascending global rank
const three = newGroup([1, 2, 3]);
const solo = newGroup([0]); // a group of one (rank 0 only)
const mine = r % 2 === 0 ? evens : odds;
c.ok('membership', (r % 2 === 0 ? odds : evens) === undefined && mine !== undefined && (three === undefined) === (r === 0));
c.ok('solo only on rank 0', (solo !== undefined) === (r === 0) && (solo?.backend ?? 'local') === 'local');
c.ok('odds ranks sorted', odds === undefined || (odds.ranks.join() === '1,3' && odds.rank === (r === 1 ? 0 : 1)), JSON.stringify(odds?.ranks));
T.tidy(() => {
  const t = T.full([5], r + 1);
  mine!.allReduce(t).wait();
  c.close('allReduce in evens/odds', t.toNumbers(), range(5).map(() => (r % 2 === 0 ? 1 + 3 : 2 + 4)));
  if (three) {
    // reduceScatter on a group of 3 inside a world of 4: shards of 5 elements.
    const input = T.tensor(Float32Array.from(range(15), (k) => k * (r + 1)));
    const out = T.zeros([5]);
    three.reduceScatter(out, input).wait();
    const g = three.rank;
    c.close('reduceScatter on 3 ranks', out.toNumbers(), range(5).map((i) => (5 * g + i) * (2 + 3 + 4)));
    const gathered = T.zeros([3 * 7], { dtype: 'int64' });
    three.allGatherInto(gathered, T.full([7], r, { dtype: 'int64' })).wait();
    c.close('allGatherInto on 3 ranks', gathered.toNumbers(), [1, 2, 3].flatMap((j) => range(7).map(() => j)));
    // Point to point uses group ranks: group rank 0 (global 1) sends to group rank 2 (global 3).
    if (three.rank === 0) three.send(T.full([3], 42), 2, 1).wait();
    if (three.rank === 2) {
      const got = T.zeros([3]);
      three.recv(got, 0, 1).wait();
      c.close('send/recv by group rank', got.toNumbers(), [42, 42, 42]);
    }
    const b = T.full([2], r);
    three.broadcast(b, 1).wait(); // group rank 1 = global 2
    c.close('broadcast from group rank', b.toNumbers(), [2, 2]);
  }
  c.ok('group stats are per group', mine!.stats.total === 1 && world.stats.total === 0, JSON.stringify([mine!.stats, world.stats]));
});

// ---- DeviceMesh 2 × 2 and flattening
const mesh = DeviceMesh.build({ pp: 1, dp_replicate: 2, dp_shard: -1, tp: 1 });
const rep = mesh.dim('dp_replicate'), shard = mesh.dim('dp_shard');
c.ok('mesh sizes', mesh.sizes.join() === '1,2,2,1' && rep.size === 2 && shard.size === 2 && mesh.dim('pp').size === 1 && mesh.dim('tp').size === 1);
c.ok('mesh coords', rep.rank === Math.floor(r / 2) && shard.rank === r % 2, JSON.stringify(mesh.coords()));
c.ok('shard group members', shard.ranks.join() === (r < 2 ? '0,1' : '2,3'), shard.ranks.join());
c.ok('replicate group members', rep.ranks.join() === (r % 2 === 0 ? '0,2' : '1,3'), rep.ranks.join());
const dp = mesh.flatten(['dp_replicate', 'dp_shard'], 'dp');
c.ok('dp rank = replicate * shard_size + shard', dp.rank === dpRank(rep.rank, shard.rank, shard.size) && dp.size === 4 && dp.group === world);
c.ok('flatten again returns the same dim', mesh.flatten(['dp_replicate', 'dp_shard'], 'dp') === dp && mesh.dim('dp') === dp);
c.throws('unknown dim lists names', () => mesh.dim('dq'), /no dim 'dq'/, /pp, dp_replicate, dp_shard, tp/, /flattened: dp/);
c.throws('non-adjacent flatten', () => mesh.flatten(['pp', 'dp_shard'], 'x'), /must be adjacent/);
T.tidy(() => {
  const t = T.full([3], r);
  shard.group.allReduce(t, 'max').wait();
  c.close('allReduce over dp_shard', t.toNumbers(), [1, 1, 1].map(() => (r < 2 ? 1 : 3)));
  const u = T.full([3], r + 1);
  rep.group.allReduce(u, 'product').wait();
  c.close('allReduce over dp_replicate', u.toNumbers(), [1, 1, 1].map(() => (r % 2 === 0 ? 1 * 3 : 2 * 4)));
});

// ---- the data partition check, with the right and a wrong DP rank
const globalBatch = 16;
const per = globalBatch / dp.size;
const slice = (d: number): number[] => range(per).map((i) => d * per + i);
const right = verifyDataPartition(dp.group, slice(dpRank(rep.rank, shard.rank, shard.size)), globalBatch);
c.ok('right DP rank partitions the batch', right.flat().sort((a, b) => a - b).join() === range(globalBatch).join());

// replicate 4 × shard 1: the wrong formula replicate_rank * replicate_size + shard_rank gives 0, 4, 8, 12.
const mesh41 = DeviceMesh.build({ dp_replicate: 4, dp_shard: 1 });
const rep4 = mesh41.dim('dp_replicate'), shard1 = mesh41.dim('dp_shard');
const dp41 = mesh41.flatten(['dp_replicate', 'dp_shard'], 'dp');
const wrong = rep4.rank * rep4.size + shard1.rank;
let message = '';
try {
  verifyDataPartition(dp41.group, slice(wrong), globalBatch);
} catch (e) {
  message = (e as Error).message;
  c.ok('partition error type', (e as Error).name === 'DataPartitionError', (e as Error).name);
}
c.ok('wrong DP rank is caught', /data partition check failed/.test(message) && /DP rank 1 \(global rank 1\) reads 16\.\.19; DP rank 2 \(global rank 2\) reads 32\.\.35/.test(message) && /read by no rank: 4\.\.15/.test(message), message);

// Uneven sample counts per rank are fine when they still partition the batch.
const uneven = r === 0 ? range(10) : [10 + (r - 1) * 2, 11 + (r - 1) * 2];
c.run('uneven counts', () => void verifyDataPartition(world, uneven, globalBatch));

// ---- a rank that asks for a different group than its peers gets a clear error (last: it
// leaves ranks 2 and 3 one newGroup call behind)
let mismatch = '';
try {
  newGroup(r < 2 ? [0, 1] : [0, 1, 2, 3]);
} catch (e) {
  mismatch = (e as Error).message;
}
if (r >= 2) c.ok('mismatched newGroup is named', /global rank 0 asked for ranks \[0,1\]/.test(mismatch) && /same order/.test(mismatch), mismatch);
else c.ok('matching members are unaffected', mismatch === '', mismatch);

emitResult({ rank: r, ...c.summary(), partitionMessage: message });
