// LoRA on MoE experts ([Note: LoRA on experts], src/nn/lora_experts.ts): a tiny Llama with [moe]
// (top-2 softmax, normTopK) adapted on its experts' projections by Hugging Face names, in float64.
// Step 0 equals the base exactly; with B moved off zero the adapted forward equals the merged
// weights' (W + scale A^T B^T per expert), and the adapters' gradients are the merged weights'
// gradient projected (dL/dA = s B^T G^T, dL/dB = s G^T A^T per expert, G = dL/dW (in, out)).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { noGrad, randint, setNumThreads, type Tensor } from '../src/tensor/index.js';
import { applyLora, hfModuleNames, mergeLora, unmergeLora } from '../src/nn/lora.js';
import { modelSpec } from '../src/models/registry.js';
import { mixtralHf } from '../src/models/mixtral_hf.js';
import { qwen3MoeHf } from '../src/models/qwen3_moe_hf.js';
import { defaultMoEConfig } from '../src/nn/moe.js';
import type { Llama } from '../src/models/llama.js';
import { withFloat64 } from './oracle/check.js';
import { adapterSlots, wholeModelSlots } from '../src/checkpoint/peft.js';

setNumThreads(1);
const cfg = (family: 'llama' | 'qwen3') => ({
  arch: 'llama', family, qkNorm: family === 'qwen3', attnBias: 'none', vocabSize: 32, blockSize: 8, nLayer: 2, nHead: 2, nKvHead: 2, nEmbd: 8, headDim: 4,
  intermediateSize: 12, rmsNormEps: 1e-5, ropeTheta: 10000, ropeScaling: 'none', tieEmbeddings: false, dropout: 0,
  moe: { ...defaultMoEConfig, experts: 4, topK: 2, normTopK: true, router: 'softmax', balance: 'aux', auxCoeff: 0 },
});
const maxDiff = (a: Tensor, b: Tensor) => (a.sub(b).abs().max().item() as number);

test('LoRA on Mixtral experts (w1, w2, w3): step 0 is the base exactly, the forward and adapter gradients equal the merged weights\'', () => withFloat64(() => {
  const spec = modelSpec('llama');
  const c = cfg('llama');
  const model = spec.build(c as never, { initSeed: 7 }) as Llama;
  const x = randint(0, 32, [2, 8]), y = randint(0, 32, [2, 8]);
  const base = noGrad(() => model.call(x).logits);
  const applied = applyLora(model, { rank: 2, alpha: 4, targets: ['w1', 'w2', 'w3'], initSeed: 3, hfNames: hfModuleNames(mixtralHf.tensors(c as never)) });
  assert.deepEqual([...applied.expertAdapters.keys()].sort(), ['layers.0.mlp.experts.down', 'layers.0.mlp.experts.gate', 'layers.0.mlp.experts.up', 'layers.1.mlp.experts.down', 'layers.1.mlp.experts.gate', 'layers.1.mlp.experts.up']);
  assert.equal(applied.adapters.size, 0);
  assert.deepEqual(applied.trainable.sort(), [...applied.expertAdapters.keys()].flatMap((k) => [`${k}Lora.loraA`, `${k}Lora.loraB`]).sort());
  const gate = applied.expertAdapters.get('layers.0.mlp.experts.gate')!;
  assert.deepEqual(gate.loraA.shape, [4, 2, 8]);
  assert.deepEqual(gate.loraB.shape, [4, 12, 2]);
  assert.equal(maxDiff(noGrad(() => model.call(x).logits), base), 0, 'step 0 is not the base');

  // B off zero: the adapters now change the output.
  noGrad(() => { for (const a of applied.expertAdapters.values()) a.loraB.normal_(0, 0.5); });
  const loss = spec.loss(model.call(x).logits, y);
  loss.backward();
  const adapted = noGrad(() => model.call(x).logits);
  assert.ok(maxDiff(adapted, base) > 1e-3, 'the expert adapters do not change the output');

  // The merged weights: the same output; W's gradient projected is the adapters'.
  mergeLora(model);
  for (const a of applied.expertAdapters.values()) a.base.requiresGrad = true;
  assert.ok(maxDiff(noGrad(() => model.call(x).logits), adapted) < 1e-12);
  const mergedLoss = spec.loss(model.call(x).logits, y);
  assert.ok(Math.abs((mergedLoss.item() as number) - (loss.item() as number)) < 1e-12);
  mergedLoss.backward();
  for (const [path, a] of applied.expertAdapters) {
    const G = a.base.grad!, s = a.opts.scale; // (E, in, out)
    const dA = a.loraB.transpose(1, 2).bmm(G.transpose(1, 2)).mul(s);
    const dB = G.transpose(1, 2).bmm(a.loraA.transpose(1, 2)).mul(s);
    assert.ok(maxDiff(a.loraA.grad!, dA) < 1e-12, `${path}: dL/dA`);
    assert.ok(maxDiff(a.loraB.grad!, dB) < 1e-12, `${path}: dL/dB`);
    assert.ok((a.loraA.grad!.abs().max().item() as number) > 1e-6, `${path}: A's gradient is zero`);
  }
  unmergeLora(model);
}));

