// The rank-aware, deterministic, resumable loader (see [Note: global batch partition]).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { DataLoader, sampleStream } from '../src/data/loader.js';
import { tidy } from '../src/tensor/index.js';

// A token stream where every window is recognisable: token i is i mod 251 (a prime, so windows
// of different starts rarely coincide over a long sequence).
const tokens = Int32Array.from({ length: 50_000 }, (_, i) => i % 251);
const base = { tokens, seqLen: 16, globalBatch: 24, seed: 7 };

function rows(t: { toNumbers(): number[]; shape: number[] }): number[][] {
  const [B, T] = t.shape as [number, number];
  const flat = t.toNumbers();
  return Array.from({ length: B }, (_, b) => flat.slice(b * T, (b + 1) * T));
}

test('batches are (B, T) int64 windows with targets shifted by one', () => {
  tidy(() => {
    const l = new DataLoader({ ...base, dpSize: 2, dpRank: 1, microBatches: 3 });
    assert.equal(l.localBatch, 12);
    assert.equal(l.microBatchSize, 4);
    const b = l.next();
    assert.deepEqual(b.x.shape, [4, 16]);
    assert.equal(b.x.dtype, 'int64');
    assert.equal(b.y.dtype, 'int64');
    const offsets = l.sampleOffsets(0);
    const ids = l.microSampleIds(0, 0);
    assert.deepEqual(ids, [12, 13, 14, 15]);
    rows(b.x).forEach((r, i) => assert.deepEqual(r, Array.from(tokens.subarray(offsets[ids[i]!]!, offsets[ids[i]!]! + 16))));
    rows(b.y).forEach((r, i) => assert.deepEqual(r, Array.from(tokens.subarray(offsets[ids[i]!]! + 1, offsets[ids[i]!]! + 17))));
    assert.equal(b.step, 0);
    assert.equal(b.micro, 0);
    assert.equal(l.micro, 1);
  });
});

test('the same seed gives the same batches; another seed gives others; offsets stay in range', () => {
  const a = new DataLoader(base);
  const b = new DataLoader(base);
  const c = new DataLoader({ ...base, seed: 8 });
  for (let s = 0; s < 5; s++) {
    assert.deepEqual(a.sampleOffsets(s), b.sampleOffsets(s));
    assert.notDeepEqual(a.sampleOffsets(s), c.sampleOffsets(s));
    assert.notDeepEqual(a.sampleOffsets(s), a.sampleOffsets(s + 1));
    for (const o of a.sampleOffsets(s)) assert.ok(Number.isInteger(o) && o >= 0 && o + 16 < tokens.length);
  }
  tidy(() => {
    for (let i = 0; i < 3; i++) assert.deepEqual(a.next().x.toNumbers(), b.next().x.toNumbers());
  });
  // The stream covers its range roughly uniformly (a coarse check that the generator is not broken).
  const draws = sampleStream(1, 0, 40_000, 10);
  const counts = new Array(10).fill(0);
  for (const d of draws) counts[d]++;
  for (const n of counts) assert.ok(Math.abs(n - 4000) < 400, `bucket count ${n}`);
});

test('simulated data-parallel ranks and micro-batches partition the global batch', () => {
  for (const [dpSize, microBatches] of [[1, 1], [2, 1], [4, 1], [2, 3], [3, 2], [1, 4]] as const) {
    const loaders = Array.from({ length: dpSize }, (_, r) => new DataLoader({ ...base, dpSize, dpRank: r, microBatches }));
    for (const step of [0, 1, 5]) {
      const all = loaders.flatMap((l) => l.localSampleIds(step));
      assert.equal(all.length, base.globalBatch, `dp ${dpSize} x mb ${microBatches}`);
      assert.deepEqual([...all].sort((x, y) => x - y), Array.from({ length: base.globalBatch }, (_, i) => i), 'disjoint and complete');
      // Micro-batches slice each rank's part in order.
      for (const l of loaders) {
        const micro = Array.from({ length: microBatches }, (_, m) => l.microSampleIds(step, m)).flat();
        assert.deepEqual(micro, l.localSampleIds(step));
      }
      // Every rank sees the same global offsets, so together they read exactly one global batch.
      for (const l of loaders) assert.deepEqual(l.sampleOffsets(step), loaders[0]!.sampleOffsets(step));
    }
  }
});

test('the tokens read by all ranks equal the tokens of a single-process run', () => {
  tidy(() => {
    const single = new DataLoader(base);
    const whole = rows(single.next().x);
    const dp = Array.from({ length: 4 }, (_, r) => new DataLoader({ ...base, dpSize: 2, dpRank: r % 2, microBatches: 2 }));
    // rank 0 micro 0, rank 0 micro 1, rank 1 micro 0, rank 1 micro 1
    const pieces = [dp[0]!.next(), dp[0]!.next(), dp[1]!.next(), dp[1]!.next()].flatMap((b) => rows(b.x));
    assert.deepEqual(pieces, whole);
  });
});

test('resume: stateDict after k steps gives exactly the next batches', () => {
  tidy(() => {
    const opts = { ...base, dpSize: 2, dpRank: 1, microBatches: 2 };
    const straight = new DataLoader(opts);
    const first = new DataLoader(opts);
    for (let i = 0; i < 7; i++) { straight.next(); first.next(); } // 3.5 steps: resume mid-step too
    const state = JSON.parse(JSON.stringify(first.stateDict()));
    assert.deepEqual(state, { step: 3, micro: 1, seed: 7, globalBatch: 24, seqLen: 16 });
    const resumed = new DataLoader({ ...opts, seed: 999 }); // the state carries the seed
    resumed.loadStateDict(state);
    for (let i = 0; i < 6; i++) {
      const a = straight.next();
      const b = resumed.next();
      assert.equal(b.step, a.step);
      assert.equal(b.micro, a.micro);
      assert.deepEqual(b.x.toNumbers(), a.x.toNumbers());
      assert.deepEqual(b.y.toNumbers(), a.y.toNumbers());
    }
  });
});

test('errors name the fix', () => {
  assert.throws(
    () => new DataLoader({ ...base, globalBatch: 10, dpSize: 2, microBatches: 3 }),
    /data\.globalBatch=10 does not split over 2 data-parallel rank\(s\) x 3 micro-batch\(es\) = 6 equal parts; set data\.globalBatch to a multiple of 6 \(e\.g\. 6 or 12\)/,
  );
  assert.throws(() => new DataLoader({ ...base, globalBatch: 3, dpSize: 4 }), /multiple of 4 \(e\.g\. 4\)/);
  assert.throws(() => new DataLoader({ ...base, dpSize: 2, dpRank: 2 }), /dpRank 2 is outside 0\.\.1/);
  assert.throws(() => new DataLoader({ ...base, seqLen: 0 }), /seqLen must be a positive integer/);
  assert.throws(() => new DataLoader({ ...base, tokens: new Int32Array(10) }), /10 tokens cannot hold one sample of data\.seqLen=16/);
  assert.throws(() => new DataLoader({ ...base, seed: -1 }), /seed must be an integer in 0\.\.2\^32-1/);
  const l = new DataLoader(base);
  assert.throws(() => l.loadStateDict({ ...l.stateDict(), globalBatch: 48 }), /saved with data\.globalBatch=48, data\.seqLen=16; this run has 24, 16/);
  assert.throws(() => l.microSampleIds(0, 1), /micro-batch 1 is outside 0\.\.0/);
});
