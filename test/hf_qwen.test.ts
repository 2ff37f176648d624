// Hugging Face Qwen2ForCausalLM (Qwen2/2.5: biases on q, k, v) and Qwen3ForCausalLM (per-head q/k
// RMSNorms before rotary; attention_bias = biases on q, k, v and o) directories both ways, as the
// Llama with options, against the independent float64 forwards of test/oracle/hf_reference.py:
// logits to float64 rounding and 20 greedy tokens (recomputed and over the key/value cache) agree;
// what savePretrained writes the reference reads strictly as the family's own class and it loads
// back bit-identically; tied and untied heads, bfloat16 files, a sharded directory, sliding windows
// from layer max_window_layers on (use_sliding_window). A config.json
// field flotilla cannot honour is one error naming it.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setNumThreads } from '../src/tensor/index.js';
import { loadPretrained, savePretrained, readHfDir } from '../src/checkpoint/hf.js';
import { Llama, resolveLlamaConfig } from '../src/models/llama.js';
import { llamaRules } from '../src/models/llama_rules.js';
import { generate } from '../src/inference/generate.js';
import { oracleMissing } from './oracle/oracle.js';
import { assertSameParameters, checkAgainst, hfReference, HF_PROMPT, GREEDY, type HfRef, withConfigPatch } from './oracle/hf_oracle.js';

setNumThreads(1);
const skip = oracleMissing();
const root = mkdtempSync(join(tmpdir(), 'flotilla-hf-qwen-'));
after(() => rmSync(root, { recursive: true, force: true }));

// Qwen2.5 style: grouped-query attention, untied head, sliding-window fields present but off.
const QWEN2 = {
  architectures: ['Qwen2ForCausalLM'], model_type: 'qwen2', vocab_size: 61, hidden_size: 32, intermediate_size: 48,
  num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 48, rms_norm_eps: 1e-6,
  rope_theta: 1000000.0, hidden_act: 'silu', tie_word_embeddings: false, use_sliding_window: false, sliding_window: 32, max_window_layers: 2,
};
// Qwen3 style: head_dim not hidden_size / heads, tied head (Qwen3-0.6B), no attention biases.
const QWEN3 = {
  architectures: ['Qwen3ForCausalLM'], model_type: 'qwen3', vocab_size: 61, hidden_size: 24, intermediate_size: 40,
  num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, max_position_embeddings: 40,
  rms_norm_eps: 1e-6, rope_theta: 1000000.0, tie_word_embeddings: true, attention_bias: false, use_sliding_window: false,
};
// Qwen3 with attention_bias (q, k, v and o) and an untied head.
const QWEN3_BIAS = { ...QWEN3, attention_bias: true, tie_word_embeddings: false, num_key_value_heads: 4 };
// Qwen2 with sliding windows of 4 in layers 1 and 2 (max_window_layers = 1), full attention in layer 0.
const QWEN2_WINDOWED = { ...QWEN2, num_hidden_layers: 3, use_sliding_window: true, sliding_window: 4, max_window_layers: 1 };

const dirs = { q2: join(root, 'qwen2-f32-sharded'), q3: join(root, 'qwen3-tied-bf16'), q3b: join(root, 'qwen3-bias-f32'), q2w: join(root, 'qwen2-windowed-f32') };
let refs: Record<keyof typeof dirs, HfRef> | undefined;

function made(): Record<keyof typeof dirs, HfRef> {
  if (refs) return refs;
  const [q2, q3, q3b, q2w] = hfReference([
    { mode: 'make', dir: dirs.q2, config: QWEN2, seed: 21, dtype: 'float32', maxShardBytes: 20_000 },
    { mode: 'make', dir: dirs.q3, config: QWEN3, seed: 22, dtype: 'bfloat16' },
    { mode: 'make', dir: dirs.q3b, config: QWEN3_BIAS, seed: 23, dtype: 'float32' },
    { mode: 'make', dir: dirs.q2w, config: QWEN2_WINDOWED, seed: 24, dtype: 'float32' },
  ]) as [HfRef, HfRef, HfRef, HfRef];
  refs = { q2, q3, q3b, q2w };
  return refs;
}

