// `flotilla train` with train.objective = "dpo" on a preference dataset: the reference a frozen copy
// (2 ranks) or the policy's LoRA adapters off (on a base the first run saved), live or computed once
// before step 0 (dpo.precompute, kept in RUN/reference and read back on resume). The first step's
// log-ratios are exactly 0 (loss ln 2); the metrics carry the pairs and the rewards; the precomputed
// reference trains exactly as the live one.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { writeExampleDataset, type FixtureDoc } from './fixtures/example_shards.js';
import { tinyGptToml } from './fixtures/tiny_gpt.js';
import { flotilla } from './helpers/cli.js';
import { readMetrics, type StepMetrics } from '../src/train/metrics.js';
import { WordCounter, trainBpe } from '../src/data/bpe_train.js';

/** Pair i: a shared prompt, then two responses of their own lengths (trained), ids 1..255. */
function pairDocs(n: number): FixtureDoc[] {
  const out: FixtureDoc[] = [];
  for (let i = 0; i < n; i++) {
    const prompt = Array.from({ length: 3 + (i % 4) }, (_, k) => 1 + ((i * 13 + k * 5) % 255));
    for (const r of [0, 1]) {
      const response = Array.from({ length: 2 + ((i * 7 + r * 3) % 9) }, (_, k) => 1 + ((i * 31 + r * 101 + k * 11) % 255));
      out.push({ ids: [...prompt, ...response], trained: [...prompt.map(() => 0), ...response.map(() => 1)] });
    }
  }
  return out;
}

const metricsOf = (dir: string): StepMetrics[] => readMetrics(join(dir, 'metrics.jsonl'));

test('flotilla train: DPO against a frozen copy on 2 ranks, precomputed and live alike; LoRA with its adapters off as the reference', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-dpo-train-'));
  try {
    const counts = new WordCounter();
    counts.add('preference pairs for the tiny model');
    const tokenizer = join(dir, 'tokenizer.json');
    writeFileSync(tokenizer, JSON.stringify(trainBpe(counts.counts, 300).json));
    writeExampleDataset(join(dir, 'pairs'), 'preference', [pairDocs(24)], tokenizer);
    const config = join(dir, 'dpo.toml');
    writeFileSync(config, tinyGptToml({
      model: { dropout: 0.1 },
      data: { source: join(dir, 'pairs'), format: 'preference', pack: true, tokenizer, globalBatch: 4, valFraction: 0.2 },
      train: { objective: 'dpo', steps: 4, evalEvery: 2, evalBatches: 1 },
      dpo: { beta: 0.5 },
      optim: { schedule: 'constant', lr: 1e-2 },
      parallel: { backend: 'gloo' },
      checkpoint: { every: 2, keep: 10 },
      log: { progress: 'plain', every: 1 },
    }));
    const live = await flotilla(['train', config, '--nproc', '2', `--train.runDir=${join(dir, 'live')}`]);
    assert.equal(live.code, 0, live.out + live.err);
    assert.match(live.out, /\[dpo\] DPO \(sigmoid, beta 0\.5\) against a frozen copy of the starting weights; dropout off \(model\.dropout and lora\.dropout set to 0 for DPO\)/);
    assert.match(live.out, /\[dpo\] reference: a frozen copy of the starting weights, placed by the same layout, each step/);
    const a = metricsOf(join(dir, 'live'));
    assert.equal(a.length, 4);
    assert.deepEqual([a[0]!.rewardsChosen, a[0]!.rewardsRejected, a[0]!.rewardsMargin], [0, 0, 0], 'the first step\'s log-ratios are exactly 0');
    assert.ok(Math.abs(a[0]!.loss - Math.LN2) < 1e-6, `first loss ${a[0]!.loss}`);
    for (const m of a) assert.ok(Number.isInteger(m.pairs) && m.pairs! >= 4 && m.trainedTokens === undefined, `the global batch's pairs (4 packed rows): ${m.pairs}`);
    assert.ok(a[3]!.loss < a[0]!.loss && a[3]!.rewardsMargin! > 0, `DPO learns: ${a.map((m) => m.loss).join(', ')}`);
    assert.ok(a.every((m) => m.rewardsAccuracy! >= 0 && m.rewardsAccuracy! <= 1));
    assert.ok(Number.isFinite(a[1]!.valLoss), 'validation runs against the reference too');

    // The reference computed once before step 0: the same steps, bit for bit; a resume reads it back.
    const pre = await flotilla(['train', config, '--nproc', '2', `--train.runDir=${join(dir, 'pre')}`, '--dpo.precompute=true']);
    assert.equal(pre.code, 0, pre.out + pre.err);
    assert.match(pre.out, /\[dpo\] reference: a frozen copy of the starting weights, placed by the same layout, computed before step 0 over 4 step\(s\) of batches and kept in reference\//);
    assert.ok(existsSync(join(dir, 'pre', 'reference', 'logps.f64')) && existsSync(join(dir, 'pre', 'reference', 'reference.json')));
    assert.deepEqual(metricsOf(join(dir, 'pre')).map((m) => [m.loss, m.rewardsMargin, m.valLoss]), a.map((m) => [m.loss, m.rewardsMargin, m.valLoss]));
    const ckpt = readdirSync(join(dir, 'pre', 'checkpoints')).find((n) => /^step-0*2$/.test(n))!;
    const resumed = await flotilla(['train', config, '--nproc', '2', `--train.runDir=${join(dir, 'pre')}`, '--dpo.precompute=true', '--resume', join(dir, 'pre', 'checkpoints', ckpt)]);
    assert.equal(resumed.code, 0, resumed.out + resumed.err);
    assert.match(resumed.out, /\[dpo\] reference: .*, read back from .*reference/);
    assert.deepEqual(metricsOf(join(dir, 'pre')).map((m) => m.loss), a.map((m) => m.loss));

    // LoRA on the first run's weights: the reference is the policy with its adapters off (auto).
    const lora = await flotilla(['train', config, `--train.runDir=${join(dir, 'lora')}`, '--lora.rank=2', '--lora.targets=qkv,fc', `--train.initFrom=${join(dir, 'live', 'checkpoints', ckpt)}`, '--train.steps=2', '--train.evalEvery=0']);
    assert.equal(lora.code, 0, lora.out + lora.err);
    assert.match(lora.out, /\[dpo\] DPO \(sigmoid, beta 0\.5\) against the policy with its LoRA adapters off/);
    const l = metricsOf(join(dir, 'lora'));
    assert.deepEqual([l[0]!.rewardsChosen, l[0]!.rewardsRejected], [0, 0], 'new adapters (B = 0) leave the policy equal to its reference');
    assert.ok(l[1]!.rewardsMargin !== 0, 'the adapters trained');
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
