// Memory: a long training loop keeps the live-handle count constant and RSS flat; dispose() is
// idempotent; a disposed tensor fails loudly; scopes free what they should and keep what they return.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { tensor, randn, randint, zeros, tidy, keep, scopeDepth, liveTensors, manualSeed, setNumThreads } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { AdamW, warmupCosine } from '../src/optim/index.js';

setNumThreads(1);

// [Note: handle finalizers] dispose() frees a tensor's memory at once and leaves nothing native
// behind: handles are slots in the addon's table ([Note: handle table] in native/common.h), not
// N-API wrap objects, whose finalizers Node runs only between event-loop turns and which used to
// pile up and fragment the heap in loops that never yield. The GC backstop for forgotten tensors
// is a FinalizationRegistry; its cleanups do wait for the event loop.
const yieldToEventLoop = () => new Promise<void>((r) => setImmediate(r));
const outsideHeap = () => process.memoryUsage().rss - process.memoryUsage().heapTotal;

test('2,000 AdamW steps of a tiny GPT inside tidy(): live tensors constant, RSS flat', async () => {
  manualSeed(0);
  const model = new GPT({ vocabSize: 32, blockSize: 8, nLayer: 1, nHead: 2, nEmbd: 16, tieEmbeddings: true });
  const opt = new AdamW(model.parameters(), { lr: 1e-3, weightDecay: 0.1 });
  const sched = warmupCosine({ warmupSteps: 100, maxSteps: 2000, maxLr: 1e-3, minLr: 1e-4 });
  const data = keep(randint(0, 32, [64, 9]));
  let live = -1, rssAfterWarmup = 0, firstLoss = 0, lastLoss = 0;
  const steps = 2000, warmup = 200;
  for (let step = 0; step < steps; step++) {
    const loss = tidy(() => {
      const rows = data.narrow(0, (step * 2) % 64, 2);
      opt.lr = sched(step);
      opt.zeroGrad();
      const { loss } = model.forward(rows.narrow(1, 0, 8), rows.narrow(1, 1, 8));
      loss!.backward();
      opt.step();
      return loss!.item();
    });
    if (step === 0) firstLoss = loss;
    lastLoss = loss;
    assert.equal(scopeDepth(), 0);
    if (step === 1) live = liveTensors(); // after step 0 created grads and optimizer state
    else if (step > 1 && step % 100 === 0) assert.equal(liveTensors(), live, `live tensors changed by step ${step}`);
    if (step % 50 === 0) await yieldToEventLoop();
    if (step === warmup) rssAfterWarmup = outsideHeap();
  }
  assert.equal(liveTensors(), live);
  // Memory outside V8's heap (what a native leftover per step would grow); the JS heap itself
  // breathes with the garbage of each step and is not a leak.
  const growth = (outsideHeap() - rssAfterWarmup) / 2 ** 20;
  assert.ok(growth < 30, `memory outside the JS heap grew ${growth.toFixed(1)} MB between step ${warmup} and step ${steps}`);
  assert.ok(lastLoss < firstLoss, `it trained: ${firstLoss} -> ${lastLoss}`);
  model.dispose();
  data.dispose();
  for (const st of Object.values(opt.stateDict().state)) for (const t of Object.values(st)) t.dispose();
});

test('dispose() is idempotent and a disposed tensor gives a clear error', () => {
  const before = liveTensors();
  const t = randn([2, 2]);
  assert.equal(liveTensors(), before + 1);
  t.dispose();
  t.dispose();
  assert.equal(liveTensors(), before, 'the second dispose changed nothing');
  assert.equal(t.isDisposed, true);
  for (const use of [() => t.add(1), () => t.shape, () => t.toArray(), () => tidy(() => randn([2, 2]).matmul(t)), () => t.grad]) {
    assert.throws(use, /tensor was disposed \(used after dispose\(\) or after its tidy\(\) scope ended/);
  }
  const escaped = tidy(() => {
    const inner = randn([3]);
    return { kept: inner.mul(2), leaked: [inner] };
  });
  assert.equal(escaped.kept.isDisposed, false, 'returned tensors survive their scope');
  assert.equal(escaped.leaked[0]!.isDisposed, false, 'tensors in returned arrays survive too');
  escaped.kept.dispose();
  escaped.leaked[0]!.dispose();
  let outside: ReturnType<typeof randn> | undefined;
  tidy(() => {
    outside = randn([2]);
  });
  assert.throws(() => outside!.sum(), /tensor was disposed/);
  assert.equal(liveTensors(), before);
});

test('nested scopes: inner results move to the outer scope; keep() escapes every scope', () => {
  const before = liveTensors();
  let kept: ReturnType<typeof zeros> | undefined;
  const out = tidy(() => {
    const a = tidy(() => {
      kept = keep(zeros([2]));
      zeros([5]); // freed with the inner scope
      return ones2();
    });
    assert.equal(liveTensors(), before + 2, 'inner scope freed its temporary');
    return a.add(1);
  });
  assert.equal(liveTensors(), before + 2, 'out and kept remain');
  assert.deepEqual(out.toNumbers(), [2, 2]);
  out.dispose();
  kept!.dispose();
  assert.equal(liveTensors(), before);
  assert.throws(() => tidy(() => Promise.resolve(1)), /tidy\(\) takes a synchronous function/);
  assert.equal(scopeDepth(), 0);
});

function ones2() {
  return tensor([1, 1], { dtype: 'float32' });
}

test('forgotten tensors outside any scope are freed by the GC backstop', async () => {
  setFlagsFromString('--expose-gc');
  const gc = runInNewContext('gc') as () => void;
  const before = liveTensors();
  (() => {
    for (let i = 0; i < 500; i++) randn([64]);
  })();
  assert.ok(liveTensors() >= before + 500);
  for (let i = 0; i < 10 && liveTensors() > before + 50; i++) {
    gc();
    await new Promise((r) => setImmediate(r));
  }
  assert.ok(liveTensors() <= before + 50, `finalizers freed the handles: ${liveTensors() - before} left`);
});

test('a loop that never yields to the event loop keeps RSS flat too', () => {
  const before = liveTensors();
  const churn = (n: number) => {
    for (let i = 0; i < n; i++) zeros([16]).dispose();
  };
  churn(600_000); // lets V8's heap (short-lived JS objects) reach its working size first
  // Memory outside V8's heap: what a native leftover per handle would grow.
  const native = () => process.memoryUsage().rss - process.memoryUsage().heapTotal;
  const n0 = native();
  churn(300_000);
  const growth = (native() - n0) / 2 ** 20;
  assert.equal(liveTensors(), before);
  assert.ok(growth < 20, `memory outside the JS heap grew ${growth.toFixed(1)} MB over 300,000 create/dispose pairs without yielding`);
});