test('Qwen2 and Qwen3 directories the reference writes load with its logits to float64 rounding and its greedy tokens, with and without the cache', { skip }, () => {
  const r = made();
  assert.ok(readdirSync(dirs.q2).filter((f) => /^model-\d{5}-of-\d{5}\.safetensors$/.test(f)).length > 2);
  assert.ok(readHfDir(dirs.q2).stored.has('model.layers.0.self_attn.q_proj.bias'));
  assert.ok(!readHfDir(dirs.q3).stored.has('lm_head.weight'));
  assert.ok(readHfDir(dirs.q3).stored.has('model.layers.1.self_attn.k_norm.weight'));
  const seen: [string, unknown][] = [];
  for (const d of [dirs.q2, dirs.q3, dirs.q3b, dirs.q2w]) {
    const { model, config } = loadPretrained(d, { dtype: 'float64' });
    assert.ok(model instanceof Llama);
    seen.push([config.family, [config.attnBias, config.qkNorm, config.headDim, config.tieEmbeddings, config.ropeTheta, config.slidingWindow, config.windowFrom]]);
    // The cached path (keys stored after the q/k norms and rotation) gives the recomputed tokens.
    const cached = generate(model, [HF_PROMPT], { maxNewTokens: GREEDY, temperature: 0 })[0];
    assert.deepEqual(cached, generate(model, [HF_PROMPT], { maxNewTokens: GREEDY, temperature: 0, cache: false })[0], `${d}: cached generation`);
    const key = (Object.keys(dirs) as (keyof typeof dirs)[]).find((k) => dirs[k] === d)!;
    assert.deepEqual(cached, r[key].greedy, `${d}: cached greedy vs the reference`);
    model.dispose();
  }
  assert.deepEqual(seen, [
    ['qwen2', ['qkv', false, 8, false, 1e6, 0, 0]],
    ['qwen3', ['none', true, 16, true, 1e6, 0, 0]],
    ['qwen3', ['all', true, 16, false, 1e6, 0, 0]],
    ['qwen2', ['qkv', false, 8, false, 1e6, 4, 1]],
  ]);
  checkAgainst(dirs.q2, r.q2);
  checkAgainst(dirs.q3, r.q3);
  checkAgainst(dirs.q3b, r.q3b);
  checkAgainst(dirs.q2w, r.q2w);
});

test('savePretrained writes Qwen2 and Qwen3 as their own classes (tied head not stored) and they load back bit-identically', { skip }, () => {
  const r = made();
  const outs: string[] = [];
  for (const [key, d, opts] of [['q2', dirs.q2, { maxShardSize: 30_000 }], ['q3', dirs.q3, { dtype: 'bfloat16' }], ['q3b', dirs.q3b, {}], ['q2w', dirs.q2w, {}]] as const) {
    const a = loadPretrained(d, { dtype: key === 'q3' ? 'float64' : 'float32' });
    const out = join(root, `out-${key}`);
    const w = savePretrained(a.model, out, opts);
    const cfg = JSON.parse(readFileSync(join(out, 'config.json'), 'utf8')) as Record<string, unknown>;
    const src = key === 'q2' ? QWEN2 : key === 'q3' ? QWEN3 : key === 'q3b' ? QWEN3_BIAS : QWEN2_WINDOWED;
    assert.deepEqual([cfg.architectures, cfg.model_type, w.architecture, cfg.use_sliding_window], [src.architectures, src.model_type, src.architectures[0], src.use_sliding_window]);
    if (key === 'q2w') assert.deepEqual([cfg.sliding_window, cfg.max_window_layers], [4, 1]);
    if (key === 'q3' || key === 'q3b') assert.equal(cfg.attention_bias, (src as typeof QWEN3).attention_bias);
    if (key === 'q2') assert.ok(w.files.length > 1);
    assertSameParameters(a.model, loadPretrained(out, { dtype: key === 'q3' ? 'float64' : 'float32' }).model, `${key} round trip`);
    a.model.dispose();
    outs.push(out);
  }
  const back = hfReference(outs.map((dir) => ({ mode: 'read' as const, dir })));
  assert.deepEqual(back.map((b) => b.greedy), [r.q2.greedy, r.q3.greedy, r.q3b.greedy, r.q2w.greedy]);
  checkAgainst(outs[0]!, r.q2);
  checkAgainst(outs[1]!, r.q3);
  checkAgainst(outs[2]!, r.q3b);
  checkAgainst(outs[3]!, r.q2w);
});

