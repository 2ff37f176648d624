// The Llama through the `flotilla` command, the way a user reaches it (`[model] arch = "llama"`):
// `flotilla verify` passes under tp with sequence and loss parallelism (ZeRO-3 and the rest against
// one process: test/llama_layouts.test.ts); a checkpoint saved under tp resumes under a pipeline,
// and one saved under ZeRO-3 resumes under tp, with the straight run's numbers (`verify --resume
// --then`); a tp that does not divide nKvHead is refused before any rank starts; `flotilla
// generate` samples from a Llama checkpoint.
//
// Every launch is queued when the file loads, two at a time (test/helpers/pool.ts).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { flotilla } from './helpers/cli.js';
import { pool, started } from './helpers/pool.js';

const work = mkdtempSync(join(tmpdir(), 'flotilla-llama-cli-'));
const CONFIG = join(work, 'llama.toml');
writeFileSync(CONFIG, `[model]
arch = "llama"
nLayer = 2
nHead = 4
nKvHead = 2
nEmbd = 32
intermediateSize = 64
blockSize = 16
[data]
seqLen = 16
globalBatch = 8
[optim]
lr = 3e-3
warmupSteps = 2
[train]
steps = 4
evalEvery = 0
evalBatches = 1
[parallel]
bucketSizeMb = 0.01
[log]
progress = "plain"
every = 1
`);

const launch = pool();
const cli = (args: string[]) => started(launch(() => flotilla(args, { timeoutMs: 300_000 })));
const verify = (args: string[]) => cli(['verify', CONFIG, '--steps', '4', ...args]);

const tpSpLp = verify(['--nproc', '2', '--parallel.tp=2', '--parallel.sequenceParallel=true', '--parallel.lossParallel=true']);
const tpIntoPp = verify(['--nproc', '2', '--parallel.tp=2', '--parallel.sequenceParallel=true', '--resume', '2', '--then', '--nproc', '2', '--parallel.tp=1', '--parallel.sequenceParallel=false', '--parallel.pp=2', '--data.microBatches=2']);
const zero3IntoTp = verify(['--nproc', '2', '--parallel.zero=3', '--resume', '2', '--then', '--nproc', '2', '--parallel.zero=0', '--parallel.tp=2']);
const runDir = join(work, 'run');
const trained = cli(['train', CONFIG, `--train.runDir=${runDir}`, '--train.steps=2', '--checkpoint.every=2', '--log.sampleTokens=6', '--log.samplePrompt=Call me']);

test('flotilla verify PASSes for the Llama under tp = 2 with sequence and loss parallelism', async () => {
  const r = await tpSpLp;
  assert.equal(r.code, 0, r.out + r.err);
  assert.match(r.out, /^PASS \(tolerance/m);
  // The worst tensor is one of the Llama's (the GPT has no such names).
  assert.match(r.out, /worst tensor .*(attn\.[qkvo]|mlp\.(gate|up|down)|Norm|wte|norm|head)\.weight\)/);
});

test('a Llama checkpoint saved under tp resumes under a pipeline, and one saved under ZeRO-3 under tp, with the straight run\'s numbers', async () => {
  for (const r of [await tpIntoPp, await zero3IntoTp]) {
    assert.equal(r.code, 0, r.out + r.err);
    assert.match(r.out, /^PASS \(tolerance: loss 0\.00001/m);
  }
});

test('a tp that does not divide nKvHead is refused before any rank starts, naming the field', async () => {
  const dir = join(work, 'refused');
  const r = await flotilla(['train', CONFIG, '--nproc', '2', '--parallel.tp=2', '--model.nKvHead=1', `--train.runDir=${dir}`]);
  assert.equal(r.code, 2, r.out + r.err);
  assert.match(r.err, /model\.nKvHead .*= 1 does not divide by parallel\.tp = 2/);
  assert.doesNotMatch(r.out + r.err, /\[rank \d\]/, 'a rank started');
  assert.ok(!existsSync(dir), 'the refused run wrote its directory');
});

test('flotilla train ends with a sample ([log] sampleTokens) and flotilla generate samples from a Llama checkpoint', async () => {
  const t = await trained;
  assert.equal(t.code, 0, t.out + t.err);
  assert.match(t.out, /\[sample\] 6 tokens from .*step-000002/);
  assert.ok(readFileSync(join(runDir, 'sample.txt'), 'utf8').startsWith('Call me'), 'the run wrote no sample.txt');
  const out = join(work, 'sample.txt');
  const g = await flotilla(['generate', runDir, '--prompt', 'Call me', '--tokens', '8', '--seed', '3', '--out', out]);
  assert.equal(g.code, 0, g.out + g.err);
  assert.ok(existsSync(out), 'no sample written');
});
