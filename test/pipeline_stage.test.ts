// Pipeline building blocks on one process: the stage split, GPT stages that chain to the whole
// model, backward with `inputs` (weight-gradient kernels are skipped, not just discarded) and the
// zero-bubble I/W split of a Linear's gradient.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randn, randint, tidy, keep, manualSeed, setNumThreads, setDefaultDtype, backward, grad, noGrad, type Tensor } from '../src/tensor/index.js';
import { F } from '../src/nn/index.js';
import { GPT, GPTStage, gptLoss } from '../src/models/gpt.js';
import { planStages } from '../src/models/gpt_parallel.js';

setNumThreads(1);
setDefaultDtype('float64');

test('planStages: even split by block count, embeddings first, head last; cost-based split balances', () => {
  assert.deepEqual(planStages({ nLayer: 5 }, 2).map((s) => [s.layers, s.embed, s.head]), [[[0, 3], true, false], [[3, 5], false, true]]);
  assert.deepEqual(planStages({ nLayer: 4 }, 4).map((s) => s.layers), [[0, 1], [1, 2], [2, 3], [3, 4]]);
  assert.deepEqual(planStages({ nLayer: 3 }, 1), [{ layers: [0, 3], embed: true, head: true }]);
  // A heavy head (cost 3) pushes blocks to the first stage: [emb 1 + 3 blocks] = 4 vs [1 block + head 3] = 4.
  assert.deepEqual(planStages({ nLayer: 4 }, 2, [1, 1, 1, 1, 1, 3]).map((s) => s.layers), [[0, 3], [3, 4]]);
  assert.deepEqual(planStages({ nLayer: 4 }, 2, [0, 1, 1, 1, 1, 0]).map((s) => s.layers), [[0, 2], [2, 4]]);
  assert.throws(() => planStages({ nLayer: 2 }, 4), /4 stages need at least 4 blocks.*lower parallel\.pp/);
  assert.throws(() => planStages({ nLayer: 4 }, 2, [1, 1]), /costs must hold 6/);
});

test('GPT stages hold only their parts, start with the whole model\'s weights and chain to its logits and loss', () => {
  tidy(() => {
    for (const tie of [false, true]) {
      const cfg = { vocabSize: 32, blockSize: 8, nLayer: 3, nHead: 2, nEmbd: 8, dropout: 0, bias: true, tieEmbeddings: tie };
      const whole = new GPT(cfg, { initSeed: 5 });
      const specs = planStages(cfg, 2);
      const stages = specs.map((s) => new GPTStage(cfg, s, { initSeed: 5 }));
      const names0 = stages[0]!.namedParameters().map(([n]) => n);
      const names1 = stages[1]!.namedParameters().map(([n]) => n);
      assert.ok(names0.includes('wte.weight') && !names0.some((n) => n.startsWith('head') || n.startsWith('lnF')));
      assert.ok(names0.includes('layers.1.attn.qkv.weight') && !names0.some((n) => n.startsWith('layers.2')));
      assert.ok(names1.includes('layers.2.mlp.fc.weight') && names1.includes('lnF.weight') && !names1.includes('wpe.weight'));
      assert.equal(names1.includes('head.weight'), true, 'the last stage holds the head (its own copy when tied)');
      const wholeP = Object.fromEntries(whole.namedParameters());
      for (const st of stages) {
        for (const [n, p] of st.namedParameters()) {
          const full = st.fullName(n);
          assert.ok(full in wholeP, `${n} -> ${full}`);
          assert.deepEqual(p.toNumbers(), wholeP[full]!.toNumbers(), `${full} starts equal`);
        }
      }
      manualSeed(3);
      const x = randint(0, 32, [2, 8]), y = randint(0, 32, [2, 8]);
      const ref = whole.forward(x, y);
      const logits = stages[1]!.call(stages[0]!.call(x));
      assert.deepEqual(logits.toNumbers(), ref.logits.toNumbers());
      assert.equal(gptLoss(logits, y).item(), ref.loss!.item());
      for (const m of [whole, ...stages]) m.dispose();
    }
  });
});

test('backward with inputs skips the weight-gradient kernel; grad() returns gradients without accumulating', () => {
  tidy(() => {
    manualSeed(1);
    const w = randn([4, 3]).requiresGrad_(), x = randn([5, 3]).requiresGrad_();
    const wt = w.t(); // non-leaf: its hook fires only if the engine computes mm's weight-side gradient
    let weightSideRan = false;
    wt.registerHook(() => void (weightSideRan = true));
    const y = x.mm(wt).square().sum();
    backward([y], undefined, { inputs: [x] });
    assert.equal(weightSideRan, false, 'the weight-gradient kernel ran');
    assert.equal(w.grad, undefined);
    assert.ok(x.grad, 'the input gradient accumulated');
    const [gx, gw] = grad([x.mm(w.t()).square().sum()], [x, w]);
    assert.ok(gx && gw);
    assert.deepEqual(gx.toNumbers(), x.grad!.toNumbers());
    assert.equal(w.grad, undefined, 'grad() does not accumulate');
    assert.throws(() => backward([y], undefined, { inputs: [] }), /at least one tensor/);
  });
});

