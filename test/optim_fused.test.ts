// The one-pass optimizer updates ([Note: fused optimizer] in native/optim.cc), chosen by
// kernels = "fused" ([Note: kernel choice]), against the op-by-op updates in float64: AdamW with and
// without weight decay (two groups in one flat bucket: ranges of different decay), several steps
// (bias correction), and SGD plain, with momentum and dampening, and Nesterov; a bfloat16 gradient
// under float32 parameters; and the trainer's optimizer step inside the choice. With clipping, the
// fused update takes clipping's factor ([Note: folded clip]) and equals clipping in place then the
// op-by-op step, as does the op-by-op step handed the factor.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import * as ft from '../src/tensor/index.js';
import { native } from '../src/tensor/native.js';
import { GPT } from '../src/models/gpt.js';
import { AdamW, SGD, type Optimizer } from '../src/optim/index.js';
import { withKernels } from '../src/nn/kernels/choice.js';
import { fusedAdamW } from '../src/optim/fused.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { clipFactor } from '../src/parallel/grads.js';
import { clippedStep } from '../src/optim/clipped_step.js';

ft.setNumThreads(1);
const cfg = { vocabSize: 64, blockSize: 16, nLayer: 2, nHead: 2, nEmbd: 32 };

/** Counts the calls of the addon's fused updates while fn runs. */
function countingKernels<R>(fn: () => R): { result: R; calls: number } {
  const a = native.adamwStep, s = native.sgdStep;
  let calls = 0;
  native.adamwStep = (...args) => (calls++, a(...args));
  native.sgdStep = (...args) => (calls++, s(...args));
  try {
    return { result: fn(), calls };
  } finally {
    native.adamwStep = a;
    native.sgdStep = s;
  }
}

function groups(m: GPT, decay: number) {
  const named = m.namedParameters();
  return [
    { params: named.filter(([, p]) => p.ndim >= 2).map(([, p]) => p), options: { weightDecay: decay } },
    { params: named.filter(([, p]) => p.ndim < 2).map(([, p]) => p), options: { weightDecay: 0 } },
  ];
}

type Make = (ps: ReturnType<typeof groups>, x: { grads: DataParallel<GPT> }) => Optimizer<{ lr: number }>;

/**
 * How a step clips to maxNorm: as the trainer does (clippedStep: in place under eager, folded into
 * the update under fused), or the factor handed to the optimizer's step.
 */
type Clip = { maxNorm: number; via: 'clippedStep' | 'stepScale' };

/**
 * Trains one GPT over DataParallel's flat buckets (a world of one) for `steps` steps, the updates by
 * `kernels`, clipped by `clip`; `norms`: the norms before clipping.
 */
function train(make: Make, decay: number, steps: number, kernels: 'eager' | 'fused', clip?: Clip): { params: number[][]; calls: number; norms: number[] } {
  const world = initProcessGroup();
  try {
    const m = new GPT(cfg, { initSeed: 3 });
    const dp = new DataParallel(m, { group: world, bucketSizeMb: 0.05 });
    const opt = make(groups(m, decay), { grads: dp });
    let calls = 0;
    const norms: number[] = [];
    const step = () => {
      if (!clip) return opt.step();
      if (clip.via === 'clippedStep') return norms.push(clippedStep(dp, opt, clip.maxNorm));
      const { norm, scale } = clipFactor(dp, clip.maxNorm);
      norms.push(norm);
      opt.step({ gradScale: scale });
    };
    for (let s = 0; s < steps; s++) {
      ft.tidy(() => {
        opt.zeroGrad();
        ft.manualSeed(100 + s);
        const d = ft.randint(0, 64, [4, 17]);
        dp.forward(d.narrow(1, 0, 16), d.narrow(1, 1, 16)).loss!.backward();
        dp.finishGradSync();
        opt.lr = 3e-3 * (1 + s / 4); // a schedule moves lr between steps
        calls += countingKernels(() => withKernels(kernels, step)).calls;
      });
    }
    const params = m.parameters().map((p) => p.toNumbers());
    dp.dispose();
    opt.dispose();
    return { params, calls, norms };
  } finally {
    destroyProcessGroup();
  }
}

/** Largest difference relative to max(|x|, 1e-3) over every element. */
function maxRel(a: number[][], b: number[][]): number {
  let worst = 0;
  a.forEach((x, i) => x.forEach((v, k) => (worst = Math.max(worst, Math.abs(v - b[i]![k]!) / Math.max(1e-3, Math.abs(b[i]![k]!))))));
  return worst;
}

