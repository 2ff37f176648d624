// Rank script: joins the world, reports its pid, then computes for a long time without yielding.
import { initProcessGroup } from '../../../src/distributed/process_group.js';
const g = initProcessGroup();
console.log(`PID ${g.rank} ${process.pid}`);
const t0 = Date.now();
while (Date.now() - t0 < 60_000) {
  /* a long synchronous step: no event-loop turn in which to notice anything */
}
