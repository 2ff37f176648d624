// The example loader: epoch plans, packing, the batch partition, epochs -> steps, rows -> (x, y)
// with the loss on trained targets only, and exact resume (see [Note: example rows]).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { tidy } from '../src/tensor/index.js';
import { planEpoch } from '../src/data/packing.js';
import { ExampleCorpus, type ExampleKind } from '../src/data/examples.js';
import { ExampleLoader, type ExampleBatch } from '../src/data/example_loader.js';
import { checkDataConfig, loadTrainData } from '../src/data/sources.js';
import { DataLoader, type LoaderState } from '../src/data/loader.js';
import { IGNORE_INDEX } from '../src/parallel/parallel_model.js';
import { fixtureDoc, writeExampleDataset, type FixtureDoc } from './fixtures/example_shards.js';
import { tinyGptToml } from './fixtures/tiny_gpt.js';
import { flotilla } from './helpers/cli.js';
import { readMetrics } from '../src/train/metrics.js';
import { WordCounter, trainBpe } from '../src/data/bpe_train.js';
import { defaultConfig, parseConfig, validateConfig } from '../src/config/index.js';

const I = IGNORE_INDEX;

/** An in-memory corpus of documents (preference: documents in pairs). */
function corpus(docs: FixtureDoc[], kind: ExampleKind = 'chat'): ExampleCorpus {
  const ids = Int32Array.from(docs.flatMap((d) => d.ids));
  const mask = new Uint8Array(Math.ceil(ids.length / 8));
  const offsets = new Float64Array(docs.length + 1);
  let at = 0;
  docs.forEach((d, j) => {
    d.trained.forEach((t, k) => { if (t) mask[(at + k) >> 3]! |= 1 << ((at + k) & 7); });
    at += d.ids.length;
    offsets[j + 1] = at;
  });
  const units = kind === 'preference' ? docs.length / 2 : docs.length;
  return new ExampleCorpus({ name: 'mem', kind, shards: [{ kind: 'memory', ids, mask, offsets, name: 'mem' }], vocabSize: 256, lo: 0, hi: units });
}

/** Mixed lengths 2..40 (some longer than a 32-token row). */
const docs = Array.from({ length: 61 }, (_, i) => fixtureDoc(i, 2 + ((i * 17) % 39), i % 3));

function planes(b: ExampleBatch): number[][] {
  return [b.x.toNumbers(), b.y.toNumbers(), Array.from(b.positions), Array.from(b.docIds)];
}

test('planEpoch: deterministic per (seed, epoch); every unit once; rows within seqLen; overflow counted', () => {
  const lengths = Int32Array.from(docs, (d) => d.ids.length);
  const o = { seqLen: 32, pack: true, overflow: 'truncate' as const };
  const a = planEpoch(lengths, 5, 0, o);
  assert.deepEqual(planEpoch(lengths, 5, 0, o), a);
  assert.notDeepEqual(planEpoch(lengths, 5, 1, o).unit, a.unit);
  assert.notDeepEqual(planEpoch(lengths, 6, 0, o).unit, a.unit);
  assert.deepEqual([...a.unit].sort((x, y) => x - y), Array.from({ length: 61 }, (_, i) => i));
  const long = [...lengths].filter((n) => n > 32).length;
  assert.ok(long > 0);
  assert.equal(a.truncated, long);
  assert.equal(a.dropped, 0);
  let used = 0;
  for (let r = 0; r < a.rows; r++) {
    let sum = 0;
    for (let i = a.rowStart[r]!; i < a.rowStart[r + 1]!; i++) {
      assert.equal(a.take[i], Math.min(lengths[a.unit[i]!]!, 32));
      sum += a.take[i]!;
    }
    assert.ok(sum <= 32 && sum > 0);
    used += sum;
  }
  assert.ok(a.rows < 61, 'packing puts several examples in a row');
  assert.equal(a.fill, used / (a.rows * 32));
  const drop = planEpoch(lengths, 5, 0, { ...o, overflow: 'drop' });
  assert.equal(drop.dropped, long);
  assert.equal(drop.truncated, 0);
  assert.equal(drop.unit.length, 61 - long);
  assert.ok([...drop.unit].every((u) => lengths[u]! <= 32));
  const unpacked = planEpoch(lengths, 5, 0, { ...o, pack: false });
  assert.equal(unpacked.rows, 61);
  // Without packing the rows follow the epoch's shuffle itself; packing only groups it.
  assert.notDeepEqual(Array.from(unpacked.unit), Array.from({ length: 61 }, (_, i) => i));
  assert.deepEqual(Array.from(unpacked.rowStart), Array.from({ length: 62 }, (_, i) => i));
});

