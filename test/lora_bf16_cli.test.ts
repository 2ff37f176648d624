// `flotilla train` and `flotilla verify` of a LoRA run whose frozen base is stored in bfloat16
// (--lora.baseDtype=bf16) on 2 ranks under ZeRO-3: a tiny GPT trained 2 steps is the base
// (train.initFrom), the LoRA run trains its adapters and saves only them, its [memory] line counts
// the sharded base at 2 bytes an element, and verify finds every rank equal to one process.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { flotilla } from './helpers/cli.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-lora-bf16-cli-'));
test.after(() => rmSync(dir, { recursive: true, force: true }));

const SMALL = ['--model.nLayer=2', '--model.nEmbd=64', '--data.seqLen=32', '--data.globalBatch=8', '--train.evalEvery=0', '--log.progress=plain'];
const LORA = ['--lora.rank=4', '--lora.baseDtype=bf16', '--parallel.zero=3'];

test('flotilla train of a LoRA run with a bfloat16 base on 2 ranks under ZeRO-3, then flotilla verify of it', async () => {
  const base = await flotilla(['train', 'examples/gpt-tiny.toml', ...SMALL, '--train.steps=2', '--checkpoint.every=2', `--train.runDir=${join(dir, 'base')}`]);
  assert.equal(base.code, 0, `${base.out}${base.err}`);
  const initFrom = `--train.initFrom=${join(dir, 'base', 'checkpoints', 'step-000002')}`;

  const run = await flotilla(['train', 'examples/gpt-tiny.toml', '--nproc', '2', ...SMALL, ...LORA, initFrom, '--train.steps=3', '--checkpoint.every=3', `--train.runDir=${join(dir, 'lora')}`], { timeoutMs: 240_000 });
  const out = `${run.out}${run.err}`;
  assert.equal(run.code, 0, out);
  assert.match(out, /LoRA rank 4 on 8 modules/, out);
  // Per parameter of the whole model, rank 0's half of a base at 2 bytes and of adapters at 4: about
  // 1 byte; a float32 base would be about 2.
  const perParam = Number(/\[memory\] rank 0 holds parameters [\d.]+ MiB \(([\d.]+) B\/param\)/.exec(out)?.[1]);
  assert.ok(perParam > 0.9 && perParam < 1.5, `rank 0 holds ${perParam} bytes of parameters per parameter:\n${out}`);
  const meta = JSON.parse(readFileSync(join(dir, 'lora', 'checkpoints', 'step-000003', 'meta.json'), 'utf8')) as { params: Record<string, { dtype: string }> };
  const saved = Object.keys(meta.params);
  assert.ok(saved.length > 0 && saved.every((n) => /\.lora[AB]\.weight$/.test(n)), `the checkpoint holds the adapters only: ${saved.join(', ')}`);
  assert.ok(Object.values(meta.params).every((p) => p.dtype === 'float32'), 'the adapters are float32');

  const v = await flotilla(['verify', 'examples/gpt-tiny.toml', '--nproc', '2', '--steps', '4', ...SMALL, ...LORA, initFrom], { timeoutMs: 240_000 });
  const vout = `${v.out}${v.err}`;
  assert.equal(v.code, 0, vout);
  assert.match(vout, /^verify: 4 step\(s\) of examples\/gpt-tiny.toml on 2 ranks/m, vout);
  assert.match(vout, /^PASS \(tolerance/m, vout);
});
