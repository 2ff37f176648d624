// Hugging Face MistralForCausalLM directories both ways, against an independent float64 PyTorch
// Mistral written from the model description (test/oracle/hf_reference.py): the Llama with a
// sliding attention window (query i reads key j when i - j < sliding_window), here a window of 4
// over sequences of 13 and generation running 20 tokens past it. Logits equal the reference's to
// float64 rounding, greedy tokens agree (recomputed, and from the key/value cache, padded rows
// included); sliding_window null is full causal attention; what savePretrained writes is a Mistral
// the reference reads strictly, and it loads back bit-identically.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setNumThreads, noGrad } from '../src/tensor/index.js';
import { loadPretrained, savePretrained } from '../src/checkpoint/hf.js';
import { Llama, type LlamaConfig } from '../src/models/llama.js';
import { defaultLlamaConfig } from '../src/models/llama_config.js';
import { llamaRules } from '../src/models/llama_rules.js';
import type { ShapeContext } from '../src/models/spec.js';
import { generate } from '../src/inference/generate.js';
import { oracleMissing } from './oracle/oracle.js';
import { scaledErr } from './oracle/check.js';
import { assertSameParameters, checkAgainst, hfReference, GREEDY, HF_PROMPT, type HfRef, withConfigPatch } from './oracle/hf_oracle.js';

setNumThreads(1);
const skip = oracleMissing();
const root = mkdtempSync(join(tmpdir(), 'flotilla-hf-mistral-'));
after(() => rmSync(root, { recursive: true, force: true }));

const WINDOWED = {
  architectures: ['MistralForCausalLM'], model_type: 'mistral', vocab_size: 61, hidden_size: 32, intermediate_size: 48,
  num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 48,
  rms_norm_eps: 1e-5, rope_theta: 10000.0, hidden_act: 'silu', tie_word_embeddings: false, sliding_window: 4,
};
// The same shapes and weights with sliding_window null (full causal attention).
const FULL = { ...WINDOWED, sliding_window: null };
// Mistral's defaults: num_key_value_heads absent is 8, sliding_window absent is 4096 (beyond these sequences).
const DEFAULTS = {
  architectures: ['MistralForCausalLM'], model_type: 'mistral', vocab_size: 61, hidden_size: 32, intermediate_size: 40,
  num_hidden_layers: 1, num_attention_heads: 8, max_position_embeddings: 40,
};
const dirs = { windowed: join(root, 'windowed'), full: join(root, 'full'), defaults: join(root, 'defaults') };
let refs: Record<keyof typeof dirs, HfRef> | undefined;

function made(): Record<keyof typeof dirs, HfRef> {
  if (refs) return refs;
  const [windowed, full, defaults] = hfReference([
    { mode: 'make', dir: dirs.windowed, config: WINDOWED, seed: 21, dtype: 'float32' },
    { mode: 'make', dir: dirs.full, config: FULL, seed: 21, dtype: 'float32' },
    { mode: 'make', dir: dirs.defaults, config: DEFAULTS, seed: 22, dtype: 'bfloat16' },
  ]) as [HfRef, HfRef, HfRef];
  refs = { windowed, full, defaults };
  return refs;
}

test('Mistral directories load with the reference\'s logits to float64 rounding and its 20 greedy tokens (window 4 < 13 tokens; null = full causal)', { skip }, () => {
  const r = made();
  // The window changes the model: the same weights without it give other logits.
  assert.ok(scaledErr(r.windowed.logits, r.full.logits) > 1e-3, 'the window made no difference to the reference');
  const w = loadPretrained(dirs.windowed), f = loadPretrained(dirs.full), d = loadPretrained(dirs.defaults);
  assert.ok(w.model instanceof Llama);
  assert.deepEqual([w.config.arch, w.config.family, w.config.slidingWindow, w.config.nKvHead, f.config.slidingWindow], ['llama', 'mistral', 4, 2, 0]);
  assert.deepEqual([d.config.nKvHead, d.config.slidingWindow, d.config.rmsNormEps], [8, 4096, 1e-6]);
  for (const m of [w, f, d]) m.model.dispose();
  checkAgainst(dirs.windowed, r.windowed);
  checkAgainst(dirs.full, r.full);
  checkAgainst(dirs.defaults, r.defaults);
});

