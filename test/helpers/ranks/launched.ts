// A rank started by `flotilla run` in the launcher tests. argv[2] = mode:
//   ok                 join the world, all-reduce the rank, report the launch variables
//   fail <rank> <code> that rank exits with <code>; the others wait until they are stopped
//   selfkill <rank>    that rank kills itself with SIGKILL; the others wait until they are stopped
//   fail-once          rank 1 exits 3 on the first attempt (FLOTILLA_RESTART_COUNT=0), then all succeed
//   wait               print "ready" and wait for a signal (report it, exit 0)
//   stubborn           like wait, but ignore SIGTERM (the launcher must SIGKILL after its grace period)
import { emitResult } from '../rank.js';

const [mode = 'ok', a1, a2] = process.argv.slice(2);
const rank = Number(process.env.RANK);
const vars = Object.fromEntries(
  ['RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'FLOTILLA_RESTART_COUNT'].map((k) => [k, process.env[k]]),
);

async function joinAndReduce(): Promise<void> {
  const { initProcessGroup } = await import('../../../src/distributed/process_group.js');
  const T = await import('../../../src/tensor/index.js');
  const world = initProcessGroup({ timeoutMs: Number(process.env.TEST_TIMEOUT_MS ?? 20_000) });
  const t = T.full([4], world.rank);
  world.allReduce(t).wait();
  console.log(`rank ${world.rank} of ${world.size}: sum ${t.toNumbers()[0]}`);
  emitResult({ ...vars, sum: t.toNumbers()[0] });
}

if (mode === 'ok') {
  await joinAndReduce();
} else if (mode === 'fail') {
  if (rank === Number(a1)) {
    await new Promise((res) => setTimeout(res, 300));
    console.error(`rank ${rank} failing on purpose`);
    process.exit(Number(a2));
  }
  console.log('waiting to be stopped');
  setInterval(() => {}, 1000);
} else if (mode === 'selfkill') {
  if (rank === Number(a1)) {
    await new Promise((res) => setTimeout(res, 300));
    process.kill(process.pid, 'SIGKILL');
  }
  setInterval(() => {}, 1000);
} else if (mode === 'fail-once') {
  if (process.env.FLOTILLA_RESTART_COUNT === '0' && rank === 1) {
    emitResult({ ...vars, failed: true });
    process.exit(3);
  }
  await joinAndReduce();
} else if (mode === 'wait' || mode === 'stubborn') {
  for (const sig of ['SIGTERM', 'SIGINT'] as const) {
    process.on(sig, () => {
      if (mode === 'stubborn') {
        console.log(`ignoring ${sig}`);
        return;
      }
      emitResult({ ...vars, signal: sig });
      process.exit(Number(process.env.EXIT_ON_SIGNAL ?? 0)); // 0: stopped cleanly (as flotilla train after a Ctrl-C)
    });
  }
  console.log('ready');
  setInterval(() => {}, 1000);
} else {
  throw new Error(`unknown mode ${mode}`);
}
