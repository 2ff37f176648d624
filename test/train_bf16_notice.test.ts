// A bf16-mixed run on a CPU without native bfloat16 arithmetic says so at start, with this machine's
// measured ratio of bfloat16 to float32 GEMM time, and suggests fp32; an fp32 run says nothing.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { train } from '../src/train/trainer.js';
import { parseConfig } from '../src/config/index.js';
import { bf16Support, setNumThreads } from '../src/tensor/index.js';
import { peakCacheEntry } from '../src/train/peak_flops.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-bf16-notice-'));
const TINY = ['--model.nLayer=1', '--model.nHead=2', '--model.nEmbd=32', '--model.blockSize=32', '--data.seqLen=32', '--data.globalBatch=8', '--log.progress=plain'];

async function startLines(precision: string): Promise<string[]> {
  const lines: string[] = [];
  const cfg = parseConfig('', [...TINY, '--train.steps=1', '--train.evalBatches=1', `--train.precision=${precision}`, `--train.runDir=${join(dir, precision)}`]);
  await train(cfg, { print: (l) => lines.push(l) });
  return lines;
}

// This file's own probe cache (other test files write theirs concurrently), holding a peak for each
// dtype as a probe writes it: the notice's ratio must be theirs. The runs use 1 thread, the cache's key.
process.env.FLOTILLA_CACHE_DIR = join(dir, 'cache');
setNumThreads(1);
const PEAKS = { float32: 0.0923, bfloat16: 0.0041 } as const;
for (const [dtype, tflops] of Object.entries(PEAKS)) {
  const { dir: cache, key, file } = peakCacheEntry(dtype as keyof typeof PEAKS);
  mkdirSync(cache!, { recursive: true });
  writeFileSync(file!, `${JSON.stringify({ key, tflops })}\n`);
}

test('bf16-mixed without native bfloat16 arithmetic: a notice at start with the measured GEMM time ratio, suggesting fp32; none for fp32', async () => {
  const bf16 = await startLines('bf16-mixed');
  const notice = bf16.filter((l) => l.startsWith('[precision] '));
  if (bf16Support().native) {
    assert.deepEqual(notice, [], 'a CPU with bfloat16 arithmetic gets no notice');
  } else {
    assert.equal(notice.length, 1, bf16.join('\n'));
    const at = bf16.indexOf(notice[0]!), firstStep = bf16.findIndex((l) => /^step /.test(l));
    assert.ok(firstStep < 0 || at < firstStep, 'the notice comes before the first step');
    assert.match(notice[0]!, /no native bfloat16 arithmetic/);
    assert.match(notice[0]!, /--train\.precision=fp32/);
    // The ratio is the probes' (their cache's).
    assert.match(notice[0]!, new RegExp(`takes ${(PEAKS.float32 / PEAKS.bfloat16).toFixed(1)}x the time`));
  }
  const fp32 = await startLines('fp32');
  assert.deepEqual(fp32.filter((l) => l.startsWith('[precision] ')), [], 'an fp32 run gets no notice');
});
