// AdamW and SGD against torch.optim on the same parameters and gradient sequence (float64, every
// parameter after every step), AdamW training a small GPT for 20 steps in float32, and the schedule.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { tensor, tidy, keep, randint, manualSeed, setNumThreads, type Tensor } from '../src/tensor/index.js';
import { AdamW, SGD, warmupCosine, type AdamWOptions, type SGDOptions, type Optimizer } from '../src/optim/index.js';
import { GPT } from '../src/models/gpt.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';
import { assertClose, uniformArray, scaledErr } from './oracle/check.js';

setNumThreads(1);
const skip = oracleMissing();

interface Plan<O> {
  optimizer: 'adamw' | 'sgd';
  shapes: number[][];
  groups: { params: number[]; options: O }[];
  steps: number;
  /** [step, param] pairs that get no gradient at that step. */
  noGrad?: [number, number][];
  lrs?: number[];
}

/** Runs the plan in flotilla and in PyTorch and compares every parameter after every step. */
function comparePlan<O extends { lr: number }>(plan: Plan<O>, make: (groups: { params: Tensor[]; options: O }[]) => Optimizer<O>, rtol: number): void {
  tidy(() => {
    const init = plan.shapes.map((s, i) => tensor(Float64Array.from(uniformArray(s.reduce((a, b) => a * b, 1), 10 + i)), { shape: s }));
    const grads = new Map<string, Tensor>();
    const skipped = new Set((plan.noGrad ?? []).map(([s, i]) => `${s}.${i}`));
    for (let s = 0; s < plan.steps; s++) {
      plan.shapes.forEach((shape, i) => {
        if (skipped.has(`${s}.${i}`)) return;
        // Gradients of varying scale and sign, so moments and momentum matter.
        const scale = 0.1 + (s % 5);
        grads.set(`${s}.${i}`, tensor(Float64Array.from(uniformArray(init[i]!.numel(), 1000 * s + i, -scale, scale)), { shape }));
      });
    }
    const inputs: Record<string, Tensor> = {};
    init.forEach((p, i) => (inputs[`p.${i}`] = p));
    for (const [k, g] of grads) inputs[`g.${k}`] = g;
    const ref = runOracle('optim', inputs, plan).tensors;

    const params = init.map((p) => keep(p.clone().requiresGrad_()));
    const opt = make(plan.groups.map((g) => ({ params: g.params.map((i) => params[i]!), options: g.options })));
    for (let s = 0; s < plan.steps; s++) {
      if (plan.lrs) opt.lr = plan.lrs[s]!;
      params.forEach((p, i) => (p.grad = grads.get(`${s}.${i}`)?.clone()));
      opt.step();
      params.forEach((p, i) => assertClose(p, ref[`p.${s}.${i}`]!, { rtol, atol: 1e-14 }, `${plan.optimizer} step ${s} param ${i}`));
    }
    for (const p of params) p.dispose();
  });
}

const adamw = (groups: { params: Tensor[]; options: AdamWOptions }[]) => new AdamW(groups, { lr: 0 });
const sgd = (groups: { params: Tensor[]; options: SGDOptions }[]) => new SGD(groups, { lr: 0 });

test('AdamW matches torch.optim.AdamW over 20 steps (two groups, weight decay, changing lr)', { skip }, () => {
  const sched = warmupCosine({ warmupSteps: 5, maxSteps: 20, maxLr: 1e-2, minLr: 1e-3 });
  comparePlan<AdamWOptions>({
    optimizer: 'adamw', shapes: [[3, 4], [4], [2, 2, 3]], steps: 20,
    groups: [
      { params: [0, 2], options: { lr: 1e-2, betas: [0.9, 0.95], eps: 1e-8, weightDecay: 0.1 } },
      { params: [1], options: { lr: 1e-2, betas: [0.8, 0.999], eps: 1e-6, weightDecay: 0 } },
    ],
    lrs: Array.from({ length: 20 }, (_, s) => sched(s)),
  }, adamw, 1e-12);
});

test('AdamW: a parameter without a gradient is skipped and keeps its own step count (bias correction)', { skip }, () => {
  comparePlan<AdamWOptions>({
    optimizer: 'adamw', shapes: [[5], [3]], steps: 8,
    groups: [{ params: [0, 1], options: { lr: 0.05, betas: [0.9, 0.999], eps: 1e-8, weightDecay: 0.01 } }],
    // Parameter 1 joins at step 3 and misses step 5: its bias correction must count its own steps.
    noGrad: [[0, 1], [1, 1], [2, 1], [5, 1]],
  }, adamw, 1e-12);
});

