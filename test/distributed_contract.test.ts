// One script, three launchers: the same rank code joins a real world from torchrun-style variables,
// from mpirun's OMPI_COMM_WORLD_* and from srun's SLURM_* (real processes on loopback).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runWorld, parseResults } from './helpers/world.js';

const CONTRACT = ['RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE'];
const without = Object.fromEntries(CONTRACT.map((k) => [k, undefined]));

interface R { rank: number; size: number; source: string; localRank: number; sum: number }

async function world(nproc: number, rankEnv: (rank: number) => Record<string, string | undefined>): Promise<R[]> {
  const r = await runWorld({ nproc, script: 'test/helpers/ranks/contract.ts', env: without, rankEnv, timeoutMs: 60_000 });
  assert.deepEqual(r.codes, new Array(nproc).fill(0), r.outputs.join('\n'));
  return parseResults<R>(r.outputs).sort((a, b) => a.rank - b.rank);
}

const expectSum = (n: number) => (n * (n + 1)) / 2;

test('the same script runs under torchrun-style variables', async () => {
  const r = await runWorld({ nproc: 3, script: 'test/helpers/ranks/contract.ts', timeoutMs: 60_000 });
  assert.deepEqual(r.codes, [0, 0, 0], r.outputs.join('\n'));
  const res = parseResults<R>(r.outputs).sort((a, b) => a.rank - b.rank);
  assert.deepEqual(res.map((x) => [x.rank, x.size, x.source, x.sum]), [0, 1, 2].map((k) => [k, 3, 'torchrun', expectSum(3)]));
});

test('the same script runs under mpirun variables (OMPI_COMM_WORLD_*)', async () => {
  const res = await world(3, (rank) => ({
    OMPI_COMM_WORLD_RANK: String(rank), OMPI_COMM_WORLD_SIZE: '3', OMPI_COMM_WORLD_LOCAL_RANK: String(rank), OMPI_COMM_WORLD_LOCAL_SIZE: '3',
  }));
  assert.deepEqual(res.map((x) => [x.rank, x.size, x.source, x.localRank, x.sum]), [0, 1, 2].map((k) => [k, 3, 'mpirun', k, expectSum(3)]));
});

test('the same script runs under srun variables (SLURM_*)', async () => {
  const res = await world(2, (rank) => ({ SLURM_PROCID: String(rank), SLURM_NTASKS: '2', SLURM_LOCALID: String(rank), SLURM_NTASKS_PER_NODE: '2' }));
  assert.deepEqual(res.map((x) => [x.rank, x.size, x.source, x.localRank, x.sum]), [0, 1].map((k) => [k, 2, 'srun', k, expectSum(2)]));
});