test('LoRA targets on Qwen3-MoE experts: gate_proj reaches the dense MLPs and the experts; all-linear leaves the experts alone', () => withFloat64(() => {
  const spec = modelSpec('llama');
  const c = { ...cfg('qwen3'), moe: { ...cfg('qwen3').moe, every: 2 } };
  const hf = hfModuleNames(qwen3MoeHf.tensors(c as never));
  const model = spec.build(c as never, { initSeed: 7 });
  const a = applyLora(model, { rank: 2, targets: ['gate_proj'], initSeed: 3, hfNames: hf });
  assert.deepEqual([...a.adapters.keys()], ['layers.0.mlp.gate']);
  assert.deepEqual([...a.expertAdapters.keys()], ['layers.1.mlp.experts.gate']);
  const linears = spec.linears!(c as never);
  assert.ok(linears.some((l) => l.path === 'layers.1.mlp.experts.gate' && l.hf === 'model.layers.1.mlp.experts.gate_proj' && l.experts === 4));
  const other = spec.build(c as never, { initSeed: 7 });
  const b = applyLora(other, { rank: 2, targets: ['all-linear'], hfNames: hf });
  assert.equal(b.expertAdapters.size, 0);
  assert.throws(() => applyLora(spec.build(c as never, { initSeed: 7 }), { rank: 20, targets: ['down_proj'], hfNames: hf }), /rank 20 is larger/);
  // PEFT slots of the expert adapters, from the model and from the config alike: one stack of 4 experts' Linears.
  const expertSlot = { path: 'layers.1.mlp.experts.gate', hf: 'model.layers.1.mlp.experts.gate_proj', rank: 2, inFeatures: 8, outFeatures: 12, transposed: false, experts: 4 };
  assert.deepEqual(adapterSlots(model, spec, c as never).find((s) => s.experts !== undefined), expertSlot);
  assert.deepEqual(wholeModelSlots(c as never, ['gate_proj'], 2).find((s) => s.experts !== undefined), expertSlot);
  assert.equal(wholeModelSlots(c as never, ['q_proj'], 2).length, 2);
}));

// ep = 2 on 2 ranks against one process (test/fixtures/lora_layouts_rank.ts, float64): an MoE GPT
// with adapters on its experts' fc and proj (and the shared expert's), 2 AdamW steps.
import { equivalenceSuite } from './helpers/equivalence.js';
import { pool } from './helpers/pool.js';
import type { Out, Run } from './fixtures/lora_layouts_rank.js';

