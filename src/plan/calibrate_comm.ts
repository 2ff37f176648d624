// One rank of the planner's communication table: every rank of the world joins groups of each size
// g (contiguous ranks, all groups busy at once, as the layouts' groups are in a step) and times each
// collective at a few sizes; rank 0 writes the medians (ms) to OUT.json. Ranks on other hosts are
// not reached here: the table is for groups within this host.
//   flotilla run --nproc N calibrate_comm.ts OUT.json '{"sizes":[...],"reps":5}'
import { writeFileSync } from 'node:fs';
import { initProcessGroup, newGroup, destroyProcessGroup, type ProcessGroup } from '../distributed/process_group.js';
import { empty, ones, setNumThreads, tensor } from '../tensor/index.js';
import type { Collective } from '../distributed/plan_terms.js';
import { COLLECTIVES } from './terms.js';
import { gatherInPlace } from '../parallel/data_parallel/zero_gathers.js';
import { median } from './stats.js';

const [outPath, planText] = process.argv.slice(2);
const plan = JSON.parse(planText!) as { sizes: number[]; reps: number; threads: number };
setNumThreads(plan.threads);
const world = initProcessGroup();
const sizes = Array.from({ length: world.size }, (_, i) => i + 1).filter((g) => g > 1 && world.size % g === 0);
const table: Record<string, [number, number][]> = {};

function once(g: ProcessGroup, op: Collective, bytes: number): () => void {
  const n = Math.max(g.size, Math.floor(bytes / 4 / g.size) * g.size); // elements, divisible by the group
  const full = ones([n]);
  const part = empty([n / g.size]);
  switch (op) {
    case 'allReduce': return () => g.allReduce(full).wait();
    // As the layouts gather parameters: one broadcast per rank into the bucket ([Note: in-place gathers]).
    case 'allGather': return () => gatherInPlace(g, full, n / g.size).wait();
    case 'reduceScatter': return () => g.reduceScatter(part, full).wait();
    case 'allToAll': { const o = empty([n]); return () => g.allToAll(o, full).wait(); }
    case 'sendRecv': {
      const r = empty([n]);
      return () => {
        const s = g.send(full, (g.rank + 1) % g.size);
        const q = g.recv(r, (g.rank + g.size - 1) % g.size);
        s.wait(); q.wait();
      };
    }
  }
}

for (const size of sizes) {
  let mine: ProcessGroup | undefined;
  for (let first = 0; first < world.size; first += size) {
    const g = newGroup(Array.from({ length: size }, (_, i) => first + i), { name: `plan-comm-${size}-${first}` });
    if (g) mine = g;
  }
  for (const op of COLLECTIVES) {
    const row: [number, number][] = [];
    for (const bytes of plan.sizes) {
      const fn = once(mine!, op, bytes);
      fn();
      const ts: number[] = [];
      for (let k = 0; k < plan.reps; k++) {
        world.barrier().wait();
        const t0 = performance.now();
        fn();
        ts.push(performance.now() - t0);
      }
      // Every rank's time counts: a collective ends for the step when its slowest member is done.
      const all = tensor(Float32Array.from({ length: world.size }, (_, r) => (r === world.rank ? median(ts) : 0)));
      world.allReduce(all, 'max').wait();
      row.push([bytes, Math.max(...Array.from(all.toArray() as Float32Array))]);
    }
    table[`${op}:${size}`] = row;
  }
}
if (world.rank === 0) writeFileSync(outPath!, JSON.stringify({ worldSize: world.size, backend: world.backend, table }));
destroyProcessGroup();
