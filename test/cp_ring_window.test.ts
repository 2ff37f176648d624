// Ring attention with a sliding window ([Note: ring window] in
// src/parallel/context_parallel/ring_attention.ts) on 2 real ranks in float64
// (test/fixtures/cp_ring_window_rank.ts): windows shorter than a chunk, spanning chunks and the
// whole row, with and without packed documents, grouped-query heads, against plain attention under
// the dense windowed mask (output and the gradients of q, k, v on every rank, blocks skipped counted
// against the dense mask); and the Llama with model.slidingWindow under a ring of 2 against one process.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runWorld, parseResults, describeWorld } from './helpers/world.js';

interface Summary { rank: number; passed: number; failed: { name: string; detail: string }[]; names: string[]; skippedTotal: number }

test('ring attention with a sliding window equals windowed attention on the whole rows (documents too), and a windowed Llama under a ring of 2 equals one process', async () => {
  const r = await runWorld({ nproc: 2, script: 'test/fixtures/cp_ring_window_rank.ts', timeoutMs: 180_000 });
  assert.deepEqual(r.codes, [0, 0], describeWorld(r));
  const all = parseResults<Summary>(r.outputs);
  for (const s of all) {
    assert.deepEqual(s.failed, [], `rank ${s.rank}: ${s.failed.map((f) => `${f.name}: ${f.detail}`).join('\n')}`);
    assert.ok(s.passed >= 6 * 5 + 1 + 2, `rank ${s.rank}: ${s.names.join(', ')}`);
  }
  // Some block lies wholly outside the window: the ring skips it.
  assert.ok(all.reduce((a, s) => a + s.skippedTotal, 0) > 0, 'no block was outside the window');
});