test('a hand-built packed row: x, y (trained targets only, nothing across documents), positions, document ids, padding', () => {
  const A = { ids: [10, 11, 12], trained: [0, 1, 1] };
  const B = { ids: [20, 21, 22, 23, 24], trained: [0, 0, 1, 1, 1] };
  tidy(() => {
    const l = new ExampleLoader({ sources: [corpus([A, B])], seqLen: 10, globalBatch: 1, pack: true, shuffle: false, padId: 0 });
    const b = l.next();
    assert.deepEqual(b.x.shape, [1, 10]);
    assert.equal(b.y.dtype, 'int64');
    assert.deepEqual(planes(b), [
      [10, 11, 12, 20, 21, 22, 23, 24, 0, 0],
      [11, 12, I, I, 22, 23, 24, I, I, I],
      [0, 1, 2, 0, 1, 2, 3, 4, 0, 1],
      [0, 0, 0, 1, 1, 1, 1, 1, 2, 2],
    ]);
    assert.equal(b.seqs, undefined);
    // Two documents in a row: the batch carries their layout for attention and positions.
    assert.deepEqual(b.docs!.positions.toNumbers(), planes(b)[2]);
    assert.deepEqual(b.docs!.ids.toNumbers(), planes(b)[3]);
    b.docs!.dispose();
    // Unpacked: one example a row, padded.
    const u = new ExampleLoader({ sources: [corpus([A, B])], seqLen: 6, globalBatch: 2, pack: false, shuffle: false, padId: 0 }).next();
    assert.deepEqual(planes(u), [
      [10, 11, 12, 0, 0, 0, 20, 21, 22, 23, 24, 0],
      [11, 12, I, I, I, I, I, 22, 23, 24, I, I],
      [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4, 0],
      [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1],
    ]);
    assert.equal(u.docs, undefined, 'one example and its padding a row: causality alone hides the padding');
  });
});

test('preference pairs: chosen then rejected in one row, cut evenly from their tails, and the sequence table', () => {
  const pc = { ids: [5, 6, 7, 8], trained: [0, 0, 1, 1] }; // prompt 5 6, chosen 7 8
  const pr = { ids: [5, 6, 9], trained: [0, 0, 1] }; // prompt 5 6, rejected 9
  const qc = { ids: [3, 40, 41, 42, 43], trained: [0, 1, 1, 1, 1] };
  const qr = { ids: [3, 50, 51, 52, 53, 54, 55], trained: [0, 1, 1, 1, 1, 1, 1] };
  tidy(() => {
    const c = corpus([pc, pr, qc, qr], 'preference');
    assert.equal(c.units, 2);
    assert.equal(c.unitLength(1), 12);
    const l = new ExampleLoader({ sources: [c], seqLen: 8, globalBatch: 2, pack: false, shuffle: false, padId: 0 });
    const b = l.next();
    assert.deepEqual(planes(b), [
      [5, 6, 7, 8, 5, 6, 9, 0, /* pair 1 cut by 4: 2 off each tail */ 3, 40, 41, 3, 50, 51, 52, 53],
      [I, 7, 8, I, I, 9, I, I, 40, 41, I, 50, 51, 52, 53, I],
      [0, 1, 2, 3, 0, 1, 2, 0, 0, 1, 2, 0, 1, 2, 3, 4],
      [0, 0, 0, 0, 1, 1, 1, 2, 0, 0, 0, 1, 1, 1, 1, 1],
    ]);
    assert.deepEqual(b.docs!.ids.toNumbers(), planes(b)[3]);
    b.docs!.dispose();
    const s = b.seqs!;
    assert.equal(s.nSeq, 4);
    assert.deepEqual(Array.from(s.chosen), [0, 2]);
    assert.deepEqual(Array.from(s.rejected), [1, 3]);
    assert.deepEqual(Array.from(s.pairIds), [0, 1]);
    // Trained targets: y != IGNORE_INDEX, each counted in its sequence; the rest go to the dump slot 4.
    assert.deepEqual(Array.from(s.lengths), [2, 1, 2, 4]);
    assert.deepEqual(s.index.toNumbers(), [4, 0, 0, 4, 4, 1, 4, 4, 2, 2, 4, 3, 3, 3, 3, 4]);
  });
});

