// One rank of the failure tests. argv[2] = mode; the last rank is the victim:
//   kill-mid     the victim starts a large allReduce and SIGKILLs itself while it is in flight
//   exit-before  the victim exits before the collective; the others enter it (and use waitAsync)
//   stall        the victim stays alive but never enters the collective: the others must time out
// Survivors report the error they got and how long it took.
import { initProcessGroup } from '../../../src/distributed/process_group.js';
import * as T from '../../../src/tensor/index.js';
import { emitResult } from '../rank.js';

const mode = process.argv[2] ?? 'kill-mid';
const timeoutMs = Number(process.env.TEST_TIMEOUT_MS ?? 3000);
const world = initProcessGroup({ timeoutMs });
const victim = world.size - 1;
const isVictim = world.rank === victim;

// A few good collectives first, so the failure hits an established group.
const x = T.full([1 << 20], 1);
for (let i = 0; i < 3; i++) world.allReduce(x).wait();

const big = T.full([1 << 22], world.rank);
if (isVictim) {
  if (mode === 'kill-mid') {
    world.allReduce(big);
    process.kill(process.pid, 'SIGKILL');
  } else if (mode === 'exit-before') {
    process.exit(0);
  } else {
    // Alive and connected, but never enters: sleep past the others' timeout, then leave.
    await new Promise((res) => setTimeout(res, timeoutMs + 1500));
    process.exit(0);
  }
}

const t0 = Date.now();
let error = '';
try {
  const w = world.allReduce(big);
  if (mode === 'exit-before') await w.waitAsync();
  else w.wait();
  // The first may complete (its data was sent before the peer died); the next one cannot.
  for (let i = 0; i < 20; i++) world.allReduce(big).wait();
} catch (e) {
  error = `${(e as Error).name}: ${(e as Error).message}`;
}
emitResult({ rank: world.rank, error, ms: Date.now() - t0 });
process.exit(0);
