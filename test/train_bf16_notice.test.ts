// A bf16-mixed run on a CPU without native bfloat16 arithmetic says so at start, with this machine's
// measured ratio of bfloat16 to float32 GEMM time, and suggests fp32; an fp32 run says nothing.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { train } from '../src/train/trainer.js';
import { parseConfig } from '../src/config/index.js';
import { bf16Support } from '../src/tensor/index.js';
import { peakTflops } from '../src/train/peak_flops.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-bf16-notice-'));
const TINY = ['--model.nLayer=1', '--model.nHead=2', '--model.nEmbd=32', '--model.blockSize=32', '--data.seqLen=32', '--data.globalBatch=8', '--log.progress=plain'];

async function startLines(precision: string): Promise<string[]> {
  const lines: string[] = [];
  const cfg = parseConfig('', [...TINY, '--train.steps=1', '--train.evalBatches=1', `--train.precision=${precision}`, `--train.runDir=${join(dir, precision)}`]);
  await train(cfg, { print: (l) => lines.push(l) });
  return lines;
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
    // The ratio is this machine's probes' (cached by the run; read back here).
    const ratio = Number(/takes (\d+\.\d)x the time/.exec(notice[0]!)?.[1]);
    assert.equal(ratio.toFixed(1), (peakTflops(0, 'float32').tflops / peakTflops(0, 'bfloat16').tflops).toFixed(1), notice[0]);
  }
  const fp32 = await startLines('fp32');
  assert.deepEqual(fp32.filter((l) => l.startsWith('[precision] ')), [], 'an fp32 run gets no notice');
});