test('fused AdamW and SGD steps equal the op-by-op steps over flat buckets in float64 (decay ranges, bias correction, momentum, Nesterov)', () => {
  ft.setDefaultDtype('float64');
  try {
    const cases: [string, Make, number][] = [
      ['AdamW, weight decay 0.1 on matrices', (ps, x) => new AdamW(ps, { lr: 3e-3, betas: [0.9, 0.95] }, x), 0.1],
      ['AdamW, no weight decay', (ps, x) => new AdamW(ps, { lr: 3e-3, eps: 1e-6 }, x), 0],
      ['SGD plain, L2 decay', (ps, x) => new SGD(ps, { lr: 3e-3 }, x), 0.1],
      ['SGD momentum 0.9, dampening 0.1', (ps, x) => new SGD(ps, { lr: 3e-3, momentum: 0.9, dampening: 0.1 }, x), 0.01],
      ['SGD Nesterov', (ps, x) => new SGD(ps, { lr: 3e-3, momentum: 0.9, nesterov: true }, x), 0.01],
    ];
    for (const [name, make, decay] of cases) {
      const eager = train(make, decay, 4, 'eager'), fused = train(make, decay, 4, 'fused');
      assert.equal(eager.calls, 0, `${name}: the eager step calls no fused kernel`);
      assert.ok(fused.calls >= 4, `${name}: the fused step calls the kernel (${fused.calls} calls)`);
      const d = maxRel(fused.params, eager.params);
      // float64 rounding: the kernel contracts products into fused multiply-adds, and AdamW's
      // m / sqrt(v) amplifies the last bits where gradients are near zero; a wrong term moves
      // parameters by about lr (3e-3).
      assert.ok(d <= 1e-10, `${name}: fused and eager parameters differ by ${d} after 4 steps`);
      // And the steps moved the parameters (so equal results mean equal updates).
      assert.ok(maxRel(eager.params, train(make, decay, 0, 'eager').params) > 1e-4, `${name}: the steps moved the parameters`);
    }
  } finally {
    ft.setDefaultDtype('float32');
  }
});

test('clipping folded into the fused AdamW and SGD updates equals clipping in place then stepping op by op (float64)', () => {
  ft.setDefaultDtype('float64');
  try {
    const maxNorm = 0.05;
    const cases: [string, Make, number][] = [
      ['AdamW, weight decay 0.1 on matrices', (ps, x) => new AdamW(ps, { lr: 3e-3, betas: [0.9, 0.95] }, x), 0.1],
      ['SGD momentum 0.9, L2 decay', (ps, x) => new SGD(ps, { lr: 0.1, momentum: 0.9 }, x), 0.01],
    ];
    for (const [name, make, decay] of cases) {
      const eager = train(make, decay, 3, 'eager', { maxNorm, via: 'clippedStep' });
      assert.ok(eager.norms.every((n) => n > maxNorm), `${name}: every step clipped (norms ${eager.norms})`);
      assert.equal(eager.calls, 0, `${name}: the eager step calls no fused kernel`);
      const unclipped = train(make, decay, 3, 'eager');
      assert.ok(maxRel(unclipped.params, eager.params) > 1e-4, `${name}: clipping changed the steps`);
      for (const [how, r] of [['fused, folded', train(make, decay, 3, 'fused', { maxNorm, via: 'clippedStep' })], ['op by op, the factor handed to step', train(make, decay, 3, 'eager', { maxNorm, via: 'stepScale' })]] as const) {
        const d = maxRel(r.params, eager.params);
        assert.ok(d <= 1e-10, `${name}, ${how}: parameters differ from clip-then-step by ${d}`);
        r.norms.forEach((n, s) => assert.ok(Math.abs(n - eager.norms[s]!) <= 1e-12 * n, `${name}, ${how}: norm at step ${s} ${n} vs ${eager.norms[s]}`));
      }
    }
  } finally {
    ft.setDefaultDtype('float32');
  }
});

test('the fused AdamW update takes a bfloat16 gradient under float32 parameters: the float32 update of that gradient', () => ft.tidy(() => {
  ft.manualSeed(5);
  const n = 70_001; // not a multiple of the vector width or the parallel grain
  const p0 = ft.randn([n]), g16 = ft.randn([n]).to('bfloat16'), m0 = ft.randn([n]).mul(0.1), v0 = ft.rand([n]).mul(0.01);
  const o = { lr: 1e-2, betas: [0.9, 0.999] as [number, number], eps: 1e-8, weightDecay: 0.1 };
  // Eager: the optimizer's own step on the gradient's float32 value, from the same state at update 3.
  const p = p0.clone(), opt = new AdamW([p], o);
  const st = opt.paramState(p, { create: true })!;
  st.state.expAvg!.copy_(m0);
  st.state.expAvgSq!.copy_(v0);
  opt.setParamStep(p, 2);
  p.grad = g16.float();
  opt.step();
  const fp = p0.clone(), fm = m0.clone(), fv = v0.clone();
  ft.noGrad(() => fusedAdamW({ param: fp, grad: g16, state: { expAvg: fm, expAvgSq: fv }, step: 3, weightDecay: 0.1, gradScale: 1 }, o));
  for (const [what, a, b] of [['parameters', fp, p], ['exp_avg', fm, st.state.expAvg!], ['exp_avg_sq', fv, st.state.expAvgSq!]] as const) {
    // float32 rounding of the terms (the largest elements' scale): fused multiply-adds round differently.
    const d = a.sub(b).abs().max().item() / b.abs().max().item();
    assert.ok(d <= 1e-6, `${what}: fused with a bf16 gradient and eager with its float32 value differ by ${d}`);
  }
  assert.ok(fp.sub(p0).abs().max().item() > 1e-3, 'the step moved the parameters');
  opt.dispose();
}));