const suite = equivalenceSuite<Run, Out>('lora-moe', 'test/fixtures/lora_layouts_rank.ts', { timeoutMs: 300_000, queue: pool() });
const EXPERTS = { rank: 2, alpha: 4, targets: ['fc', 'proj'] };
const MOE = { topK: 2, router: 'softmax', balance: 'aux', sharedExperts: 1 } as const;
// A Mixtral-style Llama with adapters on attention and on its experts by Mixtral's names: ZeRO-3
// (deferred init), pp = 2 and a bfloat16 base (applyLora's baseDtype) under ZeRO-3, in the same launches.
const MIXTRAL = { model: 'mixtral' as const, steps: 2, lora: { rank: 2, alpha: 4, targets: ['q_proj', 'w1', 'w2', 'w3'] } };
const ref = suite.launch(1, [
  { name: 'ref', micro: 4, steps: 2, lora: EXPERTS, moe: MOE },
  { name: 'ref_mixtral', micro: 4, ...MIXTRAL },
  { name: 'ref_mixtral_bf16', micro: 4, baseDtype: 'bfloat16', ...MIXTRAL },
]);
const ep2 = suite.launch(2, [
  { name: 'ep2', layout: { ep: 2 }, micro: 2, steps: 2, lora: EXPERTS, moe: MOE },
  { name: 'mixtral_z3', layout: { zero: 3 }, micro: 2, ...MIXTRAL },
  { name: 'mixtral_pp2', layout: { pp: 2 }, micro: 4, ...MIXTRAL },
  { name: 'mixtral_bf16_z3', layout: { zero: 3 }, micro: 2, baseDtype: 'bfloat16', ...MIXTRAL },
]);

test('LoRA on experts under ep = 2 equals one process: losses and adapter values after 2 steps (float64)', async () => {
  await Promise.all([ref, ep2]);
  // Every parameter whole (the experts' adapters gathered over ep), losses and norms before clipping.
  const { ref: r } = suite.compare('ep2', 2, 'ref', { loss: 1e-12, norm: 1e-11, param: 1e-10 });
  assert.ok(r.trainable.some((k) => /\.mlp\.experts\.fcLora\.loraA$/.test(k)), r.trainable.join(', ')); // 'proj' also names attn.proj
  assert.ok(r.params[r.trainable.find((k) => k.endsWith('fcLora.loraB'))!]!.some((v) => v !== 0), 'B did not train');
});

test('LoRA on a Mixtral\'s experts (w1, w2, w3) and attention under ZeRO-3 (deferred init), pp = 2 and a bfloat16 base equals one process', async () => {
  await Promise.all([ref, ep2]);
  for (const name of ['mixtral_z3', 'mixtral_pp2']) {
    const { ref: r } = suite.compare(name, 2, 'ref_mixtral', { loss: 1e-12, norm: 1e-11, param: 1e-10 });
    assert.ok(r.trainable.includes('layers.3.mlp.experts.downLora.loraA') && r.trainable.includes('layers.0.attn.q.loraB.weight'), r.trainable.join(', '));
    assert.ok(r.params['layers.2.mlp.experts.gateLora.loraB']!.some((v) => v !== 0), 'B did not train');
  }
  // The bfloat16 base in float32 on both sides: float32 reduction order alone separates them.
  const { ref: b } = suite.compare('mixtral_bf16_z3', 2, 'ref_mixtral_bf16', { loss: 1e-6, norm: 1e-5, param: 1e-5, scaled: true });
  assert.ok(b.params['layers.1.mlp.experts.upLora.loraB']!.some((v) => v !== 0), 'B did not train (bf16 base)');
  // The base is stored in bfloat16 there: its rounding moves the loss by far more than float32 noise.
  const moved = Math.abs(b.losses[0]! - suite.read('ref_mixtral', 1)[0]!.losses[0]!);
  assert.ok(moved > 1e-5, `the bfloat16 base left the loss within ${moved} of the float32 base's`);
});
