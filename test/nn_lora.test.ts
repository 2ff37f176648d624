// LoRA adapters (src/nn/lora.ts): a Llama and a GPT with adapters on every linear layer against a
// float64 PyTorch oracle of their own (test/oracle/lora.py: nn.Linear with a frozen base plus A and
// B); step 0 equals the base; merge, unmerge and the off switch; the errors a user can cause.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { manualSeed, noGrad, randint, setNumThreads, tidy, type Tensor } from '../src/tensor/index.js';
import { Linear } from '../src/nn/layers.js';
import { autocast } from '../src/nn/precision.js';
import { applyLora, hfModuleNames, loraAdapterOf, loraAdapters, mergeLora, unmergeLora, withAdaptersDisabled, type AppliedLora } from '../src/nn/lora.js';
import { Llama, ropeInverseFrequencies, type LlamaConfig } from '../src/models/llama.js';
import { GPT, type GPTConfig } from '../src/models/gpt.js';
import { llamaHf } from '../src/models/llama_hf.js';
import { gpt2Hf } from '../src/models/gpt_hf.js';
import { parallelizeModule } from '../src/parallel/tensor_parallel/styles.js';
import type { ProcessGroup } from '../src/distributed/process_group.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';
import { scaledErr, withFloat64 } from './oracle/check.js';

setNumThreads(1);
const skip = oracleMissing();
const TOL = 1e-12; // float64 rounding, scaled by each tensor's largest magnitude


const LLAMA: Partial<LlamaConfig> = { vocabSize: 29, blockSize: 16, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 16, intermediateSize: 24 };
const GPT_CFG: Partial<GPTConfig> = { vocabSize: 31, blockSize: 16, nLayer: 2, nHead: 2, nEmbd: 12, gelu: 'tanh' };

function llama(): Llama {
  manualSeed(7);
  const m = new Llama(LLAMA);
  noGrad(() => {
    for (const [n, p] of m.namedParameters()) {
      if (/[Nn]orm\.weight$/.test(n)) p.normal_(1, 0.3);
      else p.normal_(0, 0.4);
    }
  });
  return m;
}

function gpt(): GPT {
  manualSeed(8);
  const m = new GPT(GPT_CFG);
  noGrad(() => {
    for (const [n, p] of m.namedParameters()) {
      if (/ln\w*\.weight$/.test(n)) p.normal_(1, 0.3);
      else p.normal_(0, 0.4);
    }
  });
  return m;
}

/** Bit-for-bit equality. */
const same = (a: Tensor, b: Tensor): boolean => {
  const x = a.toNumbers(), y = b.toNumbers();
  return x.length === y.length && x.every((v, i) => Object.is(v, y[i]));
};

/** Gives every adapter's B nonzero values (B starts at zero), so A's gradients and the forward see it. */
function trainedLook(applied: AppliedLora): void {
  noGrad(() => {
    for (const a of applied.adapters.values()) a.B.weight.normal_(0, 0.3);
  });
}

function againstOracle(model: Llama | GPT, applied: AppliedLora, extra: Record<string, unknown>): void {
  tidy(() => {
    const idx = randint(0, model.cfg.vocabSize, [2, 9]), targets = randint(0, model.cfg.vocabSize, [2, 9]);
    const { logits, loss } = model.forward(idx, targets);
    loss!.backward();
    const params = Object.fromEntries(model.namedParameters());
    const scale = [...applied.adapters.values()][0]!.scale;
    const ref = runOracle('lora', { ...params, idx, targets }, { ...model.cfg, ...extra, scale, adapted: [...applied.adapters.keys()] }).tensors;
    const rel = Math.abs(loss!.item() - ref.loss!.item()) / Math.abs(ref.loss!.item());
    assert.ok(rel <= TOL, `loss ${loss!.item()} vs PyTorch ${ref.loss!.item()} (relative ${rel})`);
    assert.ok(scaledErr(logits, ref.logits!) <= TOL, `logits differ: ${scaledErr(logits, ref.logits!)}`);
    assert.deepEqual(Object.keys(ref).filter((k) => k.startsWith('grad.')).map((k) => k.slice(5)).sort(), [...applied.trainable].sort());
    for (const name of applied.trainable) {
      const e = scaledErr(params[name]!.grad!, ref[`grad.${name}`]!);
      assert.ok(e <= TOL, `grad of ${name}: ${e}`);
    }
    for (const name of applied.frozen) assert.equal(params[name]!.grad, undefined, `${name} is frozen and has no gradient`);
    for (const t of Object.values(ref) as Tensor[]) t.dispose();
  });
}

