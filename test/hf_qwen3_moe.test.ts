// Hugging Face Qwen3MoeForCausalLM directories both ways, as the Llama with model.family = "qwen3" and
// [moe], against an independent PyTorch forward written from the model description
// (test/oracle/hf_mixtral.py, its qwen3_moe branch): Qwen3's q/k norms (and attention biases), a
// router over num_experts renormalised only with norm_topk_prob, experts of moe_intermediate_size in
// the layers (i + 1) % decoder_sparse_step == 0 not in mlp_only_layers (moe.denseLayers) and dense
// MLPs of intermediate_size elsewhere, sliding windows from max_window_layers on. An
// untied head in float32 shards with dense and sparse layers, and a tied head with attention biases in
// bfloat16 with the defaults left out: logits to float64 rounding, greedy tokens with and without the
// key/value cache; what savePretrained writes the reference reads with the same logits, and it loads
// back bit-identically; the directory as train.initFrom gives [model] and [moe].
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setNumThreads } from '../src/tensor/index.js';
import { loadPretrained, savePretrained, readHfDir } from '../src/checkpoint/hf.js';
import { initFromModel } from '../src/config/init_from.js';
import { Llama } from '../src/models/llama.js';
import { MoE } from '../src/nn/moe.js';
import { oracleMissing } from './oracle/oracle.js';
import { assertSameParameters, checkAgainst, hfReference, type HfRef, decodedBothWays, withConfigPatch } from './oracle/hf_oracle.js';

setNumThreads(1);
const skip = oracleMissing();
const root = mkdtempSync(join(tmpdir(), 'flotilla-hf-qwen3-moe-'));
after(() => rmSync(root, { recursive: true, force: true }));

// Layer 1 sparse, layers 0 and 2 dense (decoder_sparse_step 2); head_dim 12, not hidden_size / heads; raw top-k weights.
const QWEN3_MOE = {
  architectures: ['Qwen3MoeForCausalLM'], model_type: 'qwen3_moe', vocab_size: 61, hidden_size: 32, intermediate_size: 40,
  num_hidden_layers: 3, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 12, max_position_embeddings: 48,
  rms_norm_eps: 1e-6, rope_theta: 10000.0, hidden_act: 'silu', tie_word_embeddings: false, attention_bias: false,
  use_sliding_window: false, sliding_window: null, num_experts: 4, num_experts_per_tok: 2, decoder_sparse_step: 2,
  moe_intermediate_size: 12, norm_topk_prob: false, mlp_only_layers: [], output_router_logits: false, router_aux_loss_coef: 0.001,
};
// Defaults left out (head_dim = hidden_size / heads, every layer sparse), a tied head, attention biases, renormalised weights.
const TIED = {
  architectures: ['Qwen3MoeForCausalLM'], model_type: 'qwen3_moe', vocab_size: 61, hidden_size: 24, intermediate_size: 16,
  num_hidden_layers: 1, num_attention_heads: 3, num_key_value_heads: 3, max_position_embeddings: 40, tie_word_embeddings: true,
  attention_bias: true, num_experts: 5, num_experts_per_tok: 3, moe_intermediate_size: 10, norm_topk_prob: true,
};
// Layers 0 and 2 sparse, layer 1 dense by mlp_only_layers (decoder_sparse_step 1); sliding windows of 4
// in layers 1 and 2 (max_window_layers 1).
const DENSE_ONLY = { ...QWEN3_MOE, decoder_sparse_step: 1, mlp_only_layers: [1], use_sliding_window: true, sliding_window: 4, max_window_layers: 1 };
const dirs = { untied: join(root, 'untied-f32-sharded'), tied: join(root, 'tied-bf16'), only: join(root, 'mlp-only-windowed-f32') };
let refs: Record<keyof typeof dirs, HfRef> | undefined;

function made(): Record<keyof typeof dirs, HfRef> {
  if (refs) return refs;
  const [untied, tied, only] = hfReference([
    { mode: 'make', dir: dirs.untied, config: QWEN3_MOE, seed: 31, dtype: 'float32', maxShardBytes: 8_000 },
    { mode: 'make', dir: dirs.tied, config: TIED, seed: 32, dtype: 'bfloat16' },
    { mode: 'make', dir: dirs.only, config: DENSE_ONLY, seed: 33, dtype: 'float32' },
  ], 'hf_mixtral') as [HfRef, HfRef, HfRef];
  refs = { untied, tied, only };
  return refs;
}