test('Mistral generation from the key/value cache equals recomputing the whole context, past the window, padded rows too', { skip }, () => {
  const r = made();
  const { model } = loadPretrained(dirs.windowed, { dtype: 'float64' });
  try {
    const lm = model as Llama;
    const prompts = [HF_PROMPT, [9, 4, 33, 12, 50, 7, 21, 2], [40]];
    const opts = { maxNewTokens: GREEDY, temperature: 0 };
    const cached = noGrad(() => generate(lm, prompts, { ...opts, cache: true }));
    const whole = noGrad(() => generate(lm, prompts, { ...opts, cache: false }));
    assert.deepEqual(cached, whole);
    assert.deepEqual(cached[0], r.windowed.greedy);
    // Each row alone (no padding) as in the batch.
    for (const [i, p] of prompts.entries()) assert.deepEqual(noGrad(() => generate(lm, [p], { ...opts, cache: true }))[0], cached[i], `prompt ${i} alone`);
  } finally {
    model.dispose();
  }
});

test('savePretrained writes model.family = "mistral" as MistralForCausalLM (sliding_window, or null); it loads back bit-identically and the reference reads it', { skip }, () => {
  const r = made();
  const a = loadPretrained(dirs.windowed);
  const out = join(root, 'out-windowed');
  assert.equal(savePretrained(a.model, out).architecture, 'MistralForCausalLM');
  const cfg = JSON.parse(readFileSync(join(out, 'config.json'), 'utf8')) as Record<string, unknown>;
  assert.deepEqual([cfg.architectures, cfg.model_type, cfg.sliding_window, cfg.num_key_value_heads], [['MistralForCausalLM'], 'mistral', 4, 2]);
  assertSameParameters(a.model, loadPretrained(out).model, 'float32 round trip');
  a.model.dispose();
  // Without a window it is still a Mistral (sliding_window null).
  const f = loadPretrained(dirs.full);
  const outFull = join(root, 'out-full');
  assert.equal(savePretrained(f.model, outFull).architecture, 'MistralForCausalLM');
  assert.equal((JSON.parse(readFileSync(join(outFull, 'config.json'), 'utf8')) as Record<string, unknown>).sliding_window, null);
  f.model.dispose();
  const [back] = hfReference([{ mode: 'read', dir: out }]) as [HfRef];
  assert.equal(scaledErr(back.logits, r.windowed.logits), 0);
  assert.deepEqual(back.greedy, r.windowed.greedy);
  checkAgainst(out, r.windowed);
});

test('a Mistral config.json flotilla cannot read is one error naming the field', { skip }, () => {
  made();
  const cfgPath = join(dirs.defaults, 'config.json');
  const withCfg = (patch: Record<string, unknown>, re: RegExp) => withConfigPatch(cfgPath, patch, () => assert.throws(() => loadPretrained(dirs.defaults), re));
  withCfg({ sliding_window: 0 }, /sliding_window = 0 is not a positive integer or null/);
  withCfg({ architectures: ['LlamaForCausalLM'] }, /for model_type "mistral" flotilla reads MistralForCausalLM/);
  withCfg({ num_key_value_heads: 3 }, /num_key_value_heads = 3 does not divide num_attention_heads = 8/);
});

test('model.slidingWindow must be a whole number >= 0; a windowed model MistralForCausalLM cannot describe is refused before anything is written', () => {
  assert.throws(() => new Llama({ slidingWindow: -1 }), /slidingWindow must be a whole number >= 0/);
  assert.throws(() => new Llama({ slidingWindow: 2.5 }), /slidingWindow must be a whole number >= 0/);
  const small = { vocabSize: 16, blockSize: 16, nLayer: 1, nHead: 2, nEmbd: 8, slidingWindow: 4 };
  const refused: [Partial<LlamaConfig>, RegExp][] = [
    [{ ...small, family: 'mistral', ropeScaling: 'llama3' }, /MistralForCausalLM has no rope_scaling.*set model\.ropeScaling = "none"/],
    [{ ...small, family: 'llama' }, /model\.family = "llama" has no sliding window: set model\.family = "mistral"/],
    [{ ...small, nLayer: 2, family: 'mistral', windowFrom: 1 }, /model\.family = "mistral" windows every layer \(sliding_window\): set model\.windowFrom = 0, or model\.family = "qwen2" or "qwen3"/],
  ];
  for (const [cfg, re] of refused) {
    const m = new Llama(cfg);
    const out = join(root, 'refused');
    try {
      assert.throws(() => savePretrained(m, out), re);
      assert.ok(!existsSync(out), 'nothing is written');
    } finally {
      m.dispose();
    }
  }
  // The config's rules say so before any rank starts.
  assert.match(llamaRules.shapeProblems({ ...defaultLlamaConfig, slidingWindow: 4 }, { seqLen: 8, pp: 1, ppVirtualStages: 1, tp: 1, sequenceParallel: false } satisfies ShapeContext).join('\n'), /set model\.family = "mistral"/);
});