test('a Llama with adapters on every linear layer matches the float64 oracle: logits, loss, adapter gradients', { skip }, () => {
  withFloat64(() => {
    const model = llama();
    const applied = applyLora(model, { rank: 3, alpha: 5, targets: ['all-linear'], initSeed: 11 });
    const expected = [0, 1].flatMap((i) => ['attn.q', 'attn.k', 'attn.v', 'attn.o', 'mlp.gate', 'mlp.up', 'mlp.down'].map((n) => `layers.${i}.${n}`));
    assert.deepEqual([...applied.adapters.keys()].sort(), expected.sort(), '"all-linear" is every Linear but the head');
    assert.ok(applied.trainable.every((n) => /\.lora[AB]\.weight$/.test(n)) && applied.trainable.length === 2 * expected.length);
    assert.ok(applied.frozen.includes('layers.0.attn.q.weight') && applied.frozen.includes('head.weight'), 'base names are unchanged');
    trainedLook(applied);
    againstOracle(model, applied, { arch: 'llama', invFreq: ropeInverseFrequencies(model.cfg) });
    model.dispose();
  });
});

test('a GPT with adapters on c_attn, c_proj and c_fc (Hugging Face names) matches the float64 oracle, rsLora', { skip }, () => {
  withFloat64(() => {
    const model = gpt();
    const applied = applyLora(model, { rank: 2, alpha: 3, rsLora: true, targets: ['c_attn', 'c_proj', 'c_fc'], hfNames: hfModuleNames(gpt2Hf.tensors(model.cfg)), initSeed: 3 });
    const expected = [0, 1].flatMap((i) => ['attn.qkv', 'attn.proj', 'mlp.fc', 'mlp.proj'].map((n) => `layers.${i}.${n}`));
    assert.deepEqual([...applied.adapters.keys()].sort(), expected.sort());
    assert.equal([...applied.adapters.values()][0]!.scale, 3 / Math.sqrt(2));
    assert.ok(applied.frozen.includes('layers.0.attn.qkv.bias'), 'biases stay frozen (PEFT bias "none")');
    trainedLook(applied);
    againstOracle(model, applied, { arch: 'gpt' });
    model.dispose();
  });
});

test('step 0 equals the base exactly; merge, unmerge and disabled adapters', () => {
  withFloat64(() => {
    const model = llama();
    const idx = randint(0, 29, [2, 7]);
    const base = model.forward(idx).logits;
    const weights = new Map(model.namedParameters().map(([n, p]) => [n, p.clone()]));
    const applied = applyLora(model, { rank: 4, alpha: 8, dropout: 0.1, targets: ['q_proj', 'v_proj', 'down_proj'], hfNames: hfModuleNames(llamaHf.tensors(model.cfg)), initSeed: 1 });
    assert.deepEqual([...applied.adapters.keys()], ['layers.0.attn.q', 'layers.0.attn.v', 'layers.0.mlp.down', 'layers.1.attn.q', 'layers.1.attn.v', 'layers.1.mlp.down']);
    model.eval(); // dropout off (it reaches the adapters' dropout too)
    assert.ok(loraAdapters(model).every(([, a]) => !a.dropout.training));
    // PEFT's init: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_ with a = sqrt(5)), B = 0.
    const a0 = applied.adapters.get('layers.0.attn.q')!;
    assert.ok(Math.max(...a0.A.weight.abs().toNumbers()) <= 1 / Math.sqrt(16) && a0.A.weight.abs().sum().item() > 0);
    assert.equal(a0.B.weight.abs().sum().item(), 0);
    assert.equal(a0.scale, 2);
    assert.ok(same(model.forward(idx).logits, base), 'step 0 is the base, bit for bit');

    trainedLook(applied);
    const adapted = model.forward(idx).logits;
    assert.ok(scaledErr(adapted, base) > 1e-3, 'trained adapters change the output');
    const off = withAdaptersDisabled(model, () => model.forward(idx).logits);
    assert.ok(same(off, base), 'disabled adapters are the base alone, bit for bit');
    assert.ok(same(model.forward(idx).logits, adapted), 'adapters are back on after the scope');

    mergeLora(model);
    assert.ok(a0.merged);
    const merged = model.forward(idx).logits;
    assert.ok(scaledErr(merged, adapted) <= 1e-13, `merged forward vs unmerged: ${scaledErr(merged, adapted)}`);
    assert.throws(() => a0.merge(), /already merged; unmerge\(\) it first/);
    unmergeLora(model);
    // W + d - d is W within one rounding of each element (not bit for bit in general).
    for (const [n, p] of model.namedParameters()) {
      const w = weights.get(n);
      if (!w) continue;
      assert.ok(scaledErr(p, w) <= 1e-15, `${n} after unmerge: ${scaledErr(p, w)}`);
    }
    assert.ok(scaledErr(model.forward(idx).logits, adapted) <= 1e-13);
    for (const t of weights.values()) t.dispose();
    model.dispose();
  });
});

