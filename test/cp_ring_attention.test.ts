// Ring attention on its own (src/parallel/context_parallel/ring_attention.ts), on 4 real ranks in
// float64 (test/fixtures/cp_ring_rank.ts, one world): a ring of 4 and two rings of 2 against plain
// causal attention on the whole sequences: each rank's output chunks and the gradients of its
// queries, keys and values, with grouped-query heads and without, and bfloat16 inputs.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runWorld, parseResults, describeWorld } from './helpers/world.js';

interface Summary { rank: number; passed: number; failed: { name: string; detail: string }[]; names: string[] }

test('ring attention equals plain causal attention: output and the gradients of q, k, v on every rank (rings of 4 and of 2, grouped-query heads, bfloat16)', async () => {
  const r = await runWorld({ nproc: 4, script: 'test/fixtures/cp_ring_rank.ts', timeoutMs: 120_000 });
  assert.deepEqual(r.codes, [0, 0, 0, 0], describeWorld(r));
  for (const s of parseResults<Summary>(r.outputs)) {
    assert.deepEqual(s.failed, [], `rank ${s.rank}: ${s.failed.map((f) => `${f.name}: ${f.detail}`).join('\n')}`);
    assert.equal(s.passed, 5 * 4 + 1, `rank ${s.rank}: ${s.names.join(', ')}`);
  }
});
