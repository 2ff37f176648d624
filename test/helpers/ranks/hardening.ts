// Rank script of the hardening tests. argv[2] = mode:
//   listen <gofile>  join, all-reduce, print "PID <rank> <pid>", wait until <gofile> exists, exit 0
//   serve <gofile>   join, all-reduce, rank 0 prints "READY <pid>"; after <gofile> exists: a new group
//                    (uses the store again) and an all-reduce; report the sums
//   join             join and all-reduce once; report the sum
//   stall <rank>     that rank never enters the all-reduce (but stays alive); the others time out
//   prejoin          print "PID <rank> <pid>" and compute forever without joining a world
//   cycles <n>       n cycles of initProcessGroup / all-reduce / destroyProcessGroup on one
//                    MASTER_PORT; report open fds, threads and listening sockets after each cycle
import { existsSync, readdirSync, readFileSync, readlinkSync } from 'node:fs';
import { emitResult } from '../rank.js';

const [mode = 'join', arg] = process.argv.slice(2);
const rank = Number(process.env.RANK ?? 0);

async function untilExists(path: string): Promise<void> {
  while (!existsSync(path)) await new Promise((r) => setTimeout(r, 50));
}

/** Inodes of this process's sockets that are listening (from /proc/net/tcp and tcp6). */
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
  let n = 0;
  for (const f of ['/proc/net/tcp', '/proc/net/tcp6']) {
    for (const line of readFileSync(f, 'utf8').split('\n').slice(1)) {
      const cols = line.trim().split(/\s+/);
      if (cols[3] === '0A' && mine.has(cols[9]!)) n++;
    }
  }
  return n;
}

function usage(): { fds: number; threads: number; listeners: number } {
  return { fds: readdirSync('/proc/self/fd').length, threads: readdirSync('/proc/self/task').length, listeners: listeners() };
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

if (mode === 'cycles') {
  const after: ReturnType<typeof usage>[] = [];
  for (let c = 0; c < Number(arg ?? 4); c++) {
    const world = initProcessGroup({ timeoutMs });
    const t = T.full([1024], world.rank + 1);
    world.allReduce(t).wait();
    const g = newGroup([0, 1]);
    g?.allReduce(t).wait();
    t.dispose();
    destroyProcessGroup();
    // A worker thread ends shortly after it was told to; wait for that, nothing else.
    const base = after[0]?.threads;
    for (let i = 0; i < 40 && base !== undefined && readdirSync('/proc/self/task').length > base; i++) {
      await new Promise((r) => setTimeout(r, 50));
    }
    after.push(usage());
  }
  emitResult({ rank, after });
  process.exit(0);
}

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
