// The planner's memory terms against the wrappers' own memory reports, in real 2-rank trainer runs
// (bench/zero_rss_rank.ts: each rank prints its MemoryReport after the last step): the parameter,
// gradient and optimizer terms the layout axes declare (src/plan, [Note: plan terms]) must match
// what every rank's wrapper says it holds. A pipeline run checks the per-stage split (the two ranks
// hold different parts), a ZeRO-2 run the sharded gradients and optimizer state. Three steps: the
// report is the last step's peak, and the first two also learn the gradients' order.
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

const MODEL = ['--model.nLayer=4', '--model.nEmbd=64', '--model.nHead=2', '--model.vocabSize=256', '--model.blockSize=32', '--data.seqLen=32', '--data.globalBatch=4', '--data.tokenizer=byte'];
const RUN = ['--train.steps=3', '--train.evalEvery=0', '--train.evalBatches=1', '--log.progress=off', '--checkpoint.every=0', '--parallel.backend=gloo'];

const dir = mkdtempSync(join(tmpdir(), 'flotilla-plan-memory-'));
test.after(() => rmSync(dir, { recursive: true, force: true }));

async function check(layout: string[]): Promise<void> {
  const cfg = parseConfig('', [...MODEL, ...layout], 'test');
  const facts = modelFacts(cfg);
  const l = enumerateLayouts(cfg, 2, new Set(['zero', 'pp', 'tp', 'cp', 'microBatches', 'activationCheckpoint', 'precision', 'dpReplicate', 'ppSchedule']))[0]!;
  assert.ok(l, `the planner lists ${layout.join(' ')}`);
  const ranks = await measureRss([...MODEL, ...RUN, `--train.runDir=${join(dir, layout.join('_'))}`, ...layout, ...l.overrides], { nproc: 2 });
  assert.equal(ranks.length, 2);
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
  }
}

test('the planned parameter, gradient and optimizer bytes of a 2-stage pipeline match each rank\'s report', async () => {
  await check(['--parallel.pp=2', '--parallel.dp=1', '--data.microBatches=2']);
});

test('the planned bytes of ZeRO-2 on 2 ranks match each rank\'s report', async () => {
  await check(['--parallel.zero=2', '--parallel.bucketSizeMb=0.05']);
});
