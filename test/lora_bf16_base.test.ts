// LoRA with the frozen base stored in bfloat16 (applyLora's baseDtype, test/fixtures/lora_bf16_rank.ts)
// under dp, ZeRO-1/2/3, ZeRO-3 x bf16-mixed, pp and tp on 2 ranks, HSDP and pp x ZeRO-3 on 4, a GPT and the Mixer user model,
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
import { maxRelDiff } from './helpers/close.js';
import { withFloat64 } from './oracle/check.js';
import { manualSeed, noGrad, randint, setNumThreads, tidy } from '../src/tensor/index.js';
import { applyLora } from '../src/nn/lora.js';
import { defaultMoEConfig } from '../src/nn/moe.js';
import { GPT } from '../src/models/gpt.js';
import { Llama } from '../src/models/llama.js';

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
  { name: 'tp2', layout: { tp: 2 }, ...gpt },
  { name: 'z3_mixed', layout: { zero: 3 }, ...gptMixed },
  { name: 'mixer_dp2', layout: {}, ...mixer },
  { name: 'mixer_z3', layout: { zero: 3 }, ...mixer },
  { name: 'z3_mixed_fp32_base', layout: { zero: 3 }, ...fp32BaseMixed },
]);

// HSDP (2 shards x 2 replicas) and a pipeline of ZeRO-3 stages.
const world4 = suite.launch(4, [
  { name: 'hsdp', layout: { zero: 3, dpReplicate: 2 }, ...gpt },
  { name: 'pp2_z3', layout: { pp: 2, zero: 3 }, ...gpt },
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

test('a bfloat16 LoRA base under dp, ZeRO-1/2/3, pp and tp on 2 ranks equals one process with the same base (fp32 compute): adapters train, the base stays bfloat16, unmoved, at 2 bytes an element', async () => {
  await Promise.all([reference, world2]);
  const ref = suite.read('ref_gpt', 1)[0]!;
  for (const [k, d] of Object.entries(ref.dtypes)) assert.equal(d, isBase(k) ? 'bfloat16' : 'float32', `one process: ${k} is ${d}`);
  assert.deepEqual(ref.frozenMoved, []);
  const adapters = Object.keys(ref.params).filter((k) => !isBase(k));
  assert.equal(adapters.length, 2 * 2 * 4, 'A and B on qkv, attn.proj, mlp.fc and mlp.proj of 2 blocks');
  for (const k of adapters.filter((n) => n.endsWith('loraB.weight'))) assert.ok(ref.params[k]!.some((x) => x !== 0), `${k} trained away from zero`);
  for (const name of ['dp2', 'z1', 'z2', 'z3', 'pp2', 'tp2']) checkBase(name, suite.compare(name, 2, 'ref_gpt', TOL).outs, 'bfloat16');
});

test('the Mixer user model with a bfloat16 LoRA base under dp and ZeRO-3 on 2 ranks equals one process', async () => {
  await Promise.all([reference, world2]);
  for (const name of ['mixer_dp2', 'mixer_z3']) checkBase(name, suite.compare(name, 2, 'ref_mixer', TOL).outs, 'bfloat16');
});

test('ZeRO-3 x bf16-mixed with a frozen base, bfloat16 or float32, on 2 ranks equals one process under bf16-mixed', async () => {
  await Promise.all([reference, world2]);
  checkBase('z3_mixed', suite.compare('z3_mixed', 2, 'ref_gpt_mixed', TOL).outs, 'bfloat16');
  checkBase('z3_mixed_fp32_base', suite.compare('z3_mixed_fp32_base', 2, 'ref_fp32_base_mixed', TOL).outs, 'float32');
  // Under bf16-mixed every unit is gathered in bfloat16: the same bytes whether the base is stored
  // in bfloat16 or float32, and fewer than fp32 compute gathers (its adapters in float32).
  for (const rank of [0, 1]) {
    const bytes = (name: string) => suite.read(name, 2)[rank]!.gatheredBytes!;
    assert.ok(bytes('z3_mixed') > 0, `rank ${rank} gathered nothing`);
    assert.equal(bytes('z3_mixed_fp32_base'), bytes('z3_mixed'), `rank ${rank}: a float32 base is gathered in bfloat16 too`);
    assert.ok(bytes('z3_mixed') < bytes('z3'), `rank ${rank}: bf16-mixed gathered ${bytes('z3_mixed')} B, fp32 compute ${bytes('z3')} B`);
  }
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

// One process, float64: every layer that reads a weight (Embedding, LayerNorm and RMSNorm, the
// Linears, the tied head, the MoE experts and router) widens a bfloat16 base to the compute dtype,
// float64 here: a GPT with tied embeddings and an MoE block, and a Llama (RMSNorm, SwiGLU).
// Widening is exact, so the model equals one whose float64 base holds the same bfloat16 values:
// the loss and every adapter gradient agree to float64 rounding (the frozen Linears' input gradient
// is computed from the bfloat16 weight widened again in backward).
for (const arch of ['gpt', 'llama'] as const) {
  test(`a bfloat16 base computes in the compute dtype (float64) through every layer of a ${arch}: equal to a float64 base of the same values`, () => {
    setNumThreads(1);
    const run = (bf16: boolean): { loss: number; grads: Record<string, number[]>; dtypes: Record<string, string> } => withFloat64(() => tidy(() => {
      const m = arch === 'gpt'
        ? new GPT({ vocabSize: 29, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 12, tieEmbeddings: true, moe: { ...defaultMoEConfig, experts: 4, topK: 2, every: 2 } }, { initSeed: 5 })
        : new Llama({ vocabSize: 29, blockSize: 8, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 16, intermediateSize: 24 }, { initSeed: 5 });
      applyLora(m, { rank: 2, alpha: 4, targets: ['all-linear'], initSeed: 6, ...(bf16 ? { baseDtype: 'bfloat16' as const } : {}) });
      noGrad(() => {
        for (const [n, p] of m.namedParameters()) {
          if (p.requiresGrad) { if (n.endsWith('loraB.weight')) p.normal_(0, 0.3); } // B away from zero: the adapters' gradients depend on the base
          else if (!bf16) p.copy_(p.to('bfloat16'));
        }
      });
      manualSeed(8);
      const x = randint(0, 29, [3, 8]), y = randint(0, 29, [3, 8]);
      const loss = m.call(x, y).loss!;
      loss.backward();
      const grads = Object.fromEntries(m.namedParameters().filter(([, p]) => p.requiresGrad).map(([n, p]) => [n, p.grad!.toNumbers()]));
      const dtypes = Object.fromEntries(m.namedParameters().filter(([, p]) => !p.requiresGrad).map(([n, p]) => [n, p.dtype as string]));
      const out = { loss: loss.item(), grads, dtypes };
      m.dispose();
      return out;
    }));
    const a = run(true), b = run(false);
    assert.deepEqual([...new Set(Object.values(a.dtypes))], ['bfloat16']);
    assert.deepEqual([...new Set(Object.values(b.dtypes))], ['float64']);
    if (arch === 'gpt') assert.ok(Object.keys(a.dtypes).some((k) => k.includes('.experts.')) && Object.keys(a.dtypes).some((k) => k.includes('router')), `the base has MoE experts and a router: ${Object.keys(a.dtypes).join(', ')}`);
    assert.ok(Math.abs(a.loss - b.loss) <= 1e-13 * Math.abs(b.loss), `loss ${a.loss} vs ${b.loss}`);
    assert.deepEqual(Object.keys(a.grads).sort(), Object.keys(b.grads).sort());
    for (const [k, g] of Object.entries(a.grads)) assert.ok(maxRelDiff(g, b.grads[k]!) <= 1e-10, `${k}: ${maxRelDiff(g, b.grads[k]!)}`);
  });
}

test('a bfloat16 LoRA base under HSDP and a pipeline of ZeRO-3 stages on 4 ranks equals one process', async () => {
  await Promise.all([reference, world4]);
  for (const name of ['hsdp', 'pp2_z3']) checkBase(name, suite.compare(name, 4, 'ref_gpt', TOL).outs, 'bfloat16');
});
