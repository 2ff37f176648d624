// The shard-backed loader: windows read by byte range equal the files' tokens and never cross a
// shard, data-parallel ranks (dp = 2, HSDP 2 x 2) partition the global batch over unequal shards,
// a resume under another data-parallel degree continues exactly, the prefetch worker reads the same
// batches, blending realises its weights, and nanoGPT .bin files are read directly.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { prepare } from '../src/data/prepare.js';
import { openFlatBin, openPrepared, readManifest } from '../src/data/prepared.js';
import { TokenCorpus } from '../src/data/corpus_files.js';
import { DataLoader } from '../src/data/loader.js';
import { blendedSource } from '../src/data/sampler.js';
import { loadTrainData } from '../src/data/sources.js';
import { tidy } from '../src/tensor/index.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-shards-'));
const T = 16;

// Three text files of unequal sizes, one shard each (byte tokens: every window is checkable).
const sizes = [5_000, 13_000, 1_500];
const files = sizes.map((n, i) => {
  const p = join(dir, `f${i}.txt`);
  writeFileSync(p, Array.from({ length: n }, (_, j) => String.fromCharCode(97 + ((j * (i + 3) + i) % 26))).join(''));
  return p;
});
const out = join(dir, 'ds');
await prepare({ sources: files, tokenizer: 'byte', out, workers: 0, shardMb: 0.0001, print: () => {}, progress: false });
const manifest = readManifest(out);
const shardTokens = manifest.shards.map((s) => {
  const b = readFileSync(join(out, s.bin));
  return Array.from(new Uint16Array(b.buffer, b.byteOffset, b.byteLength / 2));
});
const corpus = () => new TokenCorpus(openPrepared(out).segments, { name: out, vocabSize: 256 });

function rows(t: { toNumbers(): number[]; shape: number[] }): number[][] {
  const [B, L] = t.shape as [number, number];
  const flat = t.toNumbers();
  return Array.from({ length: B }, (_, b) => flat.slice(b * L, (b + 1) * L));
}

test('prepared shards have unequal sizes and every window is a run of one shard', () => {
  assert.equal(manifest.shards.length, 3);
  assert.deepEqual(manifest.shards.map((s) => s.tokens), sizes.map((n) => n + 1));
  const c = corpus();
  assert.equal(c.starts(T + 1), sizes.reduce((a, n) => a + (n + 1) - (T + 1) + 1, 0));
  const w = new Int32Array(T + 1);
  // Windows at both ends of every shard, and some in between.
  let k = 0;
  shardTokens.forEach((toks) => {
    const n = toks.length - T;
    for (const off of [0, 1, Math.floor(n / 2), n - 1]) {
      c.window(k + off, T + 1, w, 0);
      assert.deepEqual(Array.from(w), toks.slice(off, off + T + 1));
    }
    k += n;
  });
  assert.throws(() => c.window(k, T + 1, w, 0), /outside/);
  c.close();
});

test('batches from shards: x and y are the files\' tokens at the sampled windows', () => {
  tidy(() => {
    const l = new DataLoader({ sources: [{ corpus: corpus(), weight: 1 }], seqLen: T, globalBatch: 8, seed: 5 });
    const b = l.next();
    const flat = shardTokens.flatMap((toks) => Array.from({ length: toks.length - T }, (_, i) => toks.slice(i, i + T + 1)));
    const wins = l.sampleOffsets(0).map((k) => flat[k]!);
    assert.deepEqual(rows(b.x), wins.map((w) => w.slice(0, T)));
    assert.deepEqual(rows(b.y), wins.map((w) => w.slice(1)));
  });
});

/** Every (step) batch read by a layout's ranks, in global-batch order, as token rows. */
function readAll(dpSize: number, microBatches: number, steps: number[], extra: object = {}): number[][][] {
  const loaders = Array.from({ length: dpSize }, (_, r) =>
    new DataLoader({ sources: [{ corpus: corpus(), weight: 2 }, { corpus: TokenCorpus.fromArray(Uint8Array.from({ length: 3000 }, (_, i) => (i * 7) % 251)), weight: 1 }], seqLen: T, globalBatch: 16, seed: 11, dpRank: r, dpSize, microBatches, ...extra }));
  const out = steps.map((step) => tidy(() => loaders.flatMap((l) => Array.from({ length: microBatches }, (_, m) => rows(l.batch(step, m).x)).flat())));
  loaders.forEach((l) => l.close());
  return out;
}

test('dp = 2 and HSDP 2 x 2 over unequal shards read exactly the single-process global batch', () => {
  const steps = [0, 1, 7];
  const single = readAll(1, 1, steps);
  // dp = 2; HSDP replicate 2 x shard 2 is 4 data-parallel ranks (replicateRank * 2 + shardRank), with micro-batches.
  assert.deepEqual(readAll(2, 1, steps), single);
  assert.deepEqual(readAll(4, 2, steps), single);
  // And the sample ids partition: disjoint and complete.
  for (const dpSize of [2, 4]) {
    const ids = Array.from({ length: dpSize }, (_, r) => new DataLoader({ sources: [{ corpus: corpus(), weight: 1 }], seqLen: T, globalBatch: 16, dpRank: r, dpSize }).localSampleIds(0)).flat();
    assert.deepEqual([...ids].sort((a, b) => a - b), Array.from({ length: 16 }, (_, i) => i));
  }
});

