// `flotilla verify` with bf16-mixed: a layout against bf16-mixed in one process, on the same
// global batches (both runs get the override). Float32 gradient buckets and reductions keep the
// layouts at the float32 tolerance; reduceDtype "bf16" rounds the reduced gradients, so verify
// states and applies its bf16 tolerance there. The layouts are one verify (--and: each adds its
// overrides to the first layout's, so each names its micro-batches), trained in one world of 2 ranks; each
// test reads its layout's block.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { REPO_ROOT } from './helpers/world.js';
import { BIN, verifyBlock } from './helpers/cli.js';
import { pool, spawnAsync, started } from './helpers/pool.js';

const small = ['--model.nLayer=2', '--model.nEmbd=64', '--data.seqLen=32', '--data.globalBatch=8', '--parallel.bucketSizeMb=0.1', '--train.precision=bf16-mixed', '--parallel.backend=gloo'];

const queue = pool();
function verify(overrides: string[]): Promise<{ code: number | null; out: string }> {
  return started(queue(async () => {
    const r = await spawnAsync(process.execPath, [BIN, 'verify', 'examples/gpt-tiny.toml', '--nproc', '2', '--steps', '3', ...small, ...overrides], {
      cwd: REPO_ROOT, timeout: 240_000,
    });
    return { code: r.status, out: `${r.stdout}${r.stderr}` };
  }));
}

const layouts: [string, string[]][] = [
  ['data parallel, 2 micro-batches', ['--data.microBatches=2']],
  ['ZeRO-3', ['--data.microBatches=1', '--parallel.zero=3']],
  ['pipeline pp=2, 1F1B', ['--parallel.pp=2', '--data.microBatches=4']],
  // Its weight pass forms dW by hand from the captured input and output gradient: in bfloat16, as the Linear ran.
  ['pipeline pp=2, zero bubble', ['--parallel.pp=2', '--parallel.ppSchedule=zb', '--data.microBatches=4']],
  ['ZeRO-2 with reduceDtype bf16', ['--data.microBatches=1', '--parallel.zero=2', '--parallel.reduceDtype=bf16']],
  ['ZeRO-3 with selective activation checkpointing', ['--data.microBatches=1', '--parallel.zero=3', '--train.activationCheckpoint=selective']],
];

const verified = verify([...layouts[0]![1], ...layouts.slice(1).flatMap(([, overrides]) => ['--and', ...overrides])]);
for (const [i, [name]] of layouts.entries()) {
  test(`verify PASSes for bf16-mixed under ${name}`, async () => {
    const { code, out } = await verified;
    assert.match(verifyBlock(out, i), /^PASS \(tolerance/m, out);
    assert.equal(code, 0, out);
  });
}
