// `flotilla verify` of a chat run through the CLI: a small .jsonl of conversations (the assistant's
// turns trained, the rest masked) named as data.source with data.format = "chat", prepared into the
// cache by verify before its ranks start, packed (rows hold several conversations) and trained for
// train.epochs (verify sets it to 0 and trains --steps of the same rows). Under every layout (data
// parallel, ZeRO-1/2/3, HSDP, pipelines, tensor parallel with sequence and loss parallelism, context
// parallel alone and under a pipeline, expert parallel) the ranks' losses, gradient norms and parameters equal one process's
// within verify's float32 tolerance: the loss is the sum over the global batch's trained targets
// over their count, whatever the layout cuts. And `verify --resume` of the same config resumes exactly
// (the examples' loader state in the checkpoint). The float64 equivalence of the same layouts on masked
// packed rows is test/masked_layouts.test.ts.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { flotilla, verifyBlock } from './helpers/cli.js';
import { tinyGptToml } from './fixtures/tiny_gpt.js';
import { pool, started } from './helpers/pool.js';
import { writeChatTokenizer } from './fixtures/chat_model.js';

const root = mkdtempSync(join(tmpdir(), 'flotilla-chat-verify-'));
after(() => rmSync(root, { recursive: true, force: true }));
const cache = join(root, 'cache');
const tokenizer = writeChatTokenizer(join(root, 'model'));

/** Conversations of 1-2 exchanges (some with a system turn) of uneven lengths, seeded. */
function conversations(n: number, seed: number): string[] {
  const words = ['whale', 'ship', 'sea', 'Ahab', 'harpoon', 'the', 'white', 'captain', 'deck', 'wind', 'call', 'me', 'Ishmael', 'oil', 'boat'];
  let s = seed;
  const rnd = (k: number) => ((s = (s * 1103515245 + 12345) % 2147483648), s % k);
  const say = () => Array.from({ length: 1 + rnd(5) }, () => words[rnd(words.length)]).join(' ');
  return Array.from({ length: n }, () => {
    const messages = rnd(3) === 0 ? [{ role: 'system', content: say() }] : [];
    for (let t = 0, turns = 1 + rnd(2); t < turns; t++) messages.push({ role: 'user', content: say() }, { role: 'assistant', content: say() });
    return JSON.stringify({ messages });
  });
}

const source = join(root, 'chat.jsonl');
writeFileSync(source, `${conversations(48, 7).join('\n')}\n`);
/** A tiny Llama on the conversations: packed rows of 96 tokens, 2 epochs (verify trains --steps instead). */
const config = join(root, 'chat.toml');
writeFileSync(config, tinyGptToml({
  model: { arch: 'llama', nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 64, blockSize: 96 },
  data: { source, tokenizer, format: 'chat', pack: true, seqLen: 96, globalBatch: 4, microBatches: 2 },
  train: { epochs: 2 },
  optim: { minLr: undefined, warmupSteps: 0 },
  parallel: { backend: 'gloo' },
}));

const queue = pool(1);
const run = (args: string[]): ReturnType<typeof flotilla> => started(queue(() => flotilla(args, { timeoutMs: 500_000, env: { FLOTILLA_CACHE_DIR: cache } })));

// One verify: each --and adds its overrides to the first layout's (dp = 2, 2 micro-batches a rank).
const MOE = ['--moe.experts=4', '--moe.topK=2'];
const LAYOUTS: [string, string[]][] = [
  ['dp = 2', []],
  ['ZeRO-1', ['--parallel.zero=1']],
  ['ZeRO-2', ['--parallel.zero=2', '--data.microBatches=1']],
  ['ZeRO-3', ['--parallel.zero=3']],
  ['pp = 2, 1F1B', ['--parallel.pp=2', '--data.microBatches=4']],
  ['pp = 2, zero bubble', ['--parallel.pp=2', '--parallel.ppSchedule=zb', '--data.microBatches=4']],
  ['tp = 2 with sequence and loss parallelism', ['--parallel.tp=2', '--parallel.sequenceParallel=true', '--parallel.lossParallel=true']],
  ['cp = 2', ['--parallel.cp=2']],
  ['ep = 2 (4 experts)', ['--parallel.ep=2', '--data.microBatches=1', ...MOE]],
  ['HSDP 2 x 2, ZeRO-3, on 4 ranks', ['--nproc', '4', '--parallel.zero=3', '--parallel.dpShard=2', '--parallel.dpReplicate=2', '--data.microBatches=1']],
  ['cp = 2 x pp = 2 on 4 ranks', ['--nproc', '4', '--parallel.cp=2', '--parallel.pp=2']],
];
const layouts = run(['verify', config, '--nproc', '2', '--steps', '3', ...LAYOUTS.slice(1).flatMap(([, o]) => ['--and', ...o])]);

test('verify prepares the .jsonl of conversations into the cache before its ranks start, and trains --steps in place of train.epochs', async () => {
  const r = await layouts;
  assert.equal(readdirSync(join(cache, 'prepared')).length, 1, `${r.out}\n${r.err}`);
  assert.match(r.out, /^verify: train\.epochs=2 set to 0 for both runs: they train --steps 3/m, `${r.out}\n${r.err}`);
});

for (const [i, [what]] of LAYOUTS.entries()) {
  test(`flotilla verify passes for packed chat examples (assistant turns trained) under ${what}`, async () => {
    const r = await layouts;
    assert.match(verifyBlock(r.out, i), /^PASS \(/m, `${r.out}\n${r.err}`);
  });
}

test('verify: every layout of the chat run passes', async () => {
  const r = await layouts;
  assert.match(r.out, new RegExp(`^verify: ${LAYOUTS.length} of ${LAYOUTS.length} layouts PASS$`, 'm'), `${r.out}\n${r.err}`);
  assert.equal(r.code, 0);
});

test('verify --resume of the chat run with train.epochs: the resumed steps equal the straight ones bit for bit', async () => {
  const r = await run(['verify', config, '--nproc', '2', '--resume', '2', '--steps', '4']);
  assert.match(r.out, /^verify: train\.epochs=2 set to 0 for both runs: they train --steps 4/m, `${r.out}\n${r.err}`);
  assert.match(r.out, /^PASS \(same layout: bit-identical expected\)/m, `${r.out}\n${r.err}`);
  assert.equal(r.code, 0);
});
