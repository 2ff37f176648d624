// The test harness itself: runWorld reports exit codes and results, and a hung world is killed
// with the hung ranks named.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runWorld, parseResults, WorldTimeoutError } from './helpers/world.js';
import { suiteSlots } from './helpers/pool.js';

// Worlds here time out in seconds: no other file's launch runs beside this file (test/helpers/pool.ts).
await suiteSlots.holdAll();

test('runWorld: exit codes and parsed results per rank', async () => {
  const w = await runWorld({ nproc: 2, script: 'test/helpers/ranks/launched.ts', args: ['ok'] });
  assert.deepEqual(w.codes, [0, 0]);
  const res = parseResults<{ RANK: string; sum: number }>(w.outputs);
  assert.deepEqual(res.map((r) => [r.RANK, r.sum]), [['0', 1], ['1', 1]]);
  assert.throws(() => parseResults(['no result here']), /rank 0 printed no result line/);
});

test('runWorld: a world that outlives its timeout is killed, naming the hung ranks', async () => {
  // Rank 0 exits 300 ms after it starts; rank 1 waits forever. The timeout leaves rank 0 time to
  // start on a loaded machine (a 4 s one once ran out before it had).
  const started = Date.now();
  await assert.rejects(
    runWorld({ nproc: 2, script: 'test/helpers/ranks/launched.ts', args: ['fail', '0', '0'], timeoutMs: 12_000 }),
    (e: Error) => e instanceof WorldTimeoutError && e.hung.join() === '1' && /world timed out after 12000 ms: rank 1 still running \(killed\)/.test(e.message) && /waiting to be stopped/.test(e.message),
  );
  assert.ok(Date.now() - started < 40_000);
});
