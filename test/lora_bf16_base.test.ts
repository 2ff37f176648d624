// LoRA with the frozen base stored in bfloat16 (applyLora's baseDtype, test/fixtures/lora_bf16_rank.ts)
// under dp, ZeRO-1/2/3, ZeRO-3 x bf16-mixed and pp on 2 ranks, a GPT and the Mixer user model,
// against one process with the same bfloat16 base. Under fp32 both sides widen the same bfloat16
// values to float32, so only float32 reduction order separates them; under bf16-mixed the one
// process takes 4 micro-batches of 2 rows, the rows each rank's micro-batch holds, so the bfloat16
// roundings are the same ones and the results agree as closely. On every rank the base stays
// bfloat16 and never moves, and the memory report counts 2 bytes per frozen element it holds and 4
// per adapter element. Also the fp32 base under ZeRO-3 x bf16-mixed (its units gathered in bfloat16),
// and a float32 base checkpoint loaded into the bfloat16 placements under dp and ZeRO-3.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { pool } from './helpers/pool.js';
import { equivalenceSuite } from './helpers/equivalence.js';
import type { Out, Run } from './fixtures/lora_bf16_rank.js';

const suite = equivalenceSuite<Run, Out>('lora-bf16', 'test/fixtures/lora_bf16_rank.ts', { timeoutMs: 240_000, queue: pool() });
const TOL = { loss: 1e-6, norm: 1e-5, param: 1e-5, scaled: true };
const gpt = { model: 'gpt', precision: 'fp32', bf16: true } as const;
const mixer = { model: 'mixer', precision: 'fp32', bf16: true } as const;
const gptMixed = { model: 'gpt', precision: 'bf16-mixed', bf16: true } as const;
const fp32BaseMixed = { model: 'gpt', precision: 'bf16-mixed', roundBase: true } as const;

const reference = suite.launch(1, [
  { name: 'ref_gpt', ...gpt },
  { name: 'ref_mixer', ...mixer },
  { name: 'ref_gpt_mixed', ...gptMixed, micro: 4 },
  { name: 'ref_fp32_base_mixed', ...fp32BaseMixed, micro: 4 },
]);
const world2 = suite.launch(2, [
  { name: 'base', saveBase: 'base_ckpt', ...gpt },
  { name: 'z3_load', layout: { zero: 3 }, loadBase: 'base_ckpt', ...gpt },
  { name: 'dp2_load', layout: {}, loadBase: 'base_ckpt', ...gpt },
  { name: 'dp2', layout: {}, ...gpt },
  { name: 'z1', layout: { zero: 1 }, ...gpt },
  { name: 'z2', layout: { zero: 2 }, ...gpt },
  { name: 'z3', layout: { zero: 3 }, ...gpt },
  { name: 'pp2', layout: { pp: 2 }, ...gpt },
  { name: 'z3_mixed', layout: { zero: 3 }, ...gptMixed },
  { name: 'mixer_dp2', layout: {}, ...mixer },
  { name: 'mixer_z3', layout: { zero: 3 }, ...mixer },
  { name: 'z3_mixed_fp32_base', layout: { zero: 3 }, ...fp32BaseMixed },
]);

const isBase = (k: string): boolean => !/\.lora[AB]\.weight$/.test(k);

