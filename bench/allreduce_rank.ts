// One flotilla rank of bench/allreduce.ts: times all-reduce (sum, float32) for each size and prints
// one JSON line (rank 0). Sizes and iteration counts come from argv[2] as JSON, identical on every
// rank, so every rank issues the same collectives.
import { initProcessGroup } from '../src/distributed/process_group.js';
import * as T from '../src/tensor/index.js';

interface Plan { sizes: number[]; iters: number[]; rounds: number; warmup: number }
const plan = JSON.parse(process.argv[2]!) as Plan;
const world = initProcessGroup();

const best: number[] = [];
plan.sizes.forEach((bytes, k) => {
  const t = T.ones([bytes / 4]);
  for (let i = 0; i < plan.warmup; i++) world.allReduce(t).wait();
  let min = Infinity;
  for (let round = 0; round < plan.rounds; round++) {
    world.barrier().wait();
    const t0 = process.hrtime.bigint();
    for (let i = 0; i < plan.iters[k]!; i++) world.allReduce(t).wait();
    const s = Number(process.hrtime.bigint() - t0) / 1e9 / plan.iters[k]!;
    min = Math.min(min, s);
  }
  best.push(min);
  t.dispose();
});
if (world.rank === 0) console.log(`BENCH ${JSON.stringify({ impl: 'flotilla', worldSize: world.size, seconds: best, threads: T.getNumThreads(), torch: T.torchVersion() })}`);
