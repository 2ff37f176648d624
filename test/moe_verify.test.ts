// `flotilla verify` on an MoE GPT (top-2, a shared expert, a capacity that drops tokens, the
// auxiliary loss): expert parallelism against one process through the trainer, on Open MPI and on
// Gloo, with context parallelism (cp = 2 x ep = 2 x ZeRO-3), and under bf16-mixed (where verify states its bfloat16 tolerance: expert stacks of other
// shapes round differently); and checkpoints that hold experts by global index: saved at ep = 2, resumed at ep = 1 and at
// ep = 4 (on 4 ranks; micro-batches of the same rows, since the auxiliary loss and the capacity are
// per micro-batch), and one saved at ep = 2 x tp = 2 resumed without either, within float32
// rounding of the straight run.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { REPO_ROOT } from './helpers/world.js';
import { BIN, verifyBlock } from './helpers/cli.js';
import { pool, spawnAsync, started } from './helpers/pool.js';
import { tinyGptToml } from './fixtures/tiny_gpt.js';

const config = join(mkdtempSync(join(tmpdir(), 'flotilla-moe-verify-')), 'moe.toml');
const moeToml = (moe: Record<string, string | number>): string => tinyGptToml({ model: { nLayer: 2 }, optim: { minLr: undefined }, moe });
writeFileSync(config, moeToml({ experts: 4, topK: 2, sharedExperts: 1, capacityFactor: 1.25 }));

// balance = "bias": the selection biases are state outside the gradient, saved with the checkpoint.
const biasConfig = config.replace(/moe\.toml$/, 'moe-bias.toml');
writeFileSync(biasConfig, moeToml({ experts: 4, topK: 1, router: 'sigmoid', balance: 'bias', biasRate: 0.05, capacityFactor: 1.0 }));

const queue = pool(1);
function verify(args: string[], file = config): Promise<{ code: number | null; out: string }> {
  return started(queue(async () => {
    const r = await spawnAsync(process.execPath, [BIN, 'verify', file, ...args], { cwd: REPO_ROOT, timeout: 300_000, env: { ...process.env, FLOTILLA_REPORT: '0' } });
    return { code: r.status, out: `${r.stdout}${r.stderr}` };
  }));
}

// The six layouts are one verify (--and; each adds its overrides to the first's, Open MPI): those of
// one rank count and backend train in one world.
const LAYOUTS = [
  ['mpi', 'verify PASSes for ep = 2 on Open MPI', []],
  ['gloo', 'verify PASSes for ep = 2 with 2 micro-batches on Gloo', ['--parallel.backend=gloo', '--data.microBatches=2']],
  ['bf16', 'verify PASSes for ep = 2 under bf16-mixed, at the stated bfloat16 tolerance', ['--parallel.backend=auto', '--train.precision=bf16-mixed']],
  ['zero3', 'verify PASSes for ep = 2 x cp = 2 with ZeRO-3 (sharded over dpShard x cp) on 4 ranks', ['--nproc', '4', '--parallel.backend=auto', '--parallel.cp=2', '--parallel.zero=3']],
  ['pp', 'verify PASSes for ep = 2 x pp = 2 on 4 ranks', ['--nproc', '4', '--parallel.backend=auto', '--parallel.pp=2', '--data.microBatches=2']],
  ['tp', 'verify PASSes for ep = 2 x tp = 2 on 4 ranks', ['--nproc', '4', '--parallel.backend=auto', '--parallel.tp=2']],
] as const;
const layouts = verify(['--nproc', '2', '--steps', '3', '--parallel.ep=2', '--parallel.backend=mpi', ...LAYOUTS.slice(1).flatMap(([, , args]) => ['--and', ...args])]);
const runs = {
  toEp1: verify(['--nproc', '2', '--parallel.ep=2', '--resume', '3', '--steps', '5', '--then', '--nproc', '2', '--parallel.ep=1']),
  fromTp: verify(['--nproc', '4', '--parallel.ep=2', '--parallel.tp=2', '--resume', '2', '--steps', '4', '--then', '--nproc', '2', '--parallel.ep=1', '--parallel.tp=1']),
  bias: verify(['--nproc', '2', '--parallel.ep=2', '--resume', '3', '--steps', '6'], biasConfig),
  biasToPp: verify(['--nproc', '2', '--parallel.ep=2', '--resume', '3', '--steps', '6', '--then', '--nproc', '2', '--parallel.ep=1', '--parallel.pp=2', '--data.microBatches=2'], biasConfig),
  toEp4: verify(['--nproc', '2', '--parallel.ep=2', '--data.microBatches=2', '--resume', '3', '--steps', '5', '--then', '--nproc', '4', '--parallel.ep=4', '--data.microBatches=1']),
};

for (const [i, [name, what]] of LAYOUTS.entries()) {
  test(what, async () => {
    const { code, out } = await layouts;
    const block = verifyBlock(out, i);
    assert.match(block, /^PASS \(/m, out);
    if (name === 'bf16') assert.match(block, /expert parallelism runs the bfloat16 expert GEMMs/);
    assert.equal(code, 0, out);
  });
}

for (const [name, what] of [
  ['toEp1', 'a checkpoint saved at ep = 2 resumes at ep = 1'],
  ['toEp4', 'a checkpoint saved at ep = 2 resumes at ep = 4 on 4 ranks'],
  ['fromTp', 'a checkpoint saved at ep = 2 x tp = 2 resumes at ep = 1, tp = 1'],
  ['bias', 'the expert biases (balance = "bias") are saved: a resume under the same layout is bit-identical'],
  ['biasToPp', 'the expert biases resume under a pipeline, each stage taking its blocks\''],
] as const) {
  test(what, async () => {
    const { code, out } = await runs[name];
    assert.equal(code, 0, out);
    assert.match(out, /^PASS \(/m);
  });
}
