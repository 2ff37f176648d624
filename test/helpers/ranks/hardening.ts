// Rank script of the hardening tests. argv[2] = mode:
//   listen <gofile>  join, all-reduce, print "PID <rank> <pid>", wait until <gofile> exists, exit 0
//   serve <gofile>   join, all-reduce, rank 0 prints "READY <pid>"; after <gofile> exists: a new group
//                    (uses the store again) and an all-reduce; report the sums
//   join             join and all-reduce once; report the sum
//   stall <rank>     that rank never enters the all-reduce (but stays alive); the others time out
//   prejoin          print "PID <rank> <pid>" and compute forever without joining a world
// (Cycles of initProcessGroup / destroyProcessGroup are test/helpers/ranks/teardown.ts's.)
import { existsSync } from 'node:fs';
import { emitResult } from '../rank.js';

const [mode = 'join', arg] = process.argv.slice(2);
const rank = Number(process.env.RANK ?? 0);

async function untilExists(path: string): Promise<void> {
  while (!existsSync(path)) await new Promise((r) => setTimeout(r, 50));
}

if (mode === 'prejoin') {
  console.log(`PID ${rank} ${process.pid}`);
  const t0 = Date.now();
  while (Date.now() - t0 < 120_000) {
    /* busy before any process group exists */
  }
  process.exit(0);
}

const { initProcessGroup, destroyProcessGroup, newGroup } = await import('../../../src/distributed/process_group.js');
const T = await import('../../../src/tensor/index.js');
const timeoutMs = Number(process.env.TEST_TIMEOUT_MS ?? 20_000);

const world = initProcessGroup({ timeoutMs });
const x = T.full([4], world.rank + 1);

if (mode === 'stall' && world.rank === Number(arg)) {
  console.log(`rank ${world.rank} stalls`);
  setInterval(() => {}, 1000);
} else {
  world.allReduce(x).wait();
  const sum = x.toNumbers()[0];
  if (mode === 'listen') {
    console.log(`PID ${world.rank} ${process.pid}`);
    await untilExists(arg!);
    process.exit(0);
  } else if (mode === 'serve') {
    if (world.rank === 0) console.log(`READY ${process.pid}`);
    await untilExists(arg!);
    const g = newGroup([0, 1])!;
    const y = T.full([4], 10 * (world.rank + 1));
    g.allReduce(y).wait();
    emitResult({ rank: world.rank, sum, groupSum: y.toNumbers()[0] });
    destroyProcessGroup();
    process.exit(0);
  } else {
    emitResult({ rank: world.rank, sum });
    destroyProcessGroup();
    process.exit(0);
  }
}
