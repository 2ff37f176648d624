// The optimizer over flat pieces ([Note: flat step] in src/optim/optimizer.ts): equal to the
// per-parameter step in float32, and its state saved by parameter name loads back exactly.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import * as ft from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { AdamW, SGD } from '../src/optim/index.js';
import { UPDATE_CHUNK } from '../src/optim/optimizer.js';
import { optimizerSpec } from '../src/optim/registry.js';
import { trainedParameters } from '../src/train/phases.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';

ft.setNumThreads(1);
const cfg = { vocabSize: 64, blockSize: 16, nLayer: 2, nHead: 2, nEmbd: 32 };

function groups(m: GPT) {
  const named = m.namedParameters();
  return [
    { params: named.filter(([, p]) => p.ndim >= 2).map(([, p]) => p), options: { weightDecay: 0.1 } },
    { params: named.filter(([, p]) => p.ndim < 2).map(([, p]) => p), options: { weightDecay: 0 } },
  ];
}

function step(m: GPT, dp: DataParallel<GPT> | undefined, opt: { step(): void; zeroGrad(): void }, s: number): void {
  ft.tidy(() => {
    opt.zeroGrad();
    ft.manualSeed(100 + s);
    const d = ft.randint(0, 64, [4, 17]);
    const x = d.narrow(1, 0, 16), y = d.narrow(1, 1, 16);
    (dp ? dp.forward(x, y) : m.forward(x, y)).loss!.backward();
    dp?.finishGradSync();
    opt.step();
  });
}

function maxRel(a: GPT, b: GPT): number {
  let worst = 0;
  const pb = b.parameters();
  a.parameters().forEach((p, i) => {
    const x = p.toNumbers(), y = pb[i]!.toNumbers();
    x.forEach((v, k) => (worst = Math.max(worst, Math.abs(v - y[k]!) / Math.max(1e-3, Math.abs(y[k]!)))));
  });
  return worst;
}

type MakeOpt = (ps: ReturnType<typeof groups>, x: object) => { step(): void; zeroGrad(): void };

/**
 * Trains the same GPT twice, with the optimizer over DataParallel's flat buckets and per parameter,
 * and returns the flat run's wrapper (for layout checks before training) and their largest difference.
 */
function flatVsPerParameter(c: typeof cfg, bucketSizeMb: number, make: MakeOpt, steps: number, check?: (dp: DataParallel<GPT>) => void): number {
  const world = initProcessGroup();
  try {
    const flat = new GPT(c, { initSeed: 3 }), ref = new GPT(c, { initSeed: 3 });
    const dp = new DataParallel(flat, { group: world, bucketSizeMb });
    check?.(dp);
    const o1 = make(groups(flat), { grads: dp }), o2 = make(groups(ref), {});
    for (let s = 0; s < steps; s++) {
      step(flat, dp, o1, s);
      step(ref, undefined, o2, s);
    }
    dp.dispose();
    return maxRel(flat, ref);
  } finally {
    destroyProcessGroup();
  }
}

test('AdamW and SGD over flat buckets equal the per-parameter step in float32 (mixed weight decay in one bucket)', () => {
  for (const [name, make] of [
    ['AdamW', (ps, x) => new AdamW(ps, { lr: 3e-3, betas: [0.9, 0.95] }, x)],
    ['SGD', (ps, x) => new SGD(ps, { lr: 0.1, momentum: 0.9 }, x)],
  ] as [string, MakeOpt][]) {
    const d = flatVsPerParameter(cfg, 1, make, 6);
    assert.ok(d <= 1e-6, `${name}: flat and per-parameter steps differ by ${d}`);
  }
});

test('an update split into cache-sized chunks equals the per-parameter step (runs and mixed weight decay cross chunk edges)', () => {
  // Width 256: one 4 MiB bucket holds ~0.8M elements, so runs span several UPDATE_CHUNKs and the
  // per-element decay tensor is cut at the same edges.
  const wide = { ...cfg, nEmbd: 256, nHead: 4, nLayer: 1 };
  const d = flatVsPerParameter(wide, 4, (ps, x) => new AdamW(ps, { lr: 3e-3, betas: [0.9, 0.95] }, x), 4, (dp) => {
    const longest = Math.max(...dp.pieceLayout().map((p) => p.data.numel()));
    assert.ok(longest > 2 * UPDATE_CHUNK, `the bucket (${longest} elements) must span several chunks of ${UPDATE_CHUNK}`);
  });
  assert.ok(d <= 1e-6, `chunked flat and per-parameter steps differ by ${d}`);
});

test('optimizer state saved by parameter name loads into a fresh wrapper and training continues identically', () => {
  const world = initProcessGroup();
  try {
    const a = new GPT(cfg, { initSeed: 5 });
    const dpA = new DataParallel(a, { group: world, zero: 2, bucketSizeMb: 0.01 });
    const oA = new AdamW(groups(a), { lr: 3e-3 }, { grads: dpA });
    for (let s = 0; s < 3; s++) step(a, dpA, oA, s);
    const sd = oA.stateDict();
    assert.ok('layers.0.attn.qkv.weight' in sd.state && 'expAvg' in sd.state['layers.0.attn.qkv.weight']!, 'state is keyed by parameter name');
    assert.equal(sd.state['lnF.bias']!.step!.item(), 3);

    const b = new GPT(cfg, { initSeed: 6 });
    b.loadStateDict(a.stateDict());
    const dpB = new DataParallel(b, { group: world, zero: 2, bucketSizeMb: 0.01 });
    const oB = new AdamW(groups(b), { lr: 3e-3 }, { grads: dpB });
    oB.loadStateDict(sd);
    for (let s = 3; s < 6; s++) {
      step(a, dpA, oA, s);
      step(b, dpB, oB, s);
    }
    assert.equal(maxRel(a, b), 0, 'resumed optimizer continues bit for bit');
    assert.throws(() => oB.loadStateDict({ step: 1, state: { nope: {} } }), /does not have: nope/);
    dpA.dispose();
    dpB.dispose();
  } finally {
    destroyProcessGroup();
  }
});

test('[optim] name chooses from the registry; the trainer hands the optimizer the parameters that train, decay on matrices only', () => {
  const w = ft.zeros([3, 4], { requiresGrad: true }), frozen = ft.zeros([4, 4]), b = ft.zeros([4], { requiresGrad: true });
  const { decay, noDecay } = trainedParameters([['w', w], ['frozen', frozen], ['b', b]]);
  assert.equal(decay.length, 1);
  assert.equal(decay[0], w, 'the frozen matrix is left out');
  assert.equal(noDecay.length, 1);
  assert.equal(noDecay[0], b);
  const settings = { lr: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8, weightDecay: 0.1 };
  const groups = [{ params: decay, weightDecay: 0.1 }, { params: noDecay, weightDecay: 0 }];
  const sgd = optimizerSpec('sgd').build(groups, settings, {});
  const adamw = optimizerSpec('adamw').build(groups, settings, {});
  assert.ok(sgd instanceof SGD && adamw instanceof AdamW);
  assert.equal(optimizerSpec('sgd').describe(settings), 'SGD');
  assert.equal(optimizerSpec('adamw').describe(settings), 'AdamW betas (0.9, 0.95)');
  assert.throws(() => optimizerSpec('adam'), /optim\.name = "adam" is not a known optimizer; choose one of "adamw", "sgd"/);
  sgd.dispose();
  adamw.dispose();
  for (const t of [w, frozen, b]) t.dispose();
});
