// The loss of a masked global batch against PyTorch (test/oracle/masked_loss.py, float64): a GPT
// under data parallelism over 2 ranks (test/fixtures/masked_loss_rank.ts), whose 4 one-row
// micro-batches train 8, 0, 1 and 4 targets, reports the sum of the cross-entropy over the 13 trained
// targets over 13, and every rank's gradients are that loss's. The mean of the per-micro-batch means
// (what the layouts computed before, with the empty micro-batch left out) differs from it, so the
// comparison tells them apart. A second batch trains nothing on any rank: count 0, loss 0, and no
// gradient is made or reduced (the trainer then skips the optimizer step).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runWorld, describeWorld, parseResults } from './helpers/world.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';
import { tensor, setNumThreads, type Tensor } from '../src/tensor/index.js';
import { CFG, ROWS, T, TRAINED, type Out } from './fixtures/masked_loss_case.js';
import { criterionOf } from '../src/parallel/loss_reduction.js';
import type { StageValue } from '../src/parallel/parallel_model.js';
import type { StepMetrics } from '../src/train/metrics.js';
import { metricCharts } from '../src/report/charts.js';

setNumThreads(1);
const skip = oracleMissing();
const world = runWorld({ nproc: 2, script: 'test/fixtures/masked_loss_rank.ts', timeoutMs: 120_000 });
world.catch(() => {}); // reported by the test that awaits it

test('masked loss under data parallelism = PyTorch CE_sum / N_global (not the mean of micro-batch means); a batch with no trained target makes no gradient on any rank', { skip }, async () => {
  const r = await world;
  assert.deepEqual(r.codes, [0, 0], describeWorld(r));
  const outs = parseResults<Out>(r.outputs).sort((a, b) => a.rank - b.rank);
  assert.equal(outs.length, 2);
  const zero = outs[0]!;
  const inputs: Record<string, Tensor> = {
    idx: tensor(BigInt64Array.from(zero.idx!, (v) => BigInt(v))).reshape(ROWS, T),
    targets: tensor(BigInt64Array.from(zero.targets!, (v) => BigInt(v))).reshape(ROWS, T),
  };
  for (const [k, v] of Object.entries(zero.params!)) inputs[k] = tensor(v, { dtype: 'float64' }).reshape(zero.shapes![k]!);
  const ref = runOracle('masked_loss', inputs, { ...CFG, micro: ROWS }).tensors;
  const N = TRAINED.reduce((a, t) => a + t.length, 0);
  assert.equal(ref.count!.item(), N);
  const want = ref.loss!.item();
  const meanOfMeans = ref.meanOfMeans!.item();
  assert.ok(Math.abs(meanOfMeans - want) > 1e-3 * Math.abs(want), `the batch must tell the global mean (${want}) from the mean of means (${meanOfMeans})`);
  for (const o of outs) {
    assert.equal(o.count, N, `rank ${o.rank}: the global count`);
    assert.ok(Math.abs(o.loss - want) <= 1e-12 * Math.abs(want), `rank ${o.rank}: loss ${o.loss} vs PyTorch ${want}`);
    for (const [k, g] of Object.entries(o.grads)) {
      const t = ref[`grad.${k}`]!.toNumbers();
      const scale = Math.max(...t.map(Math.abs));
      const worst = g.reduce((a, v, i) => Math.max(a, Math.abs(v - t[i]!)), 0);
      assert.ok(worst <= 1e-11 * scale, `rank ${o.rank}: gradient of ${k} differs from PyTorch's by ${worst} (largest ${scale})`);
    }
    assert.deepEqual(o.empty, { loss: 0, count: 0, gradsChanged: [] }, `rank ${o.rank}: the batch with no trained target`);
  }
});

test('criterionOf: a LossFn that only means counts 1 per micro-batch, one that reduces counts trained targets and sums, a Criterion is kept', () => {
  const y = tensor(BigInt64Array.from([3n, -100n, 1n, -100n, -100n, 0n])).reshape(2, 3);
  const out = tensor([[1, 2, 3], [4, 5, 6]], { dtype: 'float64' });
  const seen: (string | undefined)[] = [];
  const loss = (o: StageValue, _t: StageValue, opts?: { reduction?: 'mean' | 'sum' }): Tensor => {
    seen.push(opts?.reduction);
    return (o as Tensor).sum();
  };
  const mean = criterionOf(loss);
  assert.equal(mean.count({ x: out, y }), 1);
  assert.equal(mean.apply(out, { x: out, y }).value, 21);
  const token = criterionOf(Object.assign(loss, { reduces: true }));
  assert.equal(token.count({ x: out, y }), 3);
  assert.equal(token.apply(out, { x: out, y }).value, 21);
  assert.deepEqual(seen, [undefined, 'sum']);
  const own = { count: () => 2, apply: () => ({ loss: out.sum(), value: 1 }) };
  assert.equal(criterionOf(own), own);
});

test('the report charts trained tokens per step when they vary (masked data), not for a text run', () => {
  const row = (step: number, trainedTokens: number): StepMetrics => ({ step, loss: 1, lr: 1e-3, tokensPerSec: 1, elapsedS: step, trainedTokens });
  const ids = (t: number[]) => metricCharts([{ name: 'r', metrics: t.map((n, i) => row(i + 1, n)) }]).map((c) => c.id);
  assert.ok(ids([120, 0, 87]).includes('trained-tokens'));
  assert.ok(!ids([256, 256, 256]).includes('trained-tokens'));
});
