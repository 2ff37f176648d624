// Rank script of the fault tests (test/hardening_faults.test.ts). argv[2] = mode:
//   throw-mid-step  every rank posts a receive from its neighbour, as a pipeline stage does; the
//                   last rank then throws (its clean-up destroys the process group in a finally)
//                   while the others wait in their receive
//   train <steps>   all-reduce a small tensor every 200 ms for <steps> steps (a training loop),
//                   printing "STEP <rank> <k>"; rank 0 reports the sum at the end
// Every rank prints the backend line (describeBackend) and "PID <rank> <pid>" once it joined.
import { initProcessGroup, destroyProcessGroup, describeBackend } from '../../../src/distributed/process_group.js';
import * as T from '../../../src/tensor/index.js';
import { emitResult } from '../rank.js';

const [mode = 'train', arg] = process.argv.slice(2);
const world = initProcessGroup();
console.log(describeBackend(world));
console.log(`PID ${world.rank} ${process.pid}`);

if (mode === 'throw-mid-step') {
  const x = T.zeros([1024]);
  const peer = (world.rank + 1) % world.size;
  try {
    const w = world.recv(x, peer);
    if (world.rank === world.size - 1) {
      await new Promise((r) => setTimeout(r, 500)); // the others are inside their receive by now
      throw new Error(`stage ${world.rank}: a bug in the middle of a pipeline step`);
    }
    w.wait();
  } finally {
    destroyProcessGroup();
  }
} else {
  const steps = Number(arg ?? 50);
  const t = T.full([256], 1);
  for (let k = 0; k < steps; k++) {
    world.allReduce(t).wait();
    t.fill_(1);
    console.log(`STEP ${world.rank} ${k}`);
    await new Promise((r) => setTimeout(r, 200));
  }
  world.allReduce(t).wait();
  if (world.rank === 0) emitResult({ sum: t.toNumbers()[0] });
  destroyProcessGroup();
}