test('SGD matches torch.optim.SGD: plain, momentum, dampening, Nesterov, weight decay', { skip }, () => {
  const o = (x: Partial<SGDOptions>): SGDOptions => ({ lr: 0.1, momentum: 0, dampening: 0, weightDecay: 0, nesterov: false, ...x });
  comparePlan<SGDOptions>({
    optimizer: 'sgd', shapes: [[4], [2, 3], [3], [5]], steps: 20,
    groups: [
      { params: [0], options: o({}) },
      { params: [1], options: o({ momentum: 0.9, weightDecay: 0.01 }) },
      { params: [2], options: o({ momentum: 0.8, dampening: 0.3, lr: 0.05 }) },
      { params: [3], options: o({ momentum: 0.9, nesterov: true, weightDecay: 0.1, lr: 0.02 }) },
    ],
    noGrad: [[4, 1], [7, 3]],
  }, sgd, 1e-12);
});

test('AdamW trains a small GPT for 20 steps exactly as torch.optim.AdamW does (float32)', { skip }, () => {
  manualSeed(7);
  const cfg = { vocabSize: 29, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 16, dropout: 0, bias: true, tieEmbeddings: true };
  const model = new GPT(cfg);
  const o: AdamWOptions = { lr: 3e-3, betas: [0.9, 0.95], eps: 1e-8, weightDecay: 0.1 };
  const steps = 20;
  tidy(() => {
    const inputs: Record<string, Tensor> = Object.fromEntries(model.namedParameters().map(([n, p]) => [n, p.detach().clone()]));
    // Three batches in turn: every step sees different data, and the loss on a batch can be compared
    // with the loss on the same batch earlier.
    const batches = [0, 1, 2].map(() => [randint(0, cfg.vocabSize, [4, 8]), randint(0, cfg.vocabSize, [4, 8])] as const);
    for (let s = 0; s < steps; s++) {
      inputs[`idx.${s}`] = batches[s % 3]![0];
      inputs[`targets.${s}`] = batches[s % 3]![1];
    }
    const ref = runOracle('gpt', inputs, { ...cfg, adamwSteps: steps, adamw: o }).tensors;
    const opt = new AdamW(model.parameters(), o);
    const losses: number[] = [];
    for (let s = 0; s < steps; s++) {
      tidy(() => {
        opt.zeroGrad();
        const { loss } = model.forward(inputs[`idx.${s}`]!, inputs[`targets.${s}`]!);
        loss!.backward();
        opt.step();
        losses.push(loss!.item());
      });
    }
    assertClose(losses, ref.losses!, { rtol: 1e-5 }, 'loss per step');
    assert.ok(losses[18]! < losses[0]! - 0.1, `the loss on batch 0 went down: ${losses[0]} -> ${losses[18]}`);
    for (const [n, p] of model.namedParameters()) {
      const err = scaledErr(p, ref[`param.${n}`]!);
      assert.ok(err <= 1e-5, `${n} after ${steps} steps differs from PyTorch by ${err}`);
    }
  });
  model.dispose();
});

test('warmupCosine: linear warmup to maxLr, cosine to minLr at maxSteps, flat after', () => {
  const o = { warmupSteps: 10, maxSteps: 110, maxLr: 1e-3, minLr: 1e-4 };
  const f = warmupCosine(o);
  for (let s = 0; s < 10; s++) assert.ok(Math.abs(f(s) - (1e-3 * (s + 1)) / 10) < 1e-18, `warmup step ${s}`);
  assert.equal(f(9), 1e-3);
  assert.equal(f(10), 1e-3, 'the peak, cosine at 0');
  assert.ok(Math.abs(f(60) - 5.5e-4) < 1e-15, 'halfway between maxLr and minLr');
  assert.ok(Math.abs(f(35) - (1e-4 + 0.5 * (1 + Math.cos(Math.PI / 4)) * 9e-4)) < 1e-15, 'a quarter of the way');
  assert.equal(f(110), 1e-4);
  assert.equal(f(1000), 1e-4);
  for (let s = 10; s < 110; s++) assert.ok(f(s + 1) <= f(s), `non-increasing after warmup at ${s}`);
  const noWarm = warmupCosine({ warmupSteps: 0, maxSteps: 4, maxLr: 1, minLr: 0 });
  assert.deepEqual([0, 1, 2, 3, 4].map((s) => +noWarm(s).toFixed(12)), [1, 0.853553390593, 0.5, 0.146446609407, 0]);
  assert.throws(() => warmupCosine({ warmupSteps: -1, maxSteps: 10, maxLr: 1, minLr: 0 }), /warmupSteps >= 0/);
});
