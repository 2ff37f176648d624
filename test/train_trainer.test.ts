// The trainer in-process on one rank: phases, files in the run directory, reproducibility, no leaks.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { train } from '../src/train/trainer.js';
import { loadConfig, parseConfig } from '../src/config/index.js';
import { readMetrics } from '../src/train/metrics.js';
import { tensorCacheStats, zeros } from '../src/tensor/index.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-trainer-'));

/** A model small enough that 20 steps take a few seconds on one thread. */
export const TINY = [
  '--model.nLayer=1', '--model.nHead=2', '--model.nEmbd=32', '--model.blockSize=32',
  '--data.seqLen=32', '--data.globalBatch=8',
  '--optim.lr=3e-3', '--optim.minLr=3e-4', '--optim.warmupSteps=2',
  '--train.steps=20', '--train.evalEvery=10', '--train.evalBatches=2', '--log.progress=plain', '--log.every=5',
];

async function run(name: string, extra: string[] = []) {
  const cfg = parseConfig('', [...TINY, `--train.runDir=${join(dir, name)}`, ...extra]);
  const lines: string[] = [];
  const steps: { loss: number; live: number }[] = [];
  const summary = await train(cfg, { print: (l) => lines.push(l), onStep: (m) => steps.push({ loss: m.loss, live: m.liveTensors }) });
  return { cfg, lines, steps, summary, runDir: join(dir, name) };
}

test('one-process training: phase headers, falling loss, metrics and resolved config on disk', async () => {
  const r = await run('a');
  for (const phase of ['world', 'data', 'model', 'parallelize', 'optimizer', 'train', 'done']) {
    assert.ok(r.lines.some((l) => l.startsWith(`[${phase}] `)), `no [${phase}] header in:\n${r.lines.join('\n')}`);
  }
  assert.ok(r.lines.some((l) => /^step +5\/20 \| loss \d\.\d{4} \| val - \| lr /.test(l)), r.lines.join('\n'));
  assert.equal(r.summary.steps, 20);
  assert.ok(r.summary.finalLoss < r.summary.firstLoss - 1, `loss ${r.summary.firstLoss} -> ${r.summary.finalLoss}`);

  const m = readMetrics(join(r.runDir, 'metrics.jsonl'));
  assert.deepEqual(m.map((x) => x.step), Array.from({ length: 20 }, (_, i) => i + 1));
  assert.deepEqual(m.filter((x) => x.valLoss !== undefined).map((x) => x.step), [10, 20]);
  for (const x of m) {
    assert.ok(Number.isFinite(x.loss) && x.lr > 0 && x.tokensPerSec > 0 && (x.gradNorm ?? 0) > 0, JSON.stringify(x));
  }
  assert.equal(m[19]!.valLoss, r.summary.finalValLoss);
  assert.ok(m[19]!.valLoss! < m[9]!.valLoss!, 'validation loss falls');

  const saved = loadConfig(join(r.runDir, 'config.toml'));
  assert.deepEqual(saved, r.cfg);
  assert.match(readFileSync(join(r.runDir, 'config.toml'), 'utf8'), /^# Resolved config of run "run"/);
});

test('same seed, same losses; another seed, other losses', async () => {
  const a = await run('b1');
  const b = await run('b2');
  const c = await run('b3', ['--train.seed=7']);
  assert.deepEqual(b.steps.map((s) => s.loss), a.steps.map((s) => s.loss));
  assert.notDeepEqual(c.steps.map((s) => s.loss), a.steps.map((s) => s.loss));
});

test('each step frees its temporaries (live tensor count is flat)', async () => {
  const r = await run('c', ['--train.steps=12', '--train.evalEvery=4']);
  const live = r.steps.map((s) => s.live);
  // From step 2 on (optimizer state exists), the count never moves, eval steps included.
  assert.ok(live.slice(1).every((n) => n === live[1]), `live tensors per step: ${live.join(' ')}`);
});

test('freed tensor memory no step reuses goes back after a step ([Note: tensor cache]), not only at the end of the run', async () => {
  // A 68 MiB block freed before the run: nothing this model makes takes a block that size.
  const MiB = 2 ** 20;
  zeros([17 * MiB]).dispose();
  const before = tensorCacheStats();
  assert.ok(before.on && before.cachedBytes >= 68 * MiB, `the cache should keep the freed block (${JSON.stringify(before)})`);
  const kept: number[] = [];
  const cfg = parseConfig('', [...TINY, `--train.runDir=${join(dir, 'trim')}`, '--train.steps=3']);
  await train(cfg, { print: () => {}, onStep: () => kept.push(tensorCacheStats().cachedBytes) });
  assert.ok(kept.every((b) => b < 68 * MiB), `cached bytes after each step: ${kept.join(', ')} (the 68 MiB block should be gone after the first)`);
});

test('micro-batches accumulate to the same training as one big batch', async () => {
  const one = await run('d1', ['--train.steps=8']);
  const four = await run('d4', ['--train.steps=8', '--data.microBatches=4']);
  one.steps.forEach((s, i) => {
    const rel = Math.abs(four.steps[i]!.loss - s.loss) / s.loss;
    assert.ok(rel < 1e-5, `step ${i + 1}: ${four.steps[i]!.loss} vs ${s.loss}`);
  });
});

test('metrics off writes no metrics file', async () => {
  const r = await run('e', ['--train.steps=2', '--log.metrics=', '--log.progress=off']);
  assert.ok(existsSync(join(r.runDir, 'config.toml')));
  assert.ok(!existsSync(join(r.runDir, 'metrics.jsonl')));
  assert.deepEqual(r.lines, [], 'progress off prints nothing');
});

test('the trainer stays one readable loop: train() within 100 lines, and it imports no model and no report', () => {
  const src = readFileSync(join(import.meta.dirname, '..', 'src', 'train', 'trainer.ts'), 'utf8').split('\n');
  const start = src.findIndex((l) => l.startsWith('export async function train('));
  const end = src.findIndex((l, i) => i > start && l === '}');
  assert.ok(start >= 0 && end > start, 'train() found in src/train/trainer.ts');
  assert.ok(end - start + 1 <= 100, `train() is ${end - start + 1} lines; move a phase into src/train/phases.ts or a helper beside it`);
  const imports = src.filter((l) => /^import .* from '/.test(l)).map((l) => /from '([^']+)'/.exec(l)![1]!);
  assert.deepEqual(imports.filter((m) => /\/models\/|\/report\//.test(m)), [], 'the trainer reaches models through the registry and leaves the report to the CLI');
});