test('only the adapters train: the base keeps its names and gets no gradient', () => {
  const model = llama();
  const names = model.namedParameters().map(([n]) => n);
  const applied = applyLora(model, { rank: 2, targets: ['q', 'layers.1.mlp.up'] });
  const after = model.namedParameters().map(([n]) => n);
  assert.deepEqual(after.filter((n) => !/\.lora[AB]\.weight$/.test(n)), names, 'base parameter names and order are unchanged');
  assert.deepEqual(applied.trainable.sort(), ['layers.0.attn.q.loraA.weight', 'layers.0.attn.q.loraB.weight', 'layers.1.attn.q.loraA.weight', 'layers.1.attn.q.loraB.weight', 'layers.1.mlp.up.loraA.weight', 'layers.1.mlp.up.loraB.weight']);
  assert.ok(model.namedParameters().every(([n, p]) => p.requiresGrad === applied.trainable.includes(n)));
  assert.ok(model.layers.items[0]!.attn.q instanceof Linear, 'the Linear is adapted in place');
  tidy(() => {
    const { loss } = model.forward(randint(0, 29, [2, 5]), randint(0, 29, [2, 5]));
    loss!.backward();
    for (const [n, p] of model.namedParameters()) assert.equal(p.grad !== undefined, applied.trainable.includes(n), n);
  });
  model.dispose();
});

test('under bf16-mixed an adapter runs through the precision policy: step 0 is the base bit for bit, and A and B get float32 gradients', () => {
  const model = llama();
  const idx = randint(0, 29, [2, 6]), targets = randint(0, 29, [2, 6]);
  const base = autocast('bf16-mixed', () => model.forward(idx).logits);
  const applied = applyLora(model, { rank: 2, alpha: 4, targets: ['all-linear'], initSeed: 5 });
  assert.ok(same(autocast('bf16-mixed', () => model.forward(idx).logits), base), 'B = 0: the bfloat16 forward is the base');
  trainedLook(applied);
  tidy(() => {
    const loss = autocast('bf16-mixed', () => {
      const out = model.forward(idx, targets);
      out.loss!.backward();
      return out.loss!;
    });
    const f32 = model.forward(idx, targets).loss!;
    assert.ok(Math.abs(loss.item() - f32.item()) / f32.item() < 2e-2, `bf16-mixed loss ${loss.item()} vs float32 ${f32.item()}`);
    for (const a of applied.adapters.values()) {
      for (const p of [a.A.weight, a.B.weight]) {
        assert.equal(p.dtype, 'float32');
        assert.equal(p.grad!.dtype, 'float32');
        assert.ok(p.grad!.abs().sum().item() > 0 && Number.isFinite(p.grad!.sum().item()));
      }
    }
  });
  model.dispose();
});

test('LoRA errors name the fix', () => {
  const model = llama();
  const hfNames = hfModuleNames(llamaHf.tensors(model.cfg));
  assert.throws(() => applyLora(model, { rank: 2, targets: ['qkv'], hfNames }),
    /target "qkv" matches no Linear of this model; its Linears are named .*"down", "down_proj", .*"q", "q_proj".* \(or use "all-linear"\)/);
  assert.throws(() => applyLora(model, { rank: 0, targets: ['q'] }), /rank must be a positive whole number, got 0/);
  assert.throws(() => applyLora(model, { rank: -1, targets: ['q'] }), /rank must be a positive whole number/);
  // k is (nKvHead x headDim = 8) x 16: a rank of 9 does not fit it.
  assert.throws(() => applyLora(model, { rank: 9, targets: ['q', 'k'] }), /rank 9 is larger than the smaller dimension of layers\.0\.attn\.k \(8 x 16\); use a rank of at most 8/);
  assert.throws(() => applyLora(model, { rank: 2, targets: [] }), /no targets/);
  assert.equal(loraAdapters(model).length, 0, 'a refused call injects nothing');
  assert.ok(model.namedParameters().every(([, p]) => p.requiresGrad), 'and freezes nothing');
  applyLora(model, { rank: 2, targets: ['q'] });
  assert.throws(() => applyLora(model, { rank: 2, targets: ['q'] }), /already has an adapter; apply LoRA once/);
  // Tensor parallelism splits an adapter with its base (test/lora_tp.test.ts trains it): q is
  // column-parallel, so B keeps q's output rows of this rank and A stays whole.
  const g = { rank: 0, size: 2 } as ProcessGroup;
  const applied = parallelizeModule(model, g, { 'layers.*.attn': 'prepareInput', 'layers.*.attn.q': { kind: 'colwise', input: 'prepared' } });
  const q = model.layers.items[0]!.attn.q;
  const a = loraAdapterOf(q)!;
  assert.deepEqual([q.weight.shape, a.B.weight.shape, a.A.weight.shape], [[8, 16], [8, 2], [2, 16]]);
  applied.dispose();
  model.dispose();
});
