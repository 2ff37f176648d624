// The launch contract: torchrun / flotilla run, mpirun and srun variables, defaults and errors.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readLaunchEnv, timeoutFromEnv, isLoopback, LaunchEnvError } from '../src/distributed/env.js';

test('torchrun variables', () => {
  const e = readLaunchEnv({ RANK: '5', WORLD_SIZE: '8', LOCAL_RANK: '1', LOCAL_WORLD_SIZE: '4', MASTER_ADDR: '10.0.0.2', MASTER_PORT: '29600' });
  assert.deepEqual(e, { rank: 5, worldSize: 8, localRank: 1, localWorldSize: 4, masterAddr: '10.0.0.2', masterPort: 29600, source: 'torchrun' });
});

test('torchrun variables without LOCAL_* or MASTER_*: one host, default address', () => {
  const e = readLaunchEnv({ RANK: '1', WORLD_SIZE: '2' });
  assert.deepEqual(e, { rank: 1, worldSize: 2, localRank: 1, localWorldSize: 2, masterAddr: '127.0.0.1', masterPort: 29500, source: 'torchrun' });
});

test('mpirun (Open MPI) variables', () => {
  const e = readLaunchEnv({
    OMPI_COMM_WORLD_RANK: '3', OMPI_COMM_WORLD_SIZE: '4', OMPI_COMM_WORLD_LOCAL_RANK: '1', OMPI_COMM_WORLD_LOCAL_SIZE: '2', MASTER_ADDR: 'node0',
  });
  assert.deepEqual(e, { rank: 3, worldSize: 4, localRank: 1, localWorldSize: 2, masterAddr: 'node0', masterPort: 29500, source: 'mpirun' });
});

test('srun (Slurm) variables', () => {
  const e = readLaunchEnv({ SLURM_PROCID: '6', SLURM_NTASKS: '8', SLURM_LOCALID: '2', SLURM_TASKS_PER_NODE: '4(x2)', MASTER_PORT: '1234' });
  assert.deepEqual(e, { rank: 6, worldSize: 8, localRank: 2, localWorldSize: 4, masterAddr: '127.0.0.1', masterPort: 1234, source: 'srun' });
  const f = readLaunchEnv({ SLURM_PROCID: '0', SLURM_NTASKS: '2', SLURM_LOCALID: '0', SLURM_NTASKS_PER_NODE: '2' });
  assert.equal(f.localWorldSize, 2);
});

test('torchrun variables win over mpirun and srun ones', () => {
  const e = readLaunchEnv({ RANK: '0', WORLD_SIZE: '2', OMPI_COMM_WORLD_RANK: '1', OMPI_COMM_WORLD_SIZE: '4', SLURM_PROCID: '3', SLURM_NTASKS: '4' });
  assert.equal(e.source, 'torchrun');
  assert.equal(e.worldSize, 2);
  assert.equal(readLaunchEnv({ OMPI_COMM_WORLD_RANK: '1', OMPI_COMM_WORLD_SIZE: '4', SLURM_PROCID: '3', SLURM_NTASKS: '4' }).source, 'mpirun');
});

test('no variables: a single process', () => {
  assert.deepEqual(readLaunchEnv({}), { rank: 0, worldSize: 1, localRank: 0, localWorldSize: 1, masterAddr: '127.0.0.1', masterPort: 29500, source: 'single' });
  assert.equal(readLaunchEnv({ PATH: '/bin', RANK: '' }).source, 'single');
});

test('malformed values name the variable', () => {
  const cases: [Record<string, string>, RegExp][] = [
    [{ RANK: 'one', WORLD_SIZE: '2' }, /^RANK="one" is not a non-negative integer/],
    [{ RANK: '0', WORLD_SIZE: '0' }, /^WORLD_SIZE="0" is not a positive integer/],
    [{ RANK: '-1', WORLD_SIZE: '2' }, /^RANK="-1"/],
    [{ RANK: '2', WORLD_SIZE: '2' }, /RANK=2 is not below WORLD_SIZE=2/],
    [{ RANK: '0' }, /WORLD_SIZE is not set, but RANK is/],
    [{ WORLD_SIZE: '2' }, /RANK is not set, but WORLD_SIZE is/],
    [{ RANK: '0', WORLD_SIZE: '2', LOCAL_RANK: '1.5' }, /^LOCAL_RANK="1.5"/],
    [{ RANK: '0', WORLD_SIZE: '2', LOCAL_RANK: '2', LOCAL_WORLD_SIZE: '2' }, /LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2/],
    [{ RANK: '0', WORLD_SIZE: '2', LOCAL_WORLD_SIZE: '3' }, /LOCAL_WORLD_SIZE=3 is larger than WORLD_SIZE=2/],
    [{ RANK: '0', WORLD_SIZE: '2', MASTER_PORT: '70000' }, /MASTER_PORT=70000 is not a TCP port/],
    [{ RANK: '0', WORLD_SIZE: '2', MASTER_PORT: 'http' }, /^MASTER_PORT="http"/],
    [{ RANK: '0', WORLD_SIZE: '2', MASTER_ADDR: 'a b' }, /^MASTER_ADDR="a b"/],
    [{ OMPI_COMM_WORLD_RANK: '0' }, /OMPI_COMM_WORLD_SIZE is not/],
    [{ OMPI_COMM_WORLD_RANK: '0', OMPI_COMM_WORLD_SIZE: 'x' }, /^OMPI_COMM_WORLD_SIZE="x"/],
    [{ SLURM_PROCID: '0', SLURM_NTASKS: 'four' }, /^SLURM_NTASKS="four"/],
    [{ SLURM_PROCID: '4', SLURM_NTASKS: '4' }, /SLURM_PROCID=4 is not below SLURM_NTASKS=4/],
    [{ SLURM_PROCID: '0', SLURM_NTASKS: '4', SLURM_LOCALID: 'z' }, /^SLURM_LOCALID="z"/],
  ];
  for (const [env, re] of cases) {
    assert.throws(() => readLaunchEnv(env), (e: Error) => e instanceof LaunchEnvError && re.test(e.message), `${JSON.stringify(env)} should fail with ${re}`);
  }
});

test('timeout and loopback helpers', () => {
  assert.equal(timeoutFromEnv(300_000, {}), 300_000);
  assert.equal(timeoutFromEnv(300_000, { FLOTILLA_TIMEOUT_MS: '5000' }), 5000);
  assert.throws(() => timeoutFromEnv(1, { FLOTILLA_TIMEOUT_MS: '5s' }), /FLOTILLA_TIMEOUT_MS="5s"/);
  assert.ok(isLoopback('127.0.0.1') && isLoopback('127.1.2.3') && isLoopback('localhost') && isLoopback('::1'));
  assert.ok(!isLoopback('10.0.0.1') && !isLoopback('node0'));
});
