// The mixture-of-experts MLP against a plain PyTorch reference (test/oracle/moe.py: experts chosen
// by a Python sort, applied token by token) in float64: the layer's output and every gradient, and a
// small MoE GPT and MoE Llama (logits, loss, gradients), for topK 1 and 2, both routers, both balance
// modes, with and without shared experts, and with a capacity that drops tokens.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { manualSeed, noGrad, randn, randint, setNumThreads, tidy, zerosLike, type Tensor } from '../src/tensor/index.js';
import { MoE, type MoEConfig, type ExpertKind, defaultMoEConfig } from '../src/nn/moe.js';
import { GPT, gptNumParams } from '../src/models/gpt.js';
import { Llama, llamaNumParams } from '../src/models/llama.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';
import { assertClose, withFloat64 } from './oracle/check.js';

setNumThreads(1);
const skip = oracleMissing();
const TOL = 1e-10;

function moeCfg(m: Partial<MoEConfig>): MoEConfig {
  return { ...defaultMoEConfig, experts: 4, auxCoeff: 0.1, ...m };
}

/** Parameters far from their init so every choice and nonlinearity matters; the expert bias too. */
function scramble(named: [string, Tensor][], buffers: [string, Tensor][]): void {
  noGrad(() => {
    for (const [name, p] of named) {
      if (/(ln1|ln2|lnF|Norm|^norm)\.weight$/.test(name)) p.normal_(1, 0.2);
      else p.normal_(0, 0.5);
    }
    for (const [name, b] of buffers) if (name.endsWith('expertBias')) b.normal_(0, 0.3);
  });
}

function compareGrads(params: Record<string, Tensor>, ref: Record<string, Tensor>): void {
  assert.deepEqual(Object.keys(ref).filter((k) => k.startsWith('grad.') && k !== 'grad.x').map((k) => k.slice(5)).sort(), Object.keys(params).sort());
  for (const [name, p] of Object.entries(params)) {
    const r = ref[`grad.${name}`]!;
    assertClose(p.grad ?? zerosLike(p), r, { rtol: TOL, atol: TOL * Math.max(1e-3, ...r.abs().toNumbers()) }, `grad of ${name}`);
  }
}


function compareLayer(m: MoEConfig, kind: ExpertKind = 'gelu', bias = true): void {
  withFloat64(() => {
    manualSeed(7);
    const layer = new MoE(m, 6, 10, kind, bias);
    scramble(layer.namedParameters(), layer.namedBuffers());
    tidy(() => {
      const x = randn([2, 7, 6]).requiresGrad_();
      const w = randn([2, 7, 6]);
      const out = layer.call(x);
      out.mul(w).sum().backward();
      const stats = layer.takeStats();
      const inputs = { ...Object.fromEntries(layer.namedParameters()), ...Object.fromEntries(layer.namedBuffers()), x: x.detach(), w };
      const ref = runOracle('moe', inputs, { what: 'layer', kind, moe: m }).tensors;
      assertClose(out, ref.out!, { rtol: TOL, atol: TOL }, 'layer output');
      assertClose(x.grad!, ref['grad.x']!, { rtol: TOL, atol: TOL }, 'input gradient');
      compareGrads(Object.fromEntries(layer.namedParameters()), ref);
      assert.equal(stats.dropped, ref.dropped!.item(), 'dropped assignments');
      assert.equal(stats.tokens.reduce((a, b) => a + b, 0), 14 * m.topK, 'every assignment is counted');
      if (m.balance === 'aux') assert.ok(Math.abs(stats.auxSum - ref.aux!.item()) <= 1e-12 * Math.abs(ref.aux!.item()), `aux ${stats.auxSum} vs ${ref.aux!.item()}`);
      for (const t of Object.values(ref)) t.dispose();
    });
    layer.dispose();
  });
}

const layerCases: [string, Partial<MoEConfig>, ExpertKind?][] = [
  ['top-1 softmax, aux loss', { topK: 1, router: 'softmax', balance: 'aux' }],
  ['top-2 softmax, aux loss, a shared expert', { topK: 2, router: 'softmax', balance: 'aux', sharedExperts: 1 }],
  ['top-1 sigmoid, expert bias', { topK: 1, router: 'sigmoid', balance: 'bias' }],
  ['top-2 sigmoid, aux loss, two shared experts (tanh GELU)', { topK: 2, router: 'sigmoid', balance: 'aux', sharedExperts: 2 }, 'gelu-tanh'],
  ['top-2 softmax, expert bias, SwiGLU experts', { topK: 2, router: 'softmax', balance: 'bias' }, 'swiglu'],
  ['top-1 softmax, capacity 0.5 drops tokens', { topK: 1, capacityFactor: 0.5 }],
  ['top-2 sigmoid, capacity 1 drops tokens, expert bias, a shared expert', { topK: 2, router: 'sigmoid', balance: 'bias', capacityFactor: 1, sharedExperts: 1 }],
  // The chosen scores renormalised to sum 1 (Mixtral): the weights and the router's gradient through them.
  ['top-2 softmax renormalised (normTopK), aux loss, SwiGLU experts', { topK: 2, router: 'softmax', balance: 'aux', normTopK: true }, 'swiglu'],
  ['top-3 sigmoid renormalised (normTopK), capacity 1 drops tokens', { topK: 3, router: 'sigmoid', normTopK: true, capacityFactor: 1 }],
];

