// Public distributed API: the launch contract, process groups and collectives, DeviceMesh, the
// data-partition check. (The launcher is src/launch; `flotilla run` is src/cli/run.ts.)
export { readLaunchEnv, LaunchEnvError, type LaunchEnv, type LaunchSource } from './env.js';
export {
  ProcessGroup, Work, CollectiveError, CollectiveArgumentError, type ReduceOp, type CollectiveStats,
  initProcessGroup, getWorld, newGroup, destroyProcessGroup, isInitialized, getLaunchEnv, DEFAULT_TIMEOUT_MS,
  describeBackend, resolveBackend, fastestBackend, BACKENDS, type Backend,
} from './process_group.js';
export { mpiAvailable } from './mpi.js';
export { DeviceMesh, MeshDim, MeshLayout, MeshError, type MeshSpec } from './mesh.js';
export { verifyDataPartition, checkPartition, dpRank, DataPartitionError, type PartitionReport } from './partition.js';
