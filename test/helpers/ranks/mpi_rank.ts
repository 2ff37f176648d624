// A rank started by `flotilla run --backend mpi` in test/distributed_mpi.test.ts. argv[2] = mode:
//   ok                 join the world, all-reduce the rank, report backend, rank, size and the sum
//   fail <rank> <code> that rank exits with <code> after the all-reduce; the others wait to be stopped
//   selfkill <rank>    that rank kills itself with SIGKILL after the all-reduce; the others wait
import { initProcessGroup, describeBackend } from '../../../src/distributed/process_group.js';
import * as T from '../../../src/tensor/index.js';
import { emitResult } from '../rank.js';

const [mode = 'ok', a1, a2] = process.argv.slice(2);
const world = initProcessGroup({ timeoutMs: 20_000 });
const t = T.full([4], world.rank + 1);
world.allReduce(t).wait();
console.log(describeBackend(world));
emitResult({ rank: world.rank, size: world.size, backend: world.backend, sum: t.toNumbers()[0], rankVar: process.env.RANK ?? null, pid: process.pid });
if (mode === 'fail' && world.rank === Number(a1)) process.exit(Number(a2));
if (mode === 'selfkill' && world.rank === Number(a1)) process.kill(process.pid, 'SIGKILL');
if (mode !== 'ok') await new Promise((res) => setTimeout(res, 30_000)); // stopped by the launcher