test('zero-bubble split of a Linear: I (inputs = [x]) then W = dy^T x equals one full backward', () => {
  tidy(() => {
    manualSeed(2);
    const w = randn([6, 4]).requiresGrad_(), b = randn([6]).requiresGrad_();
    const x0 = randn([2, 3, 4]);
    const full = (): { gx: Tensor; gw: Tensor; gb: Tensor } => {
      const x = x0.clone().requiresGrad_();
      F.linear(x, w, b).tanh().sum().backward();
      const r = { gx: x.grad!, gw: w.grad!.clone(), gb: b.grad!.clone() };
      w.grad = undefined;
      b.grad = undefined;
      return r;
    };
    const ref = full();
    const x = x0.clone().requiresGrad_();
    const out = F.linear(x, w, b);
    let dy: Tensor | undefined;
    out.registerHook((g) => void (dy = keep(g))); // the hook's call is a scope: keep what it stores
    backward([out.tanh().sum()], undefined, { inputs: [x] });
    assert.equal(w.grad, undefined);
    assert.ok(dy);
    const gw = noGrad(() => dy!.reshape(-1, 6).t().mm(x.reshape(-1, 4)));
    const gb = noGrad(() => dy!.reshape(-1, 6).sum(0));
    const close = (a: Tensor, e: Tensor, what: string) => {
      const d = a.sub(e).abs().max().item();
      assert.ok(d <= 1e-12, `${what}: ${d}`);
    };
    close(x.grad!, ref.gx, 'input gradient');
    close(gw, ref.gw, 'weight gradient');
    close(gb, ref.gb, 'bias gradient');
  });
});

test('config: [parallel] pp, ppSchedule, ppVirtualStages parse and are validated with messages that name the fix', async () => {
  const { parseConfig, checkRunnable, ConfigError } = await import('../src/config/index.js');
  const c = parseConfig('[parallel]\npp = 2\nppSchedule = "interleaved"\nppVirtualStages = 2\n[model]\nnLayer = 4\n');
  assert.equal(c.parallel.pp, 2);
  assert.equal(c.parallel.ppSchedule, 'interleaved');
  assert.equal(c.parallel.ppVirtualStages, 2);
  assert.deepEqual(checkRunnable({ ...c, data: { ...c.data, globalBatch: 8, microBatches: 4 } }, 4), []);
  assert.match(checkRunnable(c, 3).join('\n'), /parallel\.pp=2 does not divide the world of 3 rank\(s\)/);
  assert.match(checkRunnable({ ...c, parallel: { ...c.parallel, dp: 4 } }, 4).join('\n'), /parallel\.dp=4 but the world has 4 rank\(s\) over parallel\.pp=2.*--nproc 8/);
  assert.throws(() => parseConfig('', ['--parallel.ppSchedule=wavy']), (e: Error) => e instanceof ConfigError && /ppSchedule/.test(e.message));
  assert.throws(() => parseConfig('', ['--parallel.ppVirtualStages=2']), /ppVirtualStages=2 needs parallel\.ppSchedule = "interleaved"/);
  assert.throws(() => parseConfig('', ['--parallel.pp=4', '--model.nLayer=2']), /4 pipeline stages need model\.nLayer >= 4/);
});

test('measureGPTPartCosts times the embeddings, one block and the head; planStages splits by them', async () => {
  const { measureGPTPartCosts } = await import('../src/models/gpt_parallel.js');
  const cfg = { vocabSize: 32, blockSize: 16, nLayer: 6, nHead: 2, nEmbd: 16, dropout: 0, bias: true, tieEmbeddings: false };
  const costs = measureGPTPartCosts(cfg, { batch: 2, seqLen: 16, repeats: 1 });
  assert.equal(costs.length, 8);
  assert.ok(costs.every((c) => c >= 0 && Number.isFinite(c)), String(costs));
  assert.ok(costs.slice(1, 7).every((c) => c === costs[1]), 'every block costs the same');
  const plan = planStages(cfg, 3, costs);
  assert.deepEqual(plan.map((s) => s.layers[0]), [0, plan[1]!.layers[0], plan[2]!.layers[0]]);
  assert.equal(plan.at(-1)!.layers[1], 6);
  assert.ok(plan.every((s) => s.layers[1] > s.layers[0]), 'every stage holds a block');
});