test('Qwen3-MoE directories the reference writes load as the Llama (qwen3) with [moe], with its logits to float64 rounding and its greedy tokens, cached or not', { skip }, () => {
  const r = made();
  assert.ok(readdirSync(dirs.untied).filter((f) => /^model-\d{5}-of-\d{5}\.safetensors$/.test(f)).length > 2);
  const { model, config } = loadPretrained(dirs.untied);
  assert.ok(model instanceof Llama);
  const c = config as unknown as Record<string, unknown> & { moe: Record<string, unknown> };
  assert.deepEqual([c.arch, c.family, c.qkNorm, c.attnBias, c.headDim, c.intermediateSize], ['llama', 'qwen3', true, 'none', 12, 40]);
  assert.deepEqual([c.moe.experts, c.moe.topK, c.moe.every, c.moe.hidden, c.moe.normTopK, c.moe.capacityFactor], [4, 2, 2, 12, false, 0]);
  assert.deepEqual(model.namedModules().filter(([, m]) => m instanceof MoE).map(([n]) => n), ['layers.1.mlp']);
  model.dispose();
  checkAgainst(dirs.untied, r.untied);
  checkAgainst(dirs.tied, r.tied);
  checkAgainst(dirs.only, r.only);
  const o = loadPretrained(dirs.only);
  const oc = o.config as unknown as Record<string, unknown> & { moe: Record<string, unknown> };
  assert.deepEqual([oc.moe.every, oc.moe.denseLayers, oc.slidingWindow, oc.windowFrom], [1, [1], 4, 1]);
  assert.deepEqual(o.model.namedModules().filter(([, m]) => m instanceof MoE).map(([n]) => n), ['layers.0.mlp', 'layers.2.mlp']);
  o.model.dispose();
  for (const [k, d] of Object.entries(dirs)) {
    const [cached, plain] = decodedBothWays(d);
    assert.deepEqual(cached, r[k as keyof typeof dirs].greedy, `${k}: cached decoding`);
    assert.deepEqual(plain, r[k as keyof typeof dirs].greedy, `${k}: uncached decoding`);
  }
});

