// Mixture of experts in the config and the trainer: [moe] validation, the metrics a run writes
// (tokens per expert, auxiliary loss, dropped tokens), the expert-bias update, the auxiliary loss's
// gradient scale, and MoE models through one-process training.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { manualSeed, noGrad, randn, setDefaultDtype, tidy } from '../src/tensor/index.js';
import { autocast, BF16_MIXED_OPS } from '../src/nn/precision.js';
import { MoE, defaultMoEConfig, withMoELossScale } from '../src/nn/moe.js';
import { parseConfig } from '../src/config/index.js';
import { layoutProblems } from '../src/parallel/layout.js';
import { train } from '../src/train/trainer.js';
import { readMetrics, type StepMetrics } from '../src/train/metrics.js';
import { expertImbalance, metricCharts } from '../src/report/charts.js';
import { exportCheckpoint } from '../src/checkpoint/export.js';
import { exportCheckpointHf } from '../src/checkpoint/hf.js';
import { readSafetensorsHeader } from '../src/checkpoint/safetensors.js';
import { assertClose } from './oracle/check.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-moe-'));
const TINY = [
  '--model.nHead=2', '--model.nEmbd=32', '--model.blockSize=32', '--data.seqLen=32', '--data.globalBatch=8',
  '--optim.lr=3e-3', '--optim.minLr=3e-4', '--optim.warmupSteps=2', '--train.evalBatches=1', '--log.progress=off',
];

function problemsOf(overrides: string[]): string {
  try {
    parseConfig('', ['--model.nLayer=2', ...overrides]);
    return '';
  } catch (e) {
    return (e as Error).message;
  }
}

test('[moe] problems name the field and the fix', () => {
  assert.equal(problemsOf(['--moe.experts=4', '--moe.topK=2']), '');
  assert.match(problemsOf(['--moe.experts=4', '--moe.topK=5']), /moe\.topK \(5\) must be <= moe\.experts \(4\); lower moe\.topK or raise moe\.experts/);
  assert.match(problemsOf(['--moe.experts=4', '--moe.every=3']), /moe\.every \(3\) is above model\.nLayer \(2\).*lower moe\.every/);
  assert.match(problemsOf(['--moe.experts=4', '--moe.router=relu']), /moe\.router must be one of "softmax", "sigmoid"/);
  assert.match(problemsOf(['--moe.experts=4', '--moe.capacityFactor=-1']), /moe\.capacityFactor/);
  assert.match(problemsOf(['--moe.experts=4', '--parallel.tp=2', '--parallel.sequenceParallel=true']), /moe\.experts > 0 does not run with parallel\.sequenceParallel yet.*set parallel\.sequenceParallel = false/);
  assert.match(problemsOf(['--moe.experts=6', '--parallel.ep=4']), /moe\.experts \(6\) must divide by parallel\.ep \(4\)/);
  assert.match(problemsOf(['--parallel.ep=2']), /parallel\.ep = 2 splits experts, but moe\.experts = 0/);
  // On a world: ep must divide the shard ranks of one replica (HSDP), and the data-parallel degree.
  const base = parseConfig('', ['--model.nLayer=2', '--moe.experts=4']).parallel;
  assert.match(layoutProblems({ ...base, ep: 4, zero: 1, dpShard: 2, dpReplicate: 2 }, 4).join('\n'), /parallel\.ep = 4 must divide parallel\.dpShard \(2\)/);
  assert.match(layoutProblems({ ...base, ep: 4 }, 2).join('\n'), /parallel\.ep = 4 must divide the 2 data-parallel rank\(s\)/);
  assert.deepEqual(layoutProblems({ ...base, ep: 2, zero: 3, dpShard: 2, dpReplicate: 2 }, 4), []);
  // experts = 0: the other fields are not looked at.
  assert.equal(problemsOf(['--moe.topK=5']), '');
});

