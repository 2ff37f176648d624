// The planner's memory terms against the wrappers' own memory reports, in real 2-rank trainer runs
// (bench/zero_rss_rank.ts: each rank prints its MemoryReport after the last step): the parameter,
// gradient and optimizer terms the layout axes declare (src/plan, [Note: plan terms]) must match
// what every rank's wrapper says it holds. A pipeline run checks the per-stage split (the two ranks
// hold different parts), a ZeRO-2 run the sharded gradients and optimizer state, a LoRA run under
// ZeRO-3 a frozen base in bfloat16 (2 bytes an element, no gradient or optimizer state) beside its
// adapters. Three steps: the report is the last step's peak, and the first two also learn the
// gradients' order.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { measureRss } from './helpers/rss.js';
import { parseConfig } from '../src/config/index.js';
import { enumerateLayouts } from '../src/plan/enumerate.js';
import { modelFacts } from '../src/plan/facts.js';
import { budgetOf, contextFor } from '../src/plan/predict.js';
import { train } from '../src/train/trainer.js';
import { probeFlags } from '../src/plan/calibrate.js';

const MODEL = ['--model.nLayer=4', '--model.nEmbd=64', '--model.nHead=2', '--model.vocabSize=256', '--model.blockSize=32', '--data.seqLen=32', '--data.globalBatch=4', '--data.tokenizer=byte'];
const RUN = ['--train.steps=3', '--train.evalEvery=0', '--train.evalBatches=1', '--log.progress=off', '--checkpoint.every=0', '--parallel.backend=gloo'];

const dir = mkdtempSync(join(tmpdir(), 'flotilla-plan-memory-'));
test.after(() => rmSync(dir, { recursive: true, force: true }));

async function check(layout: string[]): Promise<{ planned: number; held: number }> {
  const cfg = parseConfig('', [...MODEL, ...layout], 'test');
  const facts = modelFacts(cfg);
  const l = enumerateLayouts(cfg, 2, new Set(['zero', 'pp', 'tp', 'cp', 'microBatches', 'activationCheckpoint', 'precision', 'dpReplicate', 'ppSchedule']))[0]!;
  assert.ok(l, `the planner lists ${layout.join(' ')}`);
  const ranks = await measureRss([...MODEL, ...RUN, `--train.runDir=${join(dir, layout.join('_'))}`, ...layout, ...l.overrides], { nproc: 2 });
  assert.equal(ranks.length, 2);
  let planned = 0, held = 0;
  for (const r of ranks) {
    const stage = l.layout.pp > 1 ? r.rank : 0; // pp = 2 on 2 ranks: rank r runs stage r
    const b = budgetOf(contextFor(cfg, l.layout, facts, { nproc: 2, nnodes: 1 }, stage));
    const rep = r.memory!;
    assert.ok(rep, `rank ${r.rank} reported its memory`);
    const near = (pred: number, got: number, what: string, tol = 0.02) =>
      assert.ok(Math.abs(pred - got) <= tol * got + 4096, `rank ${r.rank} ${what}: planned ${pred} B, the wrapper holds ${got} B (${l.overrides.join(' ')})`);
    near(b.memory.parameters, rep.paramBytes, 'parameters');
    near(b.memory.optimizer, rep.optimizerBytes, 'optimizer state');
    // The report's peak: the most parameter + gradient bytes held at once in the step, plus the optimizer.
    near(b.memory.parameters + b.memory.gradients + b.memory.commBuffers + b.memory.zero3Gathers + b.memory.optimizer, rep.peakBytes, 'step peak of the buffers', 0.1);
    planned += b.memory.parameters + b.memory.gradients + b.memory.optimizer;
    held += rep.paramBytes + rep.gradBytes + rep.optimizerBytes;
  }
  return { planned, held };
}

test('the planned parameter, gradient and optimizer bytes of a 2-stage pipeline match each rank\'s report', async () => {
  await check(['--parallel.pp=2', '--parallel.dp=1', '--data.microBatches=2']);
});

test('the planned bytes of ZeRO-2 on 2 ranks match each rank\'s report', async () => {
  await check(['--parallel.zero=2', '--parallel.bucketSizeMb=0.05']);
});

test('the planned bytes of a LoRA run with a bfloat16 base under ZeRO-3 match each rank\'s report, and are a fraction of full fine-tuning\'s', async () => {
  // The base: the same model after one step of training, as a checkpoint.
  const baseDir = join(dir, 'base');
  await train(parseConfig('', [...MODEL, ...RUN, '--train.steps=1', '--checkpoint.every=1', `--train.runDir=${baseDir}`], 'test'), { print: () => {} });
  const zero3 = ['--parallel.zero=3'];
  const lora = await check([...zero3, '--lora.rank=4', '--lora.baseDtype=bf16', `--train.initFrom=${join(baseDir, 'checkpoints', 'step-000001')}`]);
  const full = await check(zero3);
  // Adapters of rank 4 on the 4 Linears of 4 blocks of width 64 (qkv 64 -> 192, proj 64 -> 64,
  // fc 64 -> 256, proj 256 -> 64): 16,384 trainable at 16 bytes; the base at 2 bytes instead of 16.
  assert.ok(lora.planned < 0.2 * full.planned, `LoRA planned ${lora.planned} B, full fine-tuning ${full.planned} B`);
  assert.ok(lora.held < 0.2 * full.held, `LoRA holds ${lora.held} B, full fine-tuning ${full.held} B`);
});

test('calibration\'s probe models start from random weights: a LoRA config\'s probes leave out its base and adapters', () => {
  const cfg = parseConfig('', [...MODEL, '--lora.rank=4', '--lora.baseDtype=bf16', `--train.initFrom=${dir}`], 'test');
  assert.equal(modelFacts(cfg).lora?.baseBytes, 2);
  const probe = parseConfig('', [...MODEL, '--lora.rank=4', '--lora.baseDtype=bf16', `--train.initFrom=${dir}`, ...probeFlags(cfg)], 'test');
  assert.equal(probe.lora.rank, 0);
  assert.equal(probe.train.initFrom, '');
});