test('resume under another data-parallel degree: the state is a position in the global order', () => {
  tidy(() => {
    const mk = (dpSize: number, dpRank: number) => new DataLoader({ sources: [{ corpus: corpus(), weight: 1 }], seqLen: T, globalBatch: 8, seed: 3, dpSize, dpRank });
    const single = mk(1, 0);
    const a = [mk(2, 0), mk(2, 1)];
    for (let s = 0; s < 3; s++) { single.next(); a.forEach((l) => l.next()); }
    const state = JSON.parse(JSON.stringify(a[0]!.stateDict()));
    const b = [0, 1, 2, 3].map((r) => mk(4, r));
    b.forEach((l) => l.loadStateDict(state));
    for (let s = 0; s < 3; s++) {
      const want = rows(single.next().x);
      const got = b.flatMap((l) => rows(l.next().x));
      assert.deepEqual(got, want);
    }
  });
});

test('the prefetch worker gives the same batches as reading inline, across a resume', () => {
  tidy(() => {
    const sources = () => [{ corpus: corpus(), weight: 1 }, { corpus: corpus().split(0.5, T + 1).tail, weight: 3 }];
    const opts = { seqLen: T, globalBatch: 8, seed: 9, microBatches: 2 };
    const inline = new DataLoader({ sources: sources(), ...opts });
    const ahead = new DataLoader({ sources: sources(), ...opts, prefetch: 3 });
    for (let i = 0; i < 12; i++) {
      const a = inline.next();
      const b = ahead.next();
      assert.deepEqual([b.step, b.micro], [a.step, a.micro]);
      assert.deepEqual(b.x.toNumbers(), a.x.toNumbers());
      assert.deepEqual(b.y.toNumbers(), a.y.toNumbers());
    }
    ahead.loadStateDict({ ...inline.stateDict(), step: 2, micro: 1 });
    inline.loadStateDict({ ...inline.stateDict(), step: 2, micro: 1 });
    for (let i = 0; i < 4; i++) assert.deepEqual(ahead.next().x.toNumbers(), inline.next().x.toNumbers());
    ahead.close();
  });
});

test('blending: realised proportions match the weights, decided by the sample index and seed alone', () => {
  const weights = [0.5, 0.3, 0.15, 0.05];
  let acc = 0;
  const cum = weights.map((w) => (acc += w));
  for (const N of [1_000, 20_000]) {
    const counts = [0, 0, 0, 0];
    for (let g = 0; g < N; g++) counts[blendedSource(g, cum, 1337)]!++;
    // A low-discrepancy schedule: off by a handful of samples, not by sqrt(N).
    counts.forEach((c, k) => assert.ok(Math.abs(c - weights[k]! * N) <= 6, `N=${N} source ${k}: ${c} vs ${weights[k]! * N}`));
  }
  // Through the loader: the sources of a global batch depend only on (seed, step), not on the rank.
  const srcs = weights.map((w, k) => ({ corpus: TokenCorpus.fromArray(new Uint8Array(200).fill(k)), weight: w * 10 }));
  const l = new DataLoader({ sources: srcs, seqLen: T, globalBatch: 40, seed: 2 });
  const l2 = new DataLoader({ sources: srcs, seqLen: T, globalBatch: 40, seed: 2, dpSize: 4, dpRank: 3 });
  const counts = [0, 0, 0, 0];
  for (let step = 0; step < 500; step++) {
    const s = l.samples(step);
    assert.deepEqual(s, l2.samples(step));
    for (const x of s) counts[x.source]!++;
  }
  counts.forEach((c, k) => assert.ok(Math.abs(c / 20_000 - weights[k]!) < 0.001, `source ${k}: ${c / 20_000}`));
  // The tokens come from the chosen source.
  tidy(() => {
    const b = l.batch(0, 0);
    const s = l.samples(0);
    rows(b.x).forEach((r, i) => assert.ok(r.every((v) => v === s[i]!.source)));
  });
});

test('nanoGPT uint16 .bin files are read directly; ids outside the vocabulary are named when read', async () => {
  const ids = Uint16Array.from({ length: 5000 }, (_, i) => (i * 31) % 50257);
  const bin = join(dir, 'train.bin');
  writeFileSync(bin, Buffer.from(ids.buffer));
  const d = await loadTrainData({ source: bin, sources: [], tokenizer: 'gpt2', valSource: '', valFraction: 0.1, seqLen: T }, { modelVocab: 0 });
  assert.equal(d.vocabSize, 50257);
  assert.equal(d.train[0]!.corpus.length + d.val[0]!.corpus.length, 5000);
  tidy(() => {
    const l = new DataLoader({ sources: d.train, seqLen: T, globalBatch: 4, seed: 1 });
    const x = rows(l.next().x);
    l.sampleOffsets(0).forEach((off, i) => assert.deepEqual(x[i], Array.from(ids.subarray(off, off + T))));
  });
  d.close();
  const narrow = new TokenCorpus([openFlatBin(bin)], { name: bin, vocabSize: 1000 });
  const w = new Int32Array(T + 1);
  assert.throws(() => { for (let k = 0; k < 200; k++) narrow.window(k, T + 1, w, 0); }, /train\.bin: token id \d+ at token \d+ is outside the vocabulary 0\.\.999/);
  writeFileSync(join(dir, 'odd.bin'), Buffer.alloc(7));
  assert.throws(() => openFlatBin(join(dir, 'odd.bin')), /odd\.bin has 7 bytes, not a whole number of uint16 tokens/);
});