test('a preference pair whose cut to seqLen would leave a response with no trained target is left out, counted with the dropped', () => {
  const pc = { ids: [5, 6, 7, 8], trained: [0, 0, 1, 1] }; // fits a row of 8
  const pr = { ids: [5, 6, 9], trained: [0, 0, 1] };
  const qc = { ids: [3, 40, 41, 42, 43], trained: [0, 1, 1, 1, 1] }; // cut by 4, both responses keep targets
  const qr = { ids: [3, 50, 51, 52, 53, 54, 55], trained: [0, 1, 1, 1, 1, 1, 1] };
  const long = [3, 3, 3, 3, 3, 3];
  const zc = { ids: [...long, 60], trained: [0, 0, 0, 0, 0, 0, 1] }; // cut by 7: the chosen keeps 3 prompt tokens
  const zr = { ids: [...long, 70, 71], trained: [0, 0, 0, 0, 0, 0, 1, 1] };
  tidy(() => {
    const c = corpus([pc, pr, zc, zr, qc, qr], 'preference');
    assert.equal(c.units, 3);
    assert.equal(c.keepsTargets(1, 8), false);
    assert.equal(c.keepsTargets(1, 15), true, 'uncut, it trains');
    assert.equal(c.keepsTargets(2, 8), true);
    for (const pack of [false, true]) {
      const l = new ExampleLoader({ sources: [c], seqLen: 8, globalBatch: 2, pack, shuffle: false, padId: 0, epochs: 2 });
      assert.match(l.describe(l.stepsFor(2)), /^3 pairs -> 2 rows x 8 per epoch .*; 1 truncated, 1 dropped \(overflow = truncate; 1 of them pairs that a cut to 8 tokens would leave with a response of no trained token\); 2 epoch\(s\) = 2 steps/);
      for (let step = 0; step < 2; step++) {
        const b = l.batch(step, 0);
        assert.deepEqual(Array.from(b.seqs!.pairIds).sort(), [0, 2], `pack ${pack}, step ${step}`);
        assert.ok(Array.from(b.seqs!.lengths).every((n) => n > 0), 'every sequence has trained targets');
        b.docs?.dispose();
      }
    }
    // overflow = "drop" leaves out every pair longer than a row, as before.
    const d = new ExampleLoader({ sources: [c], seqLen: 8, globalBatch: 1, pack: false, shuffle: false, padId: 0, overflow: 'drop' });
    assert.match(d.describe(10), /0 truncated, 2 dropped \(overflow = drop\)/);
    // Every pair so: one error naming the fix.
    assert.throws(() => new ExampleLoader({ sources: [corpus([zc, zr], 'preference')], seqLen: 8, globalBatch: 1, pack: false, padId: 0 }), /no preference pair fits data\.seqLen = 8: .*cutting it would leave a response with no trained token; use a longer data\.seqLen/);
  });
});

test('data-parallel ranks and micro-batches partition the global batch (the rows of a one-rank run)', () => {
  const base = { sources: [corpus(docs)], seqLen: 32, globalBatch: 12, pack: true, seed: 3, padId: 0 };
  tidy(() => {
    const one = new ExampleLoader(base);
    const whole = [0, 1, 2].map((s) => one.batch(s, 0).x.toNumbers());
    for (const [dpSize, microBatches] of [[2, 1], [3, 2], [1, 4], [4, 3]] as const) {
      const loaders = Array.from({ length: dpSize }, (_, r) => new ExampleLoader({ ...base, dpSize, dpRank: r, microBatches }));
      const ids = loaders.flatMap((l) => l.localSampleIds(0));
      assert.deepEqual(ids, Array.from({ length: 12 }, (_, i) => i));
      for (let s = 0; s < 3; s++) {
        const got = loaders.flatMap((l) => Array.from({ length: microBatches }, (_, m) => l.batch(s, m).x.toNumbers())).flat();
        assert.deepEqual(got, whole[s], `dp ${dpSize} x micro ${microBatches}, step ${s}`);
      }
    }
  });
});

