// Rank script of the teardown tests: `cycles <n>` runs n cycles of initProcessGroup, an all-reduce
// on the world and on a sub-group, and destroyProcessGroup, in one process, and reports after each
// cycle the open files, threads and listening sockets of this process. Works under flotilla run
// (FileStore), hand-started ranks (flotilla's store on MASTER_ADDR) and mpirun.
import { readdirSync, readFileSync, readlinkSync } from 'node:fs';
import { initProcessGroup, destroyProcessGroup, newGroup } from '../../../src/distributed/process_group.js';
import * as T from '../../../src/tensor/index.js';
import { emitResult } from '../rank.js';

const n = Number(process.argv[3] ?? 50);
const timeoutMs = Number(process.env.TEST_TIMEOUT_MS ?? 20_000);

function listeners(): number {
  const mine = new Set<string>();
  for (const fd of readdirSync('/proc/self/fd')) {
    try {
      const m = /^socket:\[(\d+)\]$/.exec(readlinkSync(`/proc/self/fd/${fd}`));
      if (m) mine.add(m[1]!);
    } catch {
      // closed meanwhile
    }
  }
  let k = 0;
  for (const f of ['/proc/net/tcp', '/proc/net/tcp6']) {
    for (const line of readFileSync(f, 'utf8').split('\n').slice(1)) {
      const cols = line.trim().split(/\s+/);
      if (cols[3] === '0A' && mine.has(cols[9]!)) k++;
    }
  }
  return k;
}

const threads = (): number => readdirSync('/proc/self/task').length;
const after: { fds: number; threads: number; listeners: number }[] = [];
let rank = -1;
let sum = 0;
for (let c = 0; c < n; c++) {
  const world = initProcessGroup({ timeoutMs });
  rank = world.rank;
  const t = T.full([256], world.rank + 1);
  world.allReduce(t).wait();
  const g = newGroup([0, 1]);
  g?.allReduce(t).wait();
  sum = t.toNumbers()[0]!;
  t.dispose();
  destroyProcessGroup();
  // Threads end shortly after they are told to: wait for that (bounded), nothing else.
  const base = after[0]?.threads;
  for (let i = 0; i < 40 && base !== undefined && threads() > base; i++) await new Promise((r) => setTimeout(r, 50));
  after.push({ fds: readdirSync('/proc/self/fd').length, threads: threads(), listeners: listeners() });
}
emitResult({ rank, sum, after });
process.exit(0);