/** Every rank's base is in `dtype` and never moved; its memory report counts each held element at its dtype's bytes. */
function checkBase(name: string, outs: Out[], dtype: 'bfloat16' | 'float32'): void {
  for (const o of outs) {
    const who = `${name}: rank ${o.rank}`;
    assert.deepEqual(o.frozenMoved, [], `${who}: the base moved`);
    const base = Object.entries(o.dtypes).filter(([k]) => isBase(k));
    assert.ok(base.length > 0, `${who}: holds no base parameter`);
    for (const [k, d] of Object.entries(o.dtypes)) assert.equal(d, isBase(k) ? dtype : 'float32', `${who}: ${k} is ${d}`);
    assert.equal(o.memory.length, 3, `${who}: a memory report per step`);
    for (const m of o.memory) {
      assert.deepEqual(Object.keys(m.held).sort(), [`frozen:${dtype}`, 'trainable:float32'], `${who}: placements by dtype ${JSON.stringify(m.held)}`);
      const frozen = m.held[`frozen:${dtype}`]!, trained = m.held['trainable:float32']!;
      const want = frozen * (dtype === 'bfloat16' ? 2 : 4) + trained * 4;
      // Buckets are padded to a multiple of the shard count: a few elements each, far less than
      // the 2 bytes per frozen element a float32 base would add.
      assert.ok(m.paramBytes >= want && m.paramBytes <= want + 128, `${who}: ${m.paramBytes} parameter bytes for ${frozen} frozen ${dtype} and ${trained} float32 elements (${want})`);
      assert.ok(m.gradBytes >= 0 && m.gradBytes <= trained * 4 + 128, `${who}: ${m.gradBytes} gradient bytes for ${trained} trainable elements`);
    }
  }
}

test('a bfloat16 LoRA base under dp, ZeRO-1/2/3 and pp on 2 ranks equals one process with the same base (fp32 compute): adapters train, the base stays bfloat16, unmoved, at 2 bytes an element', async () => {
  await Promise.all([reference, world2]);
  const ref = suite.read('ref_gpt', 1)[0]!;
  for (const [k, d] of Object.entries(ref.dtypes)) assert.equal(d, isBase(k) ? 'bfloat16' : 'float32', `one process: ${k} is ${d}`);
  assert.deepEqual(ref.frozenMoved, []);
  const adapters = Object.keys(ref.params).filter((k) => !isBase(k));
  assert.equal(adapters.length, 2 * 2 * 4, 'A and B on qkv, attn.proj, mlp.fc and mlp.proj of 2 blocks');
  for (const k of adapters.filter((n) => n.endsWith('loraB.weight'))) assert.ok(ref.params[k]!.some((x) => x !== 0), `${k} trained away from zero`);
  for (const name of ['dp2', 'z1', 'z2', 'z3', 'pp2']) checkBase(name, suite.compare(name, 2, 'ref_gpt', TOL).outs, 'bfloat16');
});

test('the Mixer user model with a bfloat16 LoRA base under dp and ZeRO-3 on 2 ranks equals one process', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['mixer_dp2', 'mixer_z3']) checkBase(name, suite.compare(name, 2, 'ref_mixer', TOL).outs, 'bfloat16');
});

test('ZeRO-3 x bf16-mixed with a frozen base, bfloat16 or float32, on 2 ranks equals one process under bf16-mixed', async () => {
  await Promise.all([reference, world2]);
  checkBase('z3_mixed', suite.compare('z3_mixed', 2, 'ref_gpt_mixed', TOL).outs, 'bfloat16');
  checkBase('z3_mixed_fp32_base', suite.compare('z3_mixed_fp32_base', 2, 'ref_fp32_base_mixed', TOL).outs, 'float32');
});

test('a float32 base checkpoint loads into the bfloat16 base through the placements under dp and ZeRO-3: every base element is the saved one rounded to bfloat16', async () => {
  await world2;
  const saved = suite.read('base', 2);
  for (const name of ['dp2_load', 'z3_load']) {
    for (const o of suite.read(name, 2)) {
      const who = `${name}: rank ${o.rank}`;
      const base = Object.keys(o.params).filter(isBase);
      assert.equal(base.length, Object.keys(saved[0]!.params).length, `${who}: every base parameter, whole`);
      for (const k of base) {
        assert.equal(o.dtypes[k], 'bfloat16', `${who}: ${k} is ${o.dtypes[k]}`);
        assert.deepEqual(o.params[k], saved[o.rank]!.params[k], `${who}: ${k} is not the saved base rounded to bfloat16`);
      }
    }
  }
});