test('the expert bias moves by biasRate toward an even load, outside the gradient', () => {
  const layer = new MoE({ ...defaultMoEConfig, experts: 4, balance: 'bias', biasRate: 0.1 }, 4, 8, 'gelu', true);
  layer.updateBias([10, 2, 4, 4]); // mean 5
  assertClose(layer.expertBias!, [-0.1, 0.1, 0.1, 0.1], { rtol: 1e-6 }, 'bias after one update');
  layer.updateBias([5, 5, 5, 5]);
  assertClose(layer.expertBias!, [-0.1, 0.1, 0.1, 0.1], { rtol: 1e-6 }, 'an even load leaves it');
  assert.equal(layer.expertBias!.requiresGrad, false);
  layer.dispose();
});

test('the auxiliary loss gradient scales with withMoELossScale, linearly', () => {
  setDefaultDtype('float64');
  try {
    manualSeed(2);
    const layer = new MoE({ ...defaultMoEConfig, experts: 4, topK: 2, auxCoeff: 0.5 }, 6, 8, 'gelu', true);
    noGrad(() => { for (const p of layer.parameters()) p.normal_(0, 0.5); });
    const x = randn([2, 5, 6]), w = randn([2, 5, 6]);
    const gradAt = (scale: number): number[] => tidy(() => {
      for (const p of layer.parameters()) p.grad?.zero_();
      withMoELossScale(scale, () => layer.call(x).mul(w).sum().backward());
      return layer.router.grad!.toNumbers();
    });
    const g0 = gradAt(0), g1 = gradAt(1), gh = gradAt(0.5);
    assertClose(gh, g0.map((a, i) => (a + g1[i]!) / 2), { rtol: 1e-12, atol: 1e-14 }, 'router gradient at scale 1/2');
    assert.ok(g0.some((a, i) => Math.abs(a - g1[i]!) > 1e-6), 'the auxiliary loss reaches the router');
    layer.dispose();
    x.dispose(); w.dispose();
  } finally {
    setDefaultDtype('float32');
  }
});

test('under bf16-mixed the router scores in float32 (the same choices as float32) while the experts run in bfloat16', () => {
  manualSeed(4);
  const layer = new MoE({ ...defaultMoEConfig, experts: 8, topK: 2, sharedExperts: 1 }, 16, 32, 'gelu', true);
  noGrad(() => { for (const p of layer.parameters()) p.normal_(0, 0.3); });
  assert.equal(BF16_MIXED_OPS.router, 'float32');
  tidy(() => {
    const x = randn([4, 16, 16]);
    const f32 = layer.call(x.requiresGrad_());
    const tokens32 = layer.takeStats().tokens;
    const b16 = autocast('bf16-mixed', () => layer.call(x));
    const tokens16 = layer.takeStats().tokens;
    assert.deepEqual(tokens16, tokens32, 'the same experts chosen');
    assert.equal(b16.dtype, 'float32', 'the block returns the residual stream\'s dtype');
    const diff = b16.sub(f32).abs().max().item(), scale = f32.abs().max().item();
    assert.ok(diff > 1e-5 * scale && diff < 0.05 * scale, `bf16 experts differ from float32 by ${diff} of ${scale}`);
  });
  layer.dispose();
});

async function run(name: string, extra: string[]) {
  const cfg = parseConfig('', [...TINY, '--model.nLayer=2', '--train.steps=6', '--train.evalEvery=0', `--train.runDir=${join(dir, name)}`, ...extra]);
  const summary = await train(cfg, { print: () => {} });
  return { cfg, summary, metrics: readMetrics(join(dir, name, 'metrics.jsonl')) };
}

