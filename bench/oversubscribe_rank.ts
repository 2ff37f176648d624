// One rank of bench/oversubscribe.ts: rank 0 computes (matmuls) while the other ranks wait for it in
// an all-reduce; every rank reports its wall time and the CPU time all its threads used meanwhile.
import { readdirSync, readFileSync } from 'node:fs';
import { initProcessGroup } from '../src/distributed/process_group.js';
import * as T from '../src/tensor/index.js';

/** CPU milliseconds used so far by every thread of this process. */
function processCpu(): number {
  let ms = 0;
  for (const t of readdirSync('/proc/self/task')) {
    try {
      ms += Number(readFileSync(`/proc/self/task/${t}/schedstat`, 'utf8').split(' ')[0]) / 1e6;
    } catch {
      // the thread ended
    }
  }
  return ms;
}

const world = initProcessGroup({ timeoutMs: 120_000 });
T.setNumThreads(1);
const x = T.randn([512, 512]);
const t = T.ones([1 << 16]);
world.allReduce(t).wait();
const c0 = processCpu();
const t0 = performance.now();
if (world.rank === 0) for (let i = 0; i < 80; i++) T.tidy(() => void x.matmul(x));
const computeMs = performance.now() - t0;
world.allReduce(t).wait();
console.log(`BENCH ${JSON.stringify({ rank: world.rank, computeMs, wallMs: performance.now() - t0, cpuMs: processCpu() - c0 })}`);