test('a Qwen config.json flotilla cannot read exactly is one error naming the field', { skip }, () => {
  made();
  for (const [d, name] of [[dirs.q2, 'Qwen2'], [dirs.q3b, 'Qwen3']] as const) {
    const cfgPath = join(d, 'config.json');
    const good = readFileSync(cfgPath, 'utf8');
    const withCfg = (patch: Record<string, unknown>, re: RegExp) => withConfigPatch(cfgPath, patch, () => assert.throws(() => loadPretrained(d), re));
    withCfg({ use_sliding_window: true, sliding_window: 4, max_window_layers: 3 }, /config\.json: max_window_layers = 3 is above num_hidden_layers = 2; set max_window_layers <= num_hidden_layers/);
    withCfg({ use_sliding_window: true, sliding_window: 4, layer_types: ['sliding_attention', 'full_attention'] }, /layer_types = .* is not supported; flotilla reads 2 layers of "full_attention" below max_window_layers and "sliding_attention" from it/);
    withCfg({ use_sliding_window: 'yes' }, /use_sliding_window = "yes" is not true or false/);
    withCfg({ hidden_act: 'gelu' }, /hidden_act = "gelu" is not supported/);
    withCfg({ rope_scaling: { rope_type: 'yarn', factor: 4 } }, /rope_scaling\.rope_type = "yarn" is not supported/);
    withCfg({ architectures: ['LlamaForCausalLM'] }, new RegExp(`architectures = \\["LlamaForCausalLM"\\] is not supported; for model_type "${name.toLowerCase()}" flotilla reads ${name}ForCausalLM`));
  }
  // The biases the config implies are the ones stored: Qwen3 without attention_bias has none.
  const cfgPath = join(dirs.q3b, 'config.json');
  const good = readFileSync(cfgPath, 'utf8');
  writeFileSync(cfgPath, JSON.stringify({ ...JSON.parse(good), attention_bias: false }));
  try {
    assert.throws(() => loadPretrained(dirs.q3b), /holds tensor 'model\.layers\.0\.self_attn\.(q|k|v|o)_proj\.bias', which a .* with this config\.json does not have/);
  } finally {
    writeFileSync(cfgPath, good);
  }
  // A model whose options its family cannot express is refused on export, naming the fields.
  const m = new Llama({ vocabSize: 61, blockSize: 8, nLayer: 1, nHead: 2, nEmbd: 8, family: 'qwen3', attnBias: 'qkv', qkNorm: true });
  assert.throws(() => savePretrained(m, join(root, 'never')), /model\.family = "qwen3" \(Qwen3ForCausalLM\) has q\/k norms .* set model\.qkNorm = true and model\.attnBias = "none" or "all"/);
  m.dispose();
  // And a Llama with Qwen's options would lose them as a LlamaForCausalLM: refused, not dropped.
  const l = new Llama({ vocabSize: 61, blockSize: 8, nLayer: 1, nHead: 2, nEmbd: 8, attnBias: 'qkv' });
  assert.throws(() => savePretrained(l, join(root, 'never')), /model\.family = "llama" \(LlamaForCausalLM\) has no attention biases and no q\/k norms: set model\.attnBias = "none" .* or model\.family = "qwen2" or "qwen3"/);
  l.dispose();
  assert.throws(() => new Llama({ vocabSize: 61, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 8, family: 'qwen2', attnBias: 'qkv', slidingWindow: 4, windowFrom: 3 }), /windowFrom must be a whole number from 0 to nLayer \(2\), got 3/);
  // The config's validation finds the same before any rank starts.
  assert.deepEqual(llamaRules.shapeProblems({ ...resolveLlamaConfig({}), family: 'qwen2' }, { seqLen: 8, pp: 1, ppVirtualStages: 1, tp: 1, sequenceParallel: false }),
    ['model.family = "qwen2" (Qwen2ForCausalLM) has biases on q, k and v and no q/k norms: set model.attnBias = "qkv" and model.qkNorm = false (got model.attnBias = "none", model.qkNorm = false)']);
});
