// A rank that knows nothing about how it was started: it joins the world from whatever launch
// variables are set (torchrun-style, mpirun's OMPI_COMM_WORLD_*, srun's SLURM_*) and all-reduces.
import { initProcessGroup, getLaunchEnv } from '../../../src/distributed/process_group.js';
import * as T from '../../../src/tensor/index.js';
import { emitResult } from '../rank.js';

const world = initProcessGroup({ timeoutMs: 20_000 });
const t = T.full([3], world.rank + 1);
world.allReduce(t).wait();
const env = getLaunchEnv();
emitResult({ rank: world.rank, size: world.size, source: env.source, localRank: env.localRank, sum: t.toNumbers()[0] });
