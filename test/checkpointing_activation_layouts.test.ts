// Activation checkpointing under ZeRO-3 (the recompute regathers the unit's parameters) and under
// a pipeline: 3 float32 training steps on 2 ranks with activationCheckpoint "full" (and "selective"
// under zero bubble) give the same losses, gradient norms and final parameters, bit for bit, as the
// same layout without it. The pairs run in two worlds of `flotilla train-series`, queued when the file
// loads (test/helpers/pool.ts); each test awaits its pair's world.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { flotillaSeries } from './helpers/cli.js';
import { loadSafetensors } from '../src/checkpoint/safetensors.js';
import { tidy } from '../src/tensor/index.js';
import { pool, started } from './helpers/pool.js';

const small = [
  '--model.nLayer=2', '--model.nEmbd=64', '--data.seqLen=32', '--data.globalBatch=8', '--parallel.bucketSizeMb=0.1',
  '--train.steps=3', '--train.evalEvery=0', '--train.evalBatches=1', '--log.progress=off', '--log.metrics=', '--checkpoint.every=0',
  '--parallel.backend=gloo',
];

const queue = pool();
/**
 * Runs in one 2-rank world, one after another: each with its own overrides, run directory and record
 * of losses, gradient norms and parameters.
 */
function series(runs: { dir: string; overrides: string[] }[]): Promise<void> {
  return started(queue(async () => {
    const r = await flotillaSeries(2, runs.map(({ dir, overrides }) => ['examples/gpt-tiny.toml', ...small, ...overrides, `--train.runDir=${join(dir, 'run')}`, '--record', join(dir, 'rec')]));
    assert.equal(r.code, 0, `${r.out}${r.err}`);
  }));
}

function same(a: string, b: string): void {
  for (const r of [0, 1]) {
    assert.deepEqual(JSON.parse(readFileSync(join(a, 'rec', `rank${r}.json`), 'utf8')), JSON.parse(readFileSync(join(b, 'rec', `rank${r}.json`), 'utf8')), `rank ${r}: losses and gradient norms`);
    const pa = loadSafetensors(join(a, 'rec', `rank${r}.safetensors`));
    const pb = loadSafetensors(join(b, 'rec', `rank${r}.safetensors`));
    assert.deepEqual(Object.keys(pa).sort(), Object.keys(pb).sort());
    tidy(() => {
      for (const [name, t] of Object.entries(pa)) {
        assert.ok(t.eq(pb[name]!).all().item(), `rank ${r}: ${name} differs`);
      }
    });
  }
}

const layouts: [string, string[], ('full' | 'selective')?][] = [
  ['ZeRO-3', ['--parallel.zero=3']],
  ['pipeline pp=2, 1F1B', ['--parallel.pp=2', '--data.microBatches=4']],
  ['pipeline pp=2, interleaved (2 stages per rank)', ['--parallel.pp=2', '--parallel.ppSchedule=interleaved', '--parallel.ppVirtualStages=2', '--model.nLayer=4', '--data.microBatches=4']],
  // The checkpointed blocks' Linears get their weight gradients in I (from the recompute), the head's in W.
  ['pipeline pp=2, zero bubble', ['--parallel.pp=2', '--parallel.ppSchedule=zb', '--data.microBatches=4']],
  // Selective recomputes the attention core only: the Linears around it are captured and finish in W.
  ['pipeline pp=2, zero bubble', ['--parallel.pp=2', '--parallel.ppSchedule=zb', '--data.microBatches=4'], 'selective'],
];

// Each layout's pair (without, then with checkpointing) in one of two worlds, which run side by side.
const pairs = layouts.map(([, overrides, mode = 'full']) => {
  const root = mkdtempSync(join(tmpdir(), 'flotilla-ac-'));
  return { root, runs: [{ dir: join(root, 'none'), overrides }, { dir: join(root, 'full'), overrides: [...overrides, `--train.activationCheckpoint=${mode}`] }] };
});
const worlds = [0, 1].map((w) => series(pairs.filter((_, i) => i % 2 === w).flatMap((p) => p.runs)));
for (const [i, [name, , mode = 'full']] of layouts.entries()) {
  test(`activation_checkpoint_${mode} under ${name}: bit-identical to no checkpointing`, async () => {
    const { root } = pairs[i]!;
    try {
      await worlds[i % 2];
      same(join(root, 'none'), join(root, 'full'));
    } finally {
      rmSync(root, { recursive: true, force: true });
    }
  });
}

