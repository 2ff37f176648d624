// Ring attention over packed rows ([Note: ring documents] in
// src/parallel/context_parallel/ring_attention.ts), on 4 real ranks in float64
// (test/fixtures/cp_ring_docs_rank.ts, one world): a ring of 4 and two rings of 2 against plain
// attention masked to each query's own document, output and the gradients of q, k, v on every rank,
// with blocks that hold query rows reading none of their keys and blocks the ring skips (counted
// against the dense mask); and the GPT and the Llama under a ring of 2 with the documents cut to
// the rank's chunks against one process.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runWorld, parseResults, describeWorld } from './helpers/world.js';

interface Summary {
  rank: number; passed: number; failed: { name: string; detail: string }[]; names: string[];
  totals: { skipped: number; emptyRows: number };
}

test('ring attention with documents equals masked attention on the whole rows: output, q/k/v gradients, skipped blocks (rings of 4 and 2, grouped-query, bfloat16), and the models under a ring of 2', async () => {
  const r = await runWorld({ nproc: 4, script: 'test/fixtures/cp_ring_docs_rank.ts', timeoutMs: 180_000 });
  assert.deepEqual(r.codes, [0, 0, 0, 0], describeWorld(r));
  const all = parseResults<Summary>(r.outputs);
  for (const s of all) {
    assert.deepEqual(s.failed, [], `rank ${s.rank}: ${s.failed.map((f) => `${f.name}: ${f.detail}`).join('\n')}`);
    assert.ok(s.passed >= 5 * 5 + 1 + 2 * 3, `rank ${s.rank}: ${s.names.join(', ')}`);
  }
  // The layout exercises both cases the ring has to get right, somewhere in the world.
  assert.ok(all.reduce((a, s) => a + s.totals.skipped, 0) > 0, 'no block was skippable');
  assert.ok(all.reduce((a, s) => a + s.totals.emptyRows, 0) > 0, 'no computed block held a query row with no allowed key');
});