test('epochs -> steps: ceil(rows of every epoch / globalBatch); the last step completed from the next epoch; every unit once an epoch', () => {
  const lengths = Int32Array.from(docs, (d) => d.ids.length);
  for (const pack of [true, false]) {
    const o = { seqLen: 32, pack, overflow: 'drop' as const };
    const l = new ExampleLoader({ sources: [corpus(docs)], globalBatch: 8, seed: 9, padId: 0, epochs: 3, ...o });
    const rows = [0, 1, 2, 3].map((e) => planEpoch(lengths, 9, e, o).rows);
    assert.equal(l.stepsFor(3), Math.ceil((rows[0]! + rows[1]! + rows[2]!) / 8));
    assert.equal(l.stepsFor(1), Math.ceil(rows[0]! / 8));
    assert.match(l.describe(l.stepsFor(3)), new RegExp(`^61 examples -> ${rows[0]} rows x 32 per epoch \\(${pack ? 'packed, ' : ''}fill \\d+\\.\\d%\\); 0 truncated, \\d+ dropped \\(overflow = drop\\); 3 epoch\\(s\\) = ${l.stepsFor(3)} steps`));
    // Epoch 0's rows, in order, are the first rows of the stream; then epoch 1's.
    tidy(() => {
      const seen = new Map<number, number>();
      const first = (e: number) => planEpoch(lengths, 9, e, o);
      const e0 = first(0), e1 = first(1);
      for (let g = 0; g < e0.rows + e1.rows; g++) {
        const b = l.batch(Math.floor(g / 8), 0);
        void b;
        const [p, r] = g < e0.rows ? [e0, g] : [e1, g - e0.rows];
        for (let i = p.rowStart[r]!; i < p.rowStart[r + 1]!; i++) seen.set(p.unit[i]!, (seen.get(p.unit[i]!) ?? 0) + 1);
      }
      const kept = [...lengths].filter((n) => n <= 32).length;
      assert.equal(seen.size, kept);
      assert.ok([...seen.values()].every((c) => c === 2));
      // The row at the epoch boundary: the first row of epoch 1 in the stream.
      const g = e0.rows;
      const step = Math.floor(g / 8), b = g % 8;
      const x = l.batch(step, 0).x.toNumbers().slice(b * 32, (b + 1) * 32);
      const u = e1.unit[e1.rowStart[0]!]!;
      assert.deepEqual(x.slice(0, docs[u]!.ids.length), docs[u]!.ids);
    });
  }
});

test('mid-epoch resume, across an epoch boundary, with and without prefetch: batches byte-identical to an uninterrupted run', async () => {
  const base = { sources: [corpus(docs)], seqLen: 32, globalBatch: 6, dpSize: 2, dpRank: 1, microBatches: 3, pack: true, seed: 11, padId: 0, epochs: 2 };
  const straight = new ExampleLoader(base);
  const steps = straight.stepsFor(2) + 2; // past the second epoch too
  const ref: number[][][] = [];
  const states: LoaderState[] = [];
  tidy(() => {
    for (let s = 0; s < steps; s++) {
      states.push(straight.stateDict());
      for (let m = 0; m < 3; m++) ref.push(planes(straight.next()));
    }
  });
  const lengths = Int32Array.from(docs, (d) => d.ids.length);
  const rows0 = planEpoch(lengths, 11, 0, { seqLen: 32, pack: true, overflow: 'truncate' }).rows;
  const boundary = Math.floor(rows0 / 6); // this step reads epoch 0's last rows and epoch 1's first
  assert.notEqual(rows0 % 6, 0);
  for (const prefetch of [0, 2]) {
    for (const at of [1, boundary, boundary + 1]) {
      const r = new ExampleLoader({ ...base, prefetch });
      r.loadStateDict(straight.stateDict()); // a later position first: the resume must move back
      r.loadStateDict({ ...states[at]! });
      try {
        tidy(() => {
          for (let i = at * 3; i < steps * 3; i++) assert.deepEqual(planes(r.next()), ref[i], `prefetch ${prefetch}, resumed at step ${at}, batch ${i}`);
        });
      } finally {
        r.close();
      }
    }
  }
  // Mid-step too: a state saved after micro-batch 1.
  tidy(() => {
    const r = new ExampleLoader(base);
    r.loadStateDict({ ...states[2]!, micro: 1 });
    assert.deepEqual(planes(r.next()), ref[2 * 3 + 1]);
  });
});

