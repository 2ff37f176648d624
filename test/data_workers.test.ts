// Worker threads started by src/data/workers.ts: a .ts module starts under tsx; a module that
// throws, exits or does not exist while loading rejects `ready` with a message naming it, and a
// thread blocked in Atomics.wait (which sees no events) reads the same answer from problem().
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { once } from 'node:events';
import { startWorker } from '../src/data/workers.js';

const fixture = (name: string) => new URL(`./fixtures/${name}`, import.meta.url);

test('startWorker: a TypeScript module starts, answers, and problem() stays undefined while it runs', async () => {
  const s = startWorker(fixture('worker_echo.ts'));
  await s.ready;
  s.worker.postMessage(41);
  const [m] = await once(s.worker, 'message');
  assert.equal(m, 42);
  assert.equal(s.problem(), undefined);
  await s.worker.terminate();
});

for (const [name, re] of [
  ['worker_throws.ts', /worker thread worker_throws\.ts could not start: this module cannot load/],
  ['worker_exits.ts', /worker thread worker_exits\.ts could not start: the thread exited with code 3 while loading its module/],
  ['worker_missing.ts', /worker thread worker_missing\.ts could not start: .*(Cannot find|not found)/i],
] as const) {
  test(`startWorker: ${name} rejects ready with why, and problem() says the same without waiting`, async () => {
    const s = startWorker(fixture(name));
    await assert.rejects(s.ready, re);
    // The synchronous view a blocked caller polls.
    const shared = new Int32Array(new SharedArrayBuffer(4));
    const t0 = Date.now();
    while (s.problem() === undefined && Date.now() - t0 < 10_000) Atomics.wait(shared, 0, 0, 10);
    assert.match(s.problem() ?? '', re);
  });
}
