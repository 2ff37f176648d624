// Collectives, sub-groups, DeviceMesh groups and the data-partition check on real ranks over loopback,
// on both backends (Gloo, and Open MPI under mpirun). The rank scripts check the numbers themselves
// (they know every rank's data) and report each check.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runWorld, parseResults, describeWorld, BACKENDS } from './helpers/world.js';
import { suiteSlots } from './helpers/pool.js';

// Worlds here time out in seconds: no other file's launch runs beside this file (test/helpers/pool.ts).
await suiteSlots.holdAll();

interface Summary { rank: number; size: number; backend: string; threads: number; passed: number; failed: { name: string; detail: string }[]; names: string[] }

const CONTRACT_OFF = { RANK: undefined, WORLD_SIZE: undefined, LOCAL_RANK: undefined, LOCAL_WORLD_SIZE: undefined, MASTER_ADDR: undefined, MASTER_PORT: undefined };

async function collectives(nproc: number, env: Record<string, string | undefined> = {}, backend: 'gloo' | 'mpi' = 'gloo'): Promise<Summary[]> {
  const w = await runWorld({ nproc, script: 'test/helpers/ranks/collectives.ts', env, timeoutMs: 90_000, backend });
  assert.deepEqual(w.codes, new Array(nproc).fill(0), describeWorld(w));
  const res = parseResults<Summary>(w.outputs);
  for (const r of res) assert.deepEqual(r.failed, [], `rank ${r.rank} failed checks:\n${r.failed.map((f) => `${f.name}: ${f.detail}`).join('\n')}`);
  // Every rank ran the same checks.
  for (const r of res) assert.deepEqual(r.names, res[0]!.names);
  return res;
}

for (const backend of BACKENDS) for (const nproc of [2, 4]) {
  test(`${backend}: collectives on ${nproc} ranks: every op and dtype, odd lengths, staging, async completion`, async () => {
    const res = await collectives(nproc, {}, backend);
    assert.ok(res[0]!.passed > 190, `${res[0]!.passed} checks`);
    for (const r of res) {
      assert.equal(r.backend, backend);
      assert.equal(r.threads, 1, 'ranks sharing the cores get one intra-op thread each');
    }
    const names = res[0]!.names;
    for (const d of ['float32', 'float64', 'int64', 'bfloat16']) {
      for (const op of ['allReduce sum', 'allReduce max', 'allReduce product', 'reduceScatter sum', 'allGatherInto', 'broadcast', 'allToAll uneven', 'send/recv ring']) {
        assert.ok(names.some((n) => n.startsWith(`${op} ${d}`)), `${op} ${d} was checked`);
      }
    }
  });
}

test('a world of one (no launch variables): collectives are local and complete', async () => {
  const res = await collectives(1, CONTRACT_OFF);
  assert.equal(res[0]!.backend, 'local');
  assert.ok(res[0]!.passed > 150);
});

for (const backend of BACKENDS) test(`${backend}: sub-groups, DeviceMesh groups and the data-partition check on 4 ranks`, async () => {
  const w = await runWorld({ nproc: 4, script: 'test/helpers/ranks/groups.ts', timeoutMs: 90_000, backend });
  assert.deepEqual(w.codes, [0, 0, 0, 0], describeWorld(w));
  const res = parseResults<Summary & { partitionMessage: string }>(w.outputs);
  for (const r of res) assert.deepEqual(r.failed, [], `rank ${r.rank}:\n${r.failed.map((f) => `${f.name}: ${f.detail}`).join('\n')}`);
  // The wrong DP rank made every rank throw the same error.
  assert.ok(res[0]!.partitionMessage.length > 0);
  for (const r of res) assert.equal(r.partitionMessage, res[0]!.partitionMessage);
});

test('FLOTILLA_GLOO_IFACE picks the network interface', async () => {
  const w = await runWorld({ nproc: 2, script: 'test/helpers/ranks/launched.ts', args: ['ok'], env: { FLOTILLA_GLOO_IFACE: 'lo' } });
  assert.deepEqual(w.codes, [0, 0], describeWorld(w));
  const bad = await runWorld({ nproc: 2, script: 'test/helpers/ranks/launched.ts', args: ['ok'], env: { FLOTILLA_GLOO_IFACE: 'nosuch0', TEST_TIMEOUT_MS: '3000' } });
  assert.ok(bad.codes.every((c) => c !== 0));
  assert.match(bad.outputs[0]!, /could not connect the world of 2 ranks .*\(Gloo on interface nosuch0 \(FLOTILLA_GLOO_IFACE\)\).*Unable to find address for: nosuch0/);
});

test('a rank that never arrives: rendezvous fails after the timeout, naming the world and address', async () => {
  // One process told the world has two ranks.
  const w = await runWorld({ nproc: 1, script: 'test/helpers/ranks/launched.ts', args: ['ok'], store: 'socket', env: { WORLD_SIZE: '2', TEST_TIMEOUT_MS: '2000' } });
  assert.notEqual(w.codes[0], 0);
  assert.match(w.outputs[0]!, /rank 0: could not connect the world of 2 ranks through 127\.0\.0\.1:\d+ within 2000 ms/);
});
