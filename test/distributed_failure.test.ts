// A rank that dies or stalls must make its peers fail within the process-group timeout, naming the
// op, the group and its ranks, never hang. Each scenario runs as its own world; Gloo's and Open MPI's
// scenarios run side by side.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runWorld, parseAllResults, describeWorld, BACKENDS } from './helpers/world.js';
import { sideBySide, suiteSlots } from './helpers/pool.js';

// Worlds here time out in seconds: no other file's launch runs beside this file (test/helpers/pool.ts).
await suiteSlots.holdAll();

interface Survivor { rank: number; error: string; ms: number }

async function scenario(nproc: number, mode: string, timeoutMs: number, backend: 'gloo' | 'mpi'): Promise<Survivor[]> {
  // The world limit is far below "forever" but well above the group timeout: a hang fails the test.
  const w = await runWorld({ nproc, script: 'test/helpers/ranks/failure.ts', args: [mode], env: { TEST_TIMEOUT_MS: String(timeoutMs) }, timeoutMs: 45_000, backend });
  const survivors = parseAllResults<Survivor>(w.outputs).slice(0, nproc - 1).map((rs, r) => {
    assert.equal(rs.length, 1, `rank ${r} reported once\n${describeWorld(w)}`);
    return rs[0]!;
  });
  for (let r = 0; r < nproc - 1; r++) assert.equal(w.codes[r], 0, describeWorld(w));
  if (mode === 'kill-mid') assert.equal(w.signals[nproc - 1], 'SIGKILL');
  const ranks = Array.from({ length: nproc }, (_, i) => i).join(', ');
  for (const s of survivors) {
    assert.match(s.error, new RegExp(`^CollectiveError: allReduce on group 'world' \\(global ranks \\[${ranks}\\]\\) failed: `), describeWorld(w));
  }
  return survivors;
}

// Gloo sees a dead peer's closed socket; MPI over shared memory cannot, so under MPI the survivors
// fail when the group timeout ends the collective (a shorter timeout keeps those runs short).
const KILL_TIMEOUT_MS = { gloo: 10_000, mpi: 3000 };
const KILL_TRIALS = { gloo: [[1, 3], [2, 2], [3, 3]], mpi: [[1, 3], [2, 2]] } as const;

// The two backends side by side (one subtest each, its cases in turn): their worlds mostly wait, for a
// dead peer's socket or a group timeout, and this file holds every launch slot meanwhile.
sideBySide('a rank that dies, exits or stalls, on Gloo and on Open MPI side by side', BACKENDS.map((backend) => [backend, async (b) => {
    for (const [trial, nproc] of KILL_TRIALS[backend]) {
      await b.test(`${backend}: kill -9 during an all-reduce (trial ${trial}, ${nproc} ranks): the others fail fast`, async () => {
        const limit = KILL_TIMEOUT_MS[backend];
        const s = await scenario(nproc, 'kill-mid', limit, backend);
        for (const x of s) assert.ok(x.ms < limit + 5000, `rank ${x.rank} took ${x.ms} ms`);
      });
    }

    await b.test(`${backend}: a rank that exits before the collective: waitAsync rejects on the others`, async () => {
      await scenario(3, 'exit-before', KILL_TIMEOUT_MS[backend], backend);
    });

    await b.test(`${backend}: a live rank that never enters the collective: the others time out after the group timeout`, async () => {
      const s = await scenario(2, 'stall', 2000, backend);
      for (const x of s) {
        assert.match(x.error, /timed out \(process-group timeout 2000 ms\)/);
        assert.ok(x.ms >= 1500 && x.ms < 2000 * 2 + 5000, `rank ${x.rank} took ${x.ms} ms`);
      }
    });
  }]));