test('savePretrained writes a qwen3 Llama with [moe] as a Qwen3MoeForCausalLM and loads back bit-identically; as train.initFrom it gives [model] and [moe]', { skip }, () => {
  const r = made();
  const a = loadPretrained(dirs.untied);
  const outA = join(root, 'out-untied');
  const wa = savePretrained(a.model, outA, { maxShardSize: 6_000 });
  assert.ok(wa.files.length > 2);
  assert.equal(wa.architecture, 'Qwen3MoeForCausalLM');
  const cfg = JSON.parse(readFileSync(join(outA, 'config.json'), 'utf8')) as Record<string, unknown>;
  assert.deepEqual([cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.decoder_sparse_step, cfg.moe_intermediate_size, cfg.intermediate_size, cfg.norm_topk_prob, cfg.head_dim],
    ['qwen3_moe', 4, 2, 2, 12, 40, false, 12]);
  assert.deepEqual(cfg.mlp_only_layers, []);
  const from = initFromModel(outA)!;
  assert.match(from.what, /Qwen3MoeForCausalLM/);
  assert.deepEqual([from.sections.model!.arch, from.sections.model!.family, from.sections.model!.qkNorm, from.sections.model!.headDim], ['llama', 'qwen3', true, 12]);
  assert.deepEqual([from.sections.moe!.experts, from.sections.moe!.topK, from.sections.moe!.every, from.sections.moe!.hidden, from.sections.moe!.normTopK], [4, 2, 2, 12, false]);
  const stored = [...readHfDir(outA).stored.keys()];
  assert.deepEqual(stored.filter((k) => k.startsWith('model.layers.1.mlp.')).sort(), [
    ...[0, 1, 2, 3].flatMap((j) => ['down_proj', 'gate_proj', 'up_proj'].map((p) => `model.layers.1.mlp.experts.${j}.${p}.weight`)), 'model.layers.1.mlp.gate.weight',
  ]);
  assert.deepEqual(stored.filter((k) => k.startsWith('model.layers.2.mlp.')).sort(), ['down_proj', 'gate_proj', 'up_proj'].map((p) => `model.layers.2.mlp.${p}.weight`));
  assertSameParameters(a.model, loadPretrained(outA).model, 'float32 round trip');

  const b = loadPretrained(dirs.tied, { dtype: 'float64' });
  const outB = join(root, 'out-tied');
  savePretrained(b.model, outB, { dtype: 'bfloat16' });
  assert.deepEqual(readdirSync(outB).sort(), ['config.json', 'model.safetensors']);
  const tiedStored = readHfDir(outB).stored;
  assert.ok(!tiedStored.has('lm_head.weight') && tiedStored.has('model.layers.0.self_attn.o_proj.bias'));
  assertSameParameters(b.model, loadPretrained(outB, { dtype: 'float64' }).model, 'bfloat16 round trip');
  a.model.dispose();
  b.model.dispose();

  const c = loadPretrained(dirs.only);
  const outC = join(root, 'out-only');
  savePretrained(c.model, outC);
  const cfgC = JSON.parse(readFileSync(join(outC, 'config.json'), 'utf8')) as Record<string, unknown>;
  assert.deepEqual([cfgC.mlp_only_layers, cfgC.decoder_sparse_step, cfgC.use_sliding_window, cfgC.sliding_window, cfgC.max_window_layers], [[1], 1, true, 4, 1]);
  assertSameParameters(c.model, loadPretrained(outC).model, 'mlp_only_layers round trip');
  c.model.dispose();

  const [ra, rb, rc] = hfReference([{ mode: 'read', dir: outA }, { mode: 'read', dir: outB }, { mode: 'read', dir: outC }], 'hf_mixtral') as [HfRef, HfRef, HfRef];
  assert.deepEqual(rc.greedy, r.only.greedy);
  checkAgainst(outC, r.only);
  assert.deepEqual(ra.greedy, r.untied.greedy);
  assert.deepEqual(rb.greedy, r.tied.greedy);
  checkAgainst(outA, r.untied);
  checkAgainst(outB, r.tied);
});

test('a Qwen3-MoE flotilla cannot read or write exactly is one error naming the field', { skip }, () => {
  made();
  const cfgPath = join(dirs.tied, 'config.json');
  const withCfg = (patch: Record<string, unknown>, re: RegExp, config = true) => withConfigPatch(cfgPath, patch, () => {
    assert.throws(() => loadPretrained(dirs.tied), re);
    if (config) assert.throws(() => initFromModel(dirs.tied), re); // before any rank starts
  });
  withCfg({ mlp_only_layers: [0] }, /mlp_only_layers = \[0\] leaves no layer with experts/);
  withCfg({ mlp_only_layers: [1] }, /mlp_only_layers = \[1\] is not a list of layer indices from 0 to num_hidden_layers - 1 \(0\)/);
  withCfg({ use_sliding_window: true, sliding_window: 4, max_window_layers: 2 }, /max_window_layers = 2 is above num_hidden_layers = 1; set max_window_layers <= num_hidden_layers/);
  withCfg({ num_experts_per_tok: 6 }, /num_experts_per_tok = 6 is above num_experts = 5/);
  withCfg({ decoder_sparse_step: 2 }, /decoder_sparse_step = 2 is above num_hidden_layers = 1/);
  withCfg({ norm_topk_prob: 'yes' }, /norm_topk_prob = "yes" is not true or false/);
  withCfg({ moe_intermediate_size: 8 }, /model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight' is \[10, 24\], but config\.json implies \[8, 24\]/, false);
  // A Qwen3 model with shared experts has no Hugging Face form: refused before anything is written.
  const m = new Llama({ vocabSize: 61, blockSize: 16, nLayer: 1, nHead: 2, nEmbd: 16, intermediateSize: 8, family: 'qwen3', qkNorm: true, moe: { experts: 2, topK: 1, sharedExperts: 1 } as never });
  try {
    assert.throws(() => savePretrained(m, join(root, 'never')), /no Hugging Face form \(.*Qwen3MoeForCausalLM: its routing needs moe\.sharedExperts = 0/);
    assert.ok(!readdirSync(root).includes('never'));
  } finally {
    m.dispose();
  }
});
