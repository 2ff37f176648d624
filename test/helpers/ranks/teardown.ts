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
const fds = (): number => readdirSync('/proc/self/fd').length;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

// destroyProcessGroup returns once the store's listener is closed; the store's worker thread and its
// event loop's descriptors (an epoll fd, an eventfd, a pipe pair) go a moment later, so a count taken
// at once can hold a few that are closing (rank 0 once counted 25 against 22, and right after the
// first cycle /proc/self/fd listed ten more than a count taken milliseconds later). Each count waits
// for them: until this cycle is back at the first one's counts, or, for the first, until its counts
// hold still for 200 ms. Bounded per cycle and over the run, so a real leak is counted, not waited out.
let budgetMs = 20_000;
async function settle(base: { fds: number; threads: number } | undefined): Promise<void> {
  const start = Date.now();
  let prev = '', still = 0;
  while (Date.now() - start < 2_000 && budgetMs > 0) {
    const f = fds(), t = threads();
    if (base ? f <= base.fds && t <= base.threads : still >= 4) break;
    still = `${f} ${t}` === prev ? still + 1 : 0;
    prev = `${f} ${t}`;
    await sleep(50);
    budgetMs -= 50;
  }
}

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
  await settle(after[0]);
  after.push({ fds: fds(), threads: threads(), listeners: listeners() });
}
emitResult({ rank, sum, after });
process.exit(0);