test('an MoE GPT trains in one process; metrics hold tokens per expert, the auxiliary loss and dropped tokens', async () => {
  const r = await run('gpt', ['--moe.experts=4', '--moe.topK=2', '--moe.every=2', '--moe.capacityFactor=1', '--moe.sharedExperts=1']);
  const tokens = 8 * 32 * 2; // global batch x seqLen x topK
  for (const m of r.metrics) {
    assert.deepEqual(Object.keys(m.expertTokens!), ['layers.1.mlp'], 'one MoE block (every = 2 of 2)');
    const counts = m.expertTokens!['layers.1.mlp']!;
    assert.equal(counts.length, 4);
    assert.equal(counts.reduce((a, b) => a + b, 0), tokens);
    assert.ok(Number.isFinite(m.auxLoss!) && m.auxLoss! > 0, `aux ${m.auxLoss}`);
    assert.ok(Number.isInteger(m.droppedTokens!) && m.droppedTokens! >= 0 && m.droppedTokens! === counts.reduce((a, c) => a + Math.max(0, c - 128), 0), `dropped ${m.droppedTokens}`);
  }
  assert.ok(r.summary.finalLoss < r.summary.firstLoss, `loss ${r.summary.firstLoss} -> ${r.summary.finalLoss}`);
});

test('an MoE checkpoint exports as one file that carries the [moe] section, and refuses the Hugging Face form with the way out', async () => {
  const r = await run('export', ['--moe.experts=4', '--moe.topK=2', '--checkpoint.every=6']);
  const out = join(dir, 'moe.safetensors');
  exportCheckpoint(r.summary.checkpoint!, out);
  const model = JSON.parse(readSafetensorsHeader(out).metadata['flotilla.model']!) as { moe?: { experts: number; topK: number } };
  assert.equal(model.moe?.experts, 4);
  assert.equal(model.moe?.topK, 2);
  assert.throws(() => exportCheckpointHf(r.summary.checkpoint!, join(dir, 'hf')), /mixture-of-experts model \(moe\.experts = 4\), which has no Hugging Face form.*flotilla export .* out\.safetensors/);
});

test('full activation checkpointing counts each MoE forward once (its recompute in backward is not counted) and trains the same', async () => {
  const moe = ['--moe.experts=4', '--moe.topK=2', '--moe.capacityFactor=1', '--train.steps=3'];
  const plain = await run('ac_none', moe);
  const full = await run('ac_full', [...moe, '--train.activationCheckpoint=full']);
  assert.deepEqual(full.metrics.map((m) => [m.loss, m.expertTokens, m.droppedTokens, m.auxLoss]), plain.metrics.map((m) => [m.loss, m.expertTokens, m.droppedTokens, m.auxLoss]));
});

test('an MoE Llama with expert bias trains in one process; no auxiliary loss is reported', async () => {
  const r = await run('llama', ['--model.arch=llama', '--moe.experts=4', '--moe.router=sigmoid', '--moe.balance=bias', '--moe.biasRate=0.01']);
  for (const m of r.metrics) {
    assert.deepEqual(Object.keys(m.expertTokens!).sort(), ['layers.0.mlp', 'layers.1.mlp']);
    assert.equal(m.auxLoss, undefined);
    assert.equal(m.droppedTokens, undefined);
  }
  assert.ok(r.summary.finalLoss < r.summary.firstLoss, `loss ${r.summary.firstLoss} -> ${r.summary.finalLoss}`);
});

test('the report draws the expert load (max / mean, worst block), the auxiliary loss and dropped tokens, only for MoE runs', () => {
  const row = (step: number, extra: Partial<StepMetrics>): StepMetrics => ({ step, loss: 3, lr: 1e-3, tokensPerSec: 1, elapsedS: step, ...extra });
  assert.equal(expertImbalance(row(1, { expertTokens: { 'layers.0.mlp': [4, 2, 2, 0], 'layers.1.mlp': [3, 3, 1, 1] } })), 2);
  assert.equal(expertImbalance(row(1, {})), undefined);
  const moe = metricCharts([{ name: 'moe', metrics: [row(1, { expertTokens: { 'layers.0.mlp': [2, 2] }, auxLoss: 1.1, droppedTokens: 3 })] }]).map((c) => c.id);
  const dense = metricCharts([{ name: 'dense', metrics: [row(1, {})] }]).map((c) => c.id);
  for (const id of ['expert-load', 'aux-loss', 'dropped-tokens']) {
    assert.ok(moe.includes(id), `${id} in ${moe.join(', ')}`);
    assert.ok(!dense.includes(id), `${id} not in a dense run's charts`);
  }
});
