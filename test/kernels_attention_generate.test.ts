// Generation through the fused kernel ([Note: kernel choice], [Note: kv cache]): a tiny GPT and a tiny
// Llama (grouped-query heads, a sliding window shorter than the context) decode left-padded prompts of
// different lengths, a prompt chunk then one token at a time, with the same logits in float64 under
// kernels = "fused" as under "eager" (the Llama's rotary through the one-pass kernel too), and
// generate() samples the same tokens with either. The cache builds the padding's document ids once a step.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { getDefaultDtype, manualSeed, setDefaultDtype, tensor, tidy, type Tensor } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { Llama } from '../src/models/llama.js';
import { generate } from '../src/inference/generate.js';
import { withKernels } from '../src/nn/kernels/choice.js';
import { KVCache } from '../src/nn/kv_cache.js';
import { native } from '../src/tensor/native.js';
import { assertClose } from './oracle/check.js';

const V = 40, CTX = 24;
// Prompts of 7 and 3 tokens: the shorter row is left-padded by 4.
const PROMPTS = [[5, 9, 2, 31, 7, 7, 18], [3, 14, 1]];

/** Logits of a prefill of the padded prompts, then of 6 single tokens, each against the cache. */
function decodeLogits(model: GPT | Llama): Tensor[] {
  const width = Math.max(...PROMPTS.map((p) => p.length));
  const pad = PROMPTS.map((p) => width - p.length);
  const cache = model.newCache(PROMPTS.length, CTX, pad);
  try {
    const rows = PROMPTS.map((p, r) => [...Array<number>(pad[r]!).fill(0), ...p]);
    const out = [model.decode(tensor(Float64Array.from(rows.flat()), { shape: [2, width], dtype: 'int64' }), cache)];
    for (let s = 0; s < 6; s++) out.push(model.decode(tensor(Float64Array.from([s + 4, 2 * s + 1]), { shape: [2, 1], dtype: 'int64' }), cache));
    return out;
  } finally {
    cache.dispose();
  }
}

for (const [name, make] of [
  ['GPT', () => new GPT({ vocabSize: V, blockSize: CTX, nLayer: 2, nHead: 2, nEmbd: 16 }, { initSeed: 4 })],
  ['Llama (grouped-query heads, sliding window 5)', () => new Llama({ vocabSize: V, blockSize: CTX, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 48, slidingWindow: 5, ropeScaling: 'none' }, { initSeed: 4 })],
] as const) {
  test(`kernels = "fused" in generation: the ${name} decodes padded prompts with eager's logits (float64) and samples eager's tokens`, () => {
    const prev = getDefaultDtype();
    setDefaultDtype('float64');
    try {
      tidy(() => {
        const model = make();
        model.eval();
        manualSeed(2);
        const eager = decodeLogits(model);
        // Rotary calls of the fused decode (the GPT has none; the Llama rotates q and k in each layer and step).
        let rotations = 0;
        const rotary = native.rotary;
        native.rotary = (...args) => (rotations++, rotary(...args));
        let fused: Tensor[];
        try {
          fused = withKernels('fused', () => decodeLogits(model));
        } finally {
          native.rotary = rotary;
        }
        if (model instanceof Llama) assert.equal(rotations, 2 * 2 * 7, 'the fused decode rotates q and k through the kernel in every layer and step');
        fused.forEach((f, i) => assertClose(f, eager[i]!, { rtol: 1e-10, atol: 1e-12 }, `${i === 0 ? 'prefill' : `decode step ${i}`} logits`));
        // Another path ran: its sums in another order leave float64 rounding differences somewhere.
        assert.ok(fused.some((f, i) => f.sub(eager[i]!).abs().max().item() !== 0), 'the fused kernel computed the attention');
        const opts = { maxNewTokens: 14, temperature: 0.9, topK: 20, seed: 11 };
        const tokens = generate(model, PROMPTS, opts);
        assert.deepEqual(withKernels('fused', () => generate(model, PROMPTS, opts)), tokens);
        model.dispose();
      });
    } finally {
      setDefaultDtype(prev);
    }
  });
}

test('the cache builds its padding\'s document ids once per step: every layer gets the same tensors until advance()', () => {
  tidy(() => {
    const cache = new KVCache(2, 2, 8, [2, 0]);
    try {
      const a = cache.documentIds(3)!, b = cache.documentIds(3)!;
      assert.ok(a.q === b.q && a.k === b.k, 'a second layer rebuilt the ids');
      assert.deepEqual(a.k.toNumbers(), [-1, -2, 0, 0, 0, 0]);
      cache.advance(3);
      const c = cache.documentIds(1)!;
      assert.deepEqual(c.q.shape, [2, 1]);
      assert.deepEqual(c.k.toNumbers(), [-1, -2, 0, 0, 0, 0, 0, 0]);
      const unpadded = new KVCache(1, 2, 8);
      assert.equal(unpadded.documentIds(1), undefined);
      unpadded.dispose();
    } finally {
      cache.dispose();
    }
  });
});
