// Generation with a key/value cache ([Note: kv cache]): the same tokens as recomputing the whole
// context for every token, several prompts of different lengths at once, sampling options, the
// end-of-text stop, and the window sliding past the context.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { getDefaultDtype, noGrad, setDefaultDtype, tensor, tidy } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { Llama } from '../src/models/llama.js';
import { generate } from '../src/inference/generate.js';
import { sampleIndex } from '../src/inference/sample.js';

const cfg = { vocabSize: 61, blockSize: 40, nLayer: 2, nHead: 2, nEmbd: 32, dropout: 0, bias: true, tieEmbeddings: false };
const prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4]];

// A Llama with grouped-query attention (4 query heads over 2 key/value heads) and Llama 3.1's rope scaling.
const llamaCfg = { vocabSize: 61, blockSize: 40, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 64, ropeTheta: 500000, ropeScaling: 'llama3' as const, ropeFactor: 8, ropeLowFreqFactor: 1, ropeHighFreqFactor: 4, ropeOriginalMaxPositions: 16, tieEmbeddings: false, dropout: 0 };
const models = [['gpt', () => new GPT(cfg, { initSeed: 5 })], ['llama', () => new Llama(llamaCfg, { initSeed: 5 })]] as const;

for (const [arch, build] of models) test(`${arch}: decode over the cache gives the logits of a full forward, in float64, for left-padded rows of different lengths`, () => {
  const before = getDefaultDtype();
  setDefaultDtype('float64');
  const model = build();
  try {
    model.eval();
    noGrad(() => tidy(() => {
      const rows = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]];
      const more = [[7, 8], [2, 7]];
      const L = 7;
      const pad = rows.map((r) => L - r.length);
      const cache = model.newCache(2, 20, pad);
      const padded = rows.flatMap((r, i) => [...Array<number>(pad[i]!).fill(0), ...r]);
      const first = model.decode(tensor(Float64Array.from(padded), { shape: [2, L], dtype: 'int64' }), cache);
      const second = model.decode(tensor(Float64Array.from(more.map((m) => m[0]!)), { shape: [2, 1], dtype: 'int64' }), cache);
      const third = model.decode(tensor(Float64Array.from(more.map((m) => m[1]!)), { shape: [2, 1], dtype: 'int64' }), cache);
      for (const [i, r] of rows.entries()) {
        const all = [...r, ...more[i]!];
        const full = model.call(tensor(Float64Array.from(all), { shape: [1, all.length], dtype: 'int64' })) as { logits: ReturnType<typeof tensor> };
        const want = full.logits.select(0, 0); // (T, V)
        const got = [first.select(0, i).narrow(0, pad[i]!, r.length), second.select(0, i), third.select(0, i)];
        const diff = [got[0]!.sub(want.narrow(0, 0, r.length)), got[1]!.sub(want.narrow(0, r.length, 1)), got[2]!.sub(want.narrow(0, r.length + 1, 1))]
          .map((d) => d.abs().max().item());
        assert.ok(diff.every((d) => d < 1e-12), `row ${i}: max |Δlogits| ${diff.join(', ')}`);
      }
      cache.dispose();
    }));
  } finally {
    model.dispose();
    setDefaultDtype(before);
  }
});

for (const [arch, build] of models) test(`${arch}: cached generation equals the uncached path: greedy and sampled, batched and alone, past the context`, () => {
  const model = build();
  try {
    for (const o of [{ temperature: 0 }, { temperature: 0.9, topK: 12, topP: 0.9, seed: 3 }]) {
      const cached = generate(model, prompts, { maxNewTokens: 20, ...o });
      const plain = generate(model, prompts, { maxNewTokens: 20, ...o, cache: false });
      assert.deepEqual(cached, plain, JSON.stringify(o));
      assert.ok(cached.every((r) => r.length === 20));
      // A row's continuation does not depend on the rows beside it (greedy: any row; sampled: row r
      // draws stream r, so row 0 alone draws what it drew in the batch).
      for (const [r, p] of prompts.entries()) {
        if (o.temperature === 0 || r === 0) assert.deepEqual(generate(model, [p], { maxNewTokens: 20, ...o })[0], cached[r], `row ${r} alone`);
      }
    }
    // 35 prompt tokens + 20 new in a context of 40: the last 15 steps slide the window.
    const long = [Array.from({ length: 35 }, (_, i) => (i * 7) % 61)];
    assert.deepEqual(generate(model, long, { maxNewTokens: 20, temperature: 0 }), generate(model, long, { maxNewTokens: 20, temperature: 0, cache: false }));
    // A different seed draws differently.
    assert.notDeepEqual(generate(model, prompts, { maxNewTokens: 20, temperature: 1, seed: 1 }), generate(model, prompts, { maxNewTokens: 20, temperature: 1, seed: 2 }));
  } finally {
    model.dispose();
  }
});

test('a row stops at the end-of-text id; the others go on', () => {
  const model = new GPT(cfg, { initSeed: 11 });
  try {
    const greedy = generate(model, prompts, { maxNewTokens: 10, temperature: 0 });
    const eos = greedy[0]![2]!;
    const stopped = generate(model, prompts, { maxNewTokens: 10, temperature: 0, eosId: eos });
    for (const [r, g] of greedy.entries()) {
      const at = g.indexOf(eos);
      assert.deepEqual(stopped[r], at >= 0 ? g.slice(0, at + 1) : g, `row ${r}`);
    }
  } finally {
    model.dispose();
  }
});

test('sampling: temperature 0 is argmax, top-k and top-p keep only the likeliest tokens, ties go to the lower id', () => {
  const logits = [0, 3, 1, 3, -1];
  assert.equal(sampleIndex(logits, { temperature: 0, topK: 0, topP: 1 }, 0.99), 1);
  const seen = new Set<number>();
  for (let u = 0; u < 1; u += 0.01) seen.add(sampleIndex(logits, { temperature: 1, topK: 2, topP: 1 }, u));
  assert.deepEqual([...seen].sort(), [1, 3]);
  // p(1) = p(3) = e^3 / (2 e^3 + e + 1 + e^-1) ~ 0.46 each: topP 0.5 keeps both, 0.4 keeps the first.
  const nucleus = new Set<number>();
  for (let u = 0; u < 1; u += 0.01) nucleus.add(sampleIndex(logits, { temperature: 1, topK: 0, topP: 0.4 }, u));
  assert.deepEqual([...nucleus], [1]);
});
