// `flotilla verify` for LoRA runs ([Note: LoRA run] in src/train/lora_run.ts) under the layouts
// beyond data parallelism: from a tiny Hugging Face Llama directory the test writes, pp = 2 with
// 1F1B and zero bubble, cp = 2, full activation checkpointing, selective checkpointing under zero
// bubble (and with adapters in the last block only, so that the first pipeline rank trains
// nothing), bf16-mixed, HSDP 2 x 2 (ZeRO-3), and a bfloat16 base under zero bubble alone and over
// ZeRO-3, each train like one process; an MoE GPT (whose base is a flotilla checkpoint of a short
// full run: Hugging Face has no MoE GPT) under ep = 2; and a LoRA run saved at pp = 2 resumes under
// ZeRO-3 over dp = 2, one saved under ZeRO-3 resumes at pp = 2 with zero bubble, each continuing to
// the straight run's losses, gradient norms and adapters.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setNumThreads } from '../src/tensor/index.js';
import { Llama } from '../src/models/llama.js';
import { savePretrained } from '../src/checkpoint/hf.js';
import { flotilla, verifyBlock, ROOT } from './helpers/cli.js';
import { pool, started } from './helpers/pool.js';
import { tinyGptToml } from './fixtures/tiny_gpt.js';

setNumThreads(1);
const root = mkdtempSync(join(tmpdir(), 'flotilla-lora-verify-'));
after(() => rmSync(root, { recursive: true, force: true }));

const llamaDir = join(root, 'llama');
{
  const m = new Llama({ vocabSize: 512, blockSize: 32, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 64 }, { initSeed: 8 });
  savePretrained(m, llamaDir, { tokenizer: join(ROOT, 'examples', 'moby-dick-bpe512.json') });
  m.dispose();
}
const llamaConfig = join(ROOT, 'examples', 'llama-tiny.toml');
/** A LoRA run of the tiny Llama (rank 4 on every Linear but the head). */
const llamaArgs = [
  `--train.initFrom=${llamaDir}`, '--model.blockSize=32', '--model.nLayer=2', '--model.nEmbd=32', '--model.intermediateSize=64',
  '--data.seqLen=32', '--data.globalBatch=4', '--log.sampleTokens=0', '--optim.warmupSteps=0', '--lora.rank=4', '--parallel.backend=gloo',
];

const queue = pool(1);
const run = (args: string[]): ReturnType<typeof flotilla> => started(queue(() => flotilla(args, { timeoutMs: 500_000 })));

// One verify: each --and adds its overrides to the first layout's (pp = 2 with 2 micro-batches).
const LAYOUTS: [string, string[]][] = [
  ['pp = 2, 1F1B', []],
  ['pp = 2, zero bubble', ['--parallel.ppSchedule=zb']],
  ['pp = 2, zero bubble, selective activation checkpointing', ['--parallel.ppSchedule=zb', '--train.activationCheckpoint=selective']],
  // The first stage holds no adapter: its rank trains nothing, with an empty optimizer.
  ['pp = 2, zero bubble, adapters in the last block only', ['--parallel.ppSchedule=zb', '--lora.targets=model.layers.1.self_attn.q_proj,model.layers.1.mlp.down_proj']],
  ['pp = 2, zero bubble, a bfloat16 base', ['--parallel.ppSchedule=zb', '--lora.baseDtype=bf16']],
  ['cp = 2', ['--parallel.pp=1', '--data.microBatches=1', '--parallel.cp=2']],
  ['dp = 2, full activation checkpointing', ['--parallel.pp=1', '--data.microBatches=1', '--train.activationCheckpoint=full']],
  ['dp = 2, bf16-mixed', ['--parallel.pp=1', '--data.microBatches=1', '--train.precision=bf16-mixed']],
  ['HSDP 2 x 2, ZeRO-3, on 4 ranks', ['--nproc', '4', '--parallel.pp=1', '--data.microBatches=1', '--parallel.zero=3', '--parallel.dpShard=2', '--parallel.dpReplicate=2']],
  ['pp = 2 x ZeRO-3 over dp = 2, zero bubble, a bfloat16 base, on 4 ranks', ['--nproc', '4', '--parallel.zero=3', '--parallel.ppSchedule=zb', '--lora.baseDtype=bf16']],
];
const layouts = run(['verify', llamaConfig, '--nproc', '2', '--steps', '3', ...llamaArgs, '--parallel.pp=2', '--data.microBatches=2', ...LAYOUTS.slice(1).flatMap(([, o]) => ['--and', ...o])]);

for (const [i, [what]] of LAYOUTS.entries()) {
  test(`flotilla verify passes for a LoRA run from a Hugging Face Llama under ${what}`, async () => {
    const r = await layouts;
    const block = verifyBlock(r.out, i);
    assert.match(block, /^PASS \(/m, `${r.out}\n${r.err}`);
  });
}

test('verify: every layout of the LoRA run passes', async () => {
  const r = await layouts;
  assert.match(r.out, new RegExp(`^verify: ${LAYOUTS.length} of ${LAYOUTS.length} layouts PASS$`, 'm'), `${r.out}\n${r.err}`);
  assert.equal(r.code, 0);
});

test('flotilla verify passes for a LoRA run on an MoE GPT under ep = 2, its base a flotilla checkpoint of a full run', async () => {
  const config = join(root, 'moe.toml');
  writeFileSync(config, tinyGptToml({ model: { nLayer: 2 }, optim: { minLr: undefined, warmupSteps: 0 }, moe: { experts: 4, topK: 2, sharedExperts: 1 } }));
  const full = join(root, 'moe-full');
  const base = await run(['train', config, '--nproc', '1', '--train.steps=2', '--checkpoint.every=2', '--train.evalEvery=0', '--log.sampleTokens=0', '--log.progress=off', `--train.runDir=${full}`]);
  assert.equal(base.code, 0, `${base.out}\n${base.err}`);
  const r = await run(['verify', config, '--nproc', '2', '--steps', '3', `--train.initFrom=${join(full, 'checkpoints', 'step-000002')}`, '--lora.rank=4', '--parallel.ep=2', '--parallel.backend=gloo']);
  assert.match(r.out, /^PASS \(/m, `${r.out}\n${r.err}`);
  assert.equal(r.code, 0);
});

for (const [from, into, what] of [
  [['--parallel.pp=2', '--data.microBatches=2'], ['--parallel.pp=1', '--parallel.zero=3'], 'saved at pp = 2 resumes under ZeRO-3 over dp = 2'],
  [['--parallel.zero=3'], ['--parallel.zero=0', '--parallel.pp=2', '--parallel.ppSchedule=zb', '--data.microBatches=2'], 'saved under ZeRO-3 over dp = 2 resumes at pp = 2 with zero bubble'],
] as const) {
  test(`a LoRA run ${what} and continues to the straight run's losses`, async () => {
    const r = await run(['verify', llamaConfig, '--nproc', '2', ...llamaArgs, ...from, '--resume', '2', '--steps', '4', '--then', '--nproc', '2', ...into]);
    assert.match(r.out, /^PASS \(/m, `${r.out}\n${r.err}`);
    assert.equal(r.code, 0);
  });
}