for (const [name, m, kind] of layerCases) {
  test(`MoE layer matches PyTorch: ${name}`, { skip }, () => compareLayer(moeCfg(m), kind ?? 'gelu', kind !== 'swiglu'));
}

test('a capacity factor below an even share drops assignments; only training forwards are counted', { skip }, () => {
  withFloat64(() => {
    manualSeed(3);
    const layer = new MoE(moeCfg({ topK: 2, capacityFactor: 0.5 }), 6, 10, 'gelu', true);
    scramble(layer.namedParameters(), []);
    noGrad(() => tidy(() => layer.train().forward(randn([2, 7, 6]))));
    // forward under noGrad records no statistics; under grad it does.
    assert.equal(layer.takeStats().forwards, 0);
    tidy(() => layer.call(randn([2, 7, 6]).requiresGrad_()));
    const s = layer.takeStats();
    // Capacity ceil(0.5 x 2 x 14 / 4) = 4 per expert: at most 16 of the 28 assignments are kept.
    assert.ok(s.dropped >= 28 - 16, `dropped ${s.dropped}`);
    layer.dispose();
  });
});

test('routing is deterministic: equal scores go to the lower expert index', () => {
  withFloat64(() => {
    const layer = new MoE(moeCfg({ topK: 2, experts: 5, router: 'sigmoid' }), 4, 8, 'gelu', true);
    noGrad(() => layer.router.zero_()); // every score 0.5: a tie between all five
    tidy(() => layer.call(randn([3, 4, 4]).requiresGrad_()));
    assert.deepEqual(layer.takeStats().tokens, [12, 12, 0, 0, 0]);
    layer.dispose();
  });
});

function compareModel(arch: 'gpt' | 'llama', m: MoEConfig, extra: Record<string, unknown> = {}): void {
  withFloat64(() => {
    const base = { vocabSize: 23, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 8, moe: m, ...extra };
    const model = arch === 'gpt' ? new GPT(base, { initSeed: 11 }) : new Llama({ ...base, intermediateSize: 12 }, { initSeed: 11 });
    assert.equal(model.numParams(), arch === 'gpt' ? gptNumParams(base) : llamaNumParams({ ...base, intermediateSize: 12 }));
    scramble(model.namedParameters(), model.namedBuffers());
    tidy(() => {
      manualSeed(5);
      const idx = randint(0, 23, [2, 8]), targets = randint(0, 23, [2, 8]);
      const { logits, loss } = model.forward(idx, targets);
      loss!.backward();
      const params = Object.fromEntries(model.namedParameters());
      const inputs = { ...params, ...Object.fromEntries(model.namedBuffers().filter(([n]) => n.endsWith('expertBias'))), idx, targets };
      const ref = runOracle('moe', inputs, { what: arch, ...model.cfg, moe: m }).tensors;
      assert.ok(Math.abs(loss!.item() - ref.loss!.item()) <= TOL * ref.loss!.item(), `loss ${loss!.item()} vs ${ref.loss!.item()}`);
      assertClose(logits, ref.logits!, { rtol: TOL, atol: TOL }, 'logits');
      compareGrads(params, ref);
      for (const t of Object.values(ref)) t.dispose();
    });
    model.dispose();
  });
}

test('MoE GPT matches PyTorch: every block top-2 softmax with aux loss and a shared expert', { skip }, () => {
  compareModel('gpt', moeCfg({ topK: 2, sharedExperts: 1 }));
});

test('MoE GPT matches PyTorch: every second block top-1 sigmoid with expert bias, capacity drops tokens, tied head', { skip }, () => {
  compareModel('gpt', moeCfg({ topK: 1, router: 'sigmoid', balance: 'bias', every: 2, capacityFactor: 1 }), { tieEmbeddings: true });
});

test('MoE Llama matches PyTorch: top-1 softmax with aux loss, capacity drops tokens', { skip }, () => {
  compareModel('llama', moeCfg({ topK: 1, capacityFactor: 0.75 }));
});

test('MoE Llama matches PyTorch: top-2 sigmoid with expert bias and a shared expert, grouped-query attention', { skip }, () => {
  compareModel('llama', moeCfg({ topK: 2, router: 'sigmoid', balance: 'bias', sharedExperts: 1 }), { nKvHead: 1 });
});