test('a resume that would read other rows is refused, naming the field', () => {
  const base = { sources: [corpus(docs)], seqLen: 32, globalBatch: 4, pack: true, padId: 0, epochs: 2 };
  const s = new ExampleLoader(base).stateDict();
  assert.throws(() => new ExampleLoader({ ...base, pack: false }).loadStateDict(s), /data\.pack = true; this run has false/);
  assert.throws(() => new ExampleLoader({ ...base, overflow: 'drop' }).loadStateDict(s), /data\.overflow = "truncate"; this run has "drop"/);
  assert.throws(() => new ExampleLoader({ ...base, epochs: 3 }).loadStateDict(s), /train\.epochs = 2; this run has 3/);
  assert.throws(() => new ExampleLoader({ ...base, datasetKey: 'other' }).loadStateDict(s), /other examples \(its datasetKey differs/);
  const { examples, ...text } = s;
  void examples;
  assert.throws(() => new ExampleLoader(base).loadStateDict(text), /saved by a run on text/);
  assert.throws(() => new DataLoader({ tokens: new Int32Array(100), seqLen: 32, globalBatch: 4 }).loadStateDict(s), /saved by a run on examples/);
});

test('prepared shards: documents, masks (at any bit offset) and pairs read by byte range as written; validation is the last units in order', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-examples-'));
  try {
    const chat = docs.slice(0, 40);
    writeExampleDataset(join(dir, 'chat'), 'chat', [chat.slice(0, 17), chat.slice(17)]);
    const data = await loadTrainData({ source: join(dir, 'chat'), sources: [], tokenizer: 'byte', valSource: '', valFraction: 0.1, seqLen: 32, format: 'chat' }, { modelVocab: 0 });
    try {
      const ex = data.examples!;
      assert.equal(ex.train[0]!.units, 36);
      assert.equal(ex.val[0]!.units, 4);
      const mem = corpus(chat);
      const ids = new Int32Array(64), tr = new Uint8Array(64), ids2 = new Int32Array(64), tr2 = new Uint8Array(64);
      for (let u = 0; u < 40; u++) {
        const c = u < 36 ? ex.train[0]! : ex.val[0]!;
        const n = c.read(u < 36 ? u : u - 36, 64, ids, tr, 0);
        const m = mem.read(u, 64, ids2, tr2, 0);
        assert.deepEqual(n, m);
        assert.deepEqual(ids.subarray(0, n[0]), ids2.subarray(0, m[0]));
        assert.deepEqual(tr.subarray(0, n[0]), tr2.subarray(0, m[0]));
        assert.deepEqual(Array.from(ids.subarray(0, n[0])), chat[u]!.ids);
        assert.deepEqual(Array.from(tr.subarray(0, n[0])), chat[u]!.trained.map(Number));
        // A document keeps a trained target when one of its tokens 1 .. n - 1 (cut to max) is trained.
        for (const max of [1, 2, 3, 5, 64]) {
          const want = chat[u]!.trained.slice(1, max).some(Boolean);
          assert.equal(c.keepsTargets(u < 36 ? u : u - 36, max), want, `document ${u} cut to ${max}`);
          assert.equal(mem.keepsTargets(u, max), want);
        }
      }
      assert.equal(ex.padId, 0);
      tidy(() => {
        // Validation rows are fixed: the held-out units in order, whatever the seed.
        const v = (seed: number) => new ExampleLoader({ sources: ex.val, seqLen: 64, globalBatch: 4, shuffle: false, seed, padId: ex.padId }).batch(0, 0).x.toNumbers();
        assert.deepEqual(v(1), v(2));
        assert.deepEqual(v(1).slice(0, chat[36]!.ids.length), chat[36]!.ids);
      });
    } finally {
      data.close();
    }
    await assert.rejects(
      loadTrainData({ source: join(dir, 'chat'), sources: [], tokenizer: 'byte', valSource: '', valFraction: 0.1, seqLen: 32, format: 'preference' }, { modelVocab: 0 }),
      /holds chat data \(prepared with --format chat\), but data\.format = "preference"/,
    );
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

/** A small BPE tokenizer.json in `dir` (examples need a tokenizer with special tokens, not "byte"); its ids go above the documents' 1..255. */
function bpe(dir: string): string {
  const counts = new WordCounter();
  counts.add('the examples of the loader test, packed into rows of the tiny model');
  const path = join(dir, 'tokenizer.json');
  writeFileSync(path, JSON.stringify(trainBpe(counts.counts, 300).json));
  return path;
}

test('train.epochs: only with example data, and not with train.steps', () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-epochs-'));
  const tok = JSON.stringify(bpe(dir));
  assert.deepEqual(validateConfig(parseConfig(`[data]\nformat = "completion"\ntokenizer = ${tok}\n[train]\nepochs = 2\n`)), []);
  assert.throws(() => parseConfig('[train]\nepochs = 2\n'), /train\.epochs = 2 counts passes over an example dataset, and data\.format = "text"/);
  // A .jsonl of examples is prepared before the ranks start (src/data/example_source.ts): the data check leaves it to that.
  assert.deepEqual(checkDataConfig({ source: join(dir, 'chat.jsonl'), sources: [], tokenizer: JSON.parse(tok) as string, valSource: '', valFraction: 0.1, seqLen: 32, format: 'chat' }, 0), []);
  rmSync(dir, { recursive: true, force: true });
  assert.throws(() => parseConfig(`[data]\nformat = "completion"\ntokenizer = ${tok}\n[train]\nepochs = 2\nsteps = 50\n`), /train\.epochs = 2 sets the number of steps, and train\.steps = 50 is set too/);
});

test('flotilla train on 2 ranks: packed completion examples for 2 epochs, the step count from the rows, and --resume continues exactly', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-examples-train-'));
  try {
    const tokenizer = bpe(dir);
    writeExampleDataset(join(dir, 'ex'), 'completion', [docs.slice(0, 30), docs.slice(30)], tokenizer);
    const config = join(dir, 'ex.toml');
    writeFileSync(config, tinyGptToml({
      data: { source: join(dir, 'ex'), format: 'completion', pack: true, tokenizer, globalBatch: 4 },
      train: { epochs: 2, evalEvery: 0, evalBatches: 1 },
      optim: { schedule: 'constant' },
      parallel: { backend: 'gloo' },
      checkpoint: { every: 5, keep: 10 },
      log: { progress: 'plain', every: 1 },
    }));
    const straight = await flotilla(['train', config, '--nproc', '2', `--train.runDir=${join(dir, 'straight')}`]);
    assert.equal(straight.code, 0, straight.out + straight.err);
    const lengths = Int32Array.from(docs.slice(0, 55), (d) => d.ids.length); // valFraction 0.1 holds out the last 6
    const o = { seqLen: 32, pack: true, overflow: 'truncate' as const };
    const seed = defaultConfig().train.seed;
    const rows = planEpoch(lengths, seed, 0, o).rows;
    const steps = Math.ceil((rows + planEpoch(lengths, seed, 1, o).rows) / 4);
    assert.match(straight.out, new RegExp(`\\[data\\] 55 examples -> ${rows} rows x 32 per epoch \\(packed, fill \\d+\\.\\d%\\); \\d+ truncated, 0 dropped \\(overflow = truncate\\); 2 epoch\\(s\\) = ${steps} steps`));
    const want = readMetrics(join(dir, 'straight', 'metrics.jsonl'));
    assert.deepEqual(want.map((m) => m.step), Array.from({ length: steps }, (_, i) => i + 1));
    const ckpt = readdirSync(join(dir, 'straight', 'checkpoints')).find((n) => /^step-0*5$/.test(n));
    assert.ok(ckpt, 'a checkpoint at step 5');
    const resumed = await flotilla(['train', config, '--nproc', '2', `--train.runDir=${join(dir, 'resumed')}`, '--resume', join(dir, 'straight', 'checkpoints', ckpt)]);
    assert.equal(resumed.code, 0, resumed.out + resumed.err);
    assert.match(resumed.out, /\[resume\] resumed from step 5 /);
    const got = readMetrics(join(dir, 'resumed', 'metrics.jsonl'));
    assert.deepEqual(got.map((m) => [m.step, m.loss]), want.filter((m) => m.step > 5).map((m) => [m.step, m.loss]));
    // Another packing reads other rows: refused before any step, naming the field.
    const other = await flotilla(['train', config, '--nproc', '2', `--train.runDir=${join(dir, 'other')}`, '--data.pack=false', '--resume', join(dir, 'straight', 'checkpoints', ckpt)]);
    assert.notEqual(other.code, 0);
    assert.match(other.out + other.err, /data\.pack = true; this run has false/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
