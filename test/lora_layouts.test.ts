// LoRA under data parallelism and ZeRO-3 against one process (test/fixtures/tp_gpt_rank.ts with
// `lora`): a GPT with rank-4 adapters on every linear layer but the head, its base frozen by
// applyLora, 3 AdamW steps with clipping and 2 micro-batches, float64. Losses, gradient norms,
// every whole parameter and step 0's adapter gradients equal one process's; the base never moves,
// has no gradients and takes no gradient bytes; under ZeRO-3 the frozen base is sharded with its unit.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { maxRelDiff } from './helpers/close.js';
import { pool } from './helpers/pool.js';
import { equivalenceSuite } from './helpers/equivalence.js';
import type { Out, Run } from './fixtures/tp_gpt_rank.js';

const suite = equivalenceSuite<Run, Out>('lora', 'test/fixtures/tp_gpt_rank.ts', { timeoutMs: 240_000, queue: pool() });
const TOL_SCALAR = 1e-12, TOL_PARAM = 1e-10;
/** Every parameter but the adapters' (applyLora freezes them; the fixture then checks they never move). */
const BASE = ['^(?!.*\\.lora[AB]\\.weight$)'];
const lora = { micro: 2, steps: 3, lora: { rank: 4, alpha: 8, targets: ['all-linear'] }, frozen: BASE };
const reference = suite.launch(1, [{ name: 'ref_lora', ...lora }]);
const world2 = suite.launch(2, [{ name: 'lora_dp2', layout: {}, ...lora }, { name: 'lora_z3', layout: { zero: 3 }, ...lora }]);

const isBase = (k: string): boolean => !/\.lora[AB]\.weight$/.test(k);

test('LoRA on every linear layer of a GPT under dp and ZeRO-3 on 2 ranks equals one process: adapters train, the base stays frozen and is sharded under ZeRO-3', async () => {
  await Promise.all([reference, world2]);
  const ref = suite.read('ref_lora', 1)[0]!;
  const adapters = Object.keys(ref.params).filter((k) => !isBase(k));
  assert.equal(adapters.length, 2 * 2 * 4, 'A and B on qkv, attn.proj, mlp.fc and mlp.proj of 2 blocks');
  assert.deepEqual(Object.keys(ref.grads0).sort(), adapters.sort(), 'one process has gradients for the adapters only');
  assert.deepEqual(ref.frozenMoved, []);
  for (const k of adapters.filter((n) => n.endsWith('loraB.weight'))) assert.ok(ref.params[k]!.some((x) => x !== 0), `${k} trained away from zero`);
  for (const [name, shards] of [['lora_dp2', 1], ['lora_z3', 2]] as const) {
    const { outs } = suite.compare(name, 2, 'ref_lora', { loss: TOL_SCALAR, norm: TOL_SCALAR, param: TOL_PARAM });
    for (const o of outs) {
      const who = `${name}: rank ${o.rank}`;
      assert.deepEqual(Object.keys(o.grads0).sort(), adapters, `${who}: gradients for the adapters only`);
      for (const [k, v] of Object.entries(o.grads0)) assert.ok(maxRelDiff(v, ref.grads0[k]!) <= TOL_PARAM, `${who}: step 0 gradient of ${k}`);
      assert.deepEqual(o.frozenMoved, [], `${who}: the base moved`);
      const m = o.memory!;
      assert.ok(m.gradBytes * shards >= m.trainableBytes && m.gradBytes * shards < m.trainableBytes + 8 * 64 * shards, `${who}: ${m.gradBytes} gradient bytes for ${m.trainableBytes} trainable bytes`);
      // AdamW's two moments for the adapters only (padding aside), none for the frozen base (under ZeRO-3 it shares the shard).
      const state = m.stateBytes! * shards;
      assert.ok(state >= 2 * m.trainableBytes && state < 2 * (m.trainableBytes + 8 * 64 * shards), `${who}: ${m.stateBytes} optimizer state bytes for ${m.trainableBytes} trainable bytes`);
    }
    if (name === 'lora_z3') {
      for (const k of Object.keys(outs[0]!.frozenHeld!)) {
        const held = outs.map((o) => o.frozenHeld![k]!);
        assert.equal(held[0]! + held[1]!, ref.params[k]!.length, `${name}: ${k} held ${held.join(' + ')} of ${ref.params[k]!.length}`);
      }
    }
  }
});
