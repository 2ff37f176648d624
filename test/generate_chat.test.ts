// `flotilla generate --chat`: a prompt goes in as a user's turn of the model's chat template (its
// special tokens single ids), sampling stops at the template's end of turn, and the reply is printed
// alone.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Llama } from '../src/models/llama.js';
import { noGrad } from '../src/tensor/index.js';
import { loadPretrained, savePretrained } from '../src/checkpoint/hf.js';
import { loadTokenizer, type JsonTokenizer } from '../src/data/tokenizer.js';
import { generate as generateTokens } from '../src/inference/generate.js';
import { generate } from '../src/cli/checkpoint.js';
import { CHAT_VOCAB, IM_END, IM_START, writeChatTokenizer } from './fixtures/chat_model.js';

const root = mkdtempSync(join(tmpdir(), 'flotilla-gen-chat-'));
test.after(() => rmSync(root, { recursive: true, force: true }));

const cfg = { vocabSize: CHAT_VOCAB, blockSize: 64, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 64, tieEmbeddings: false, dropout: 0 };
const sampling = { tokens: 24, temperature: 0, topK: 0, topP: 1, seed: 3 };

test('generate --chat renders the prompt as a ChatML user turn and stops at <|im_end|>', async () => {
  const tokDir = writeChatTokenizer(join(root, 'tokenizer'));
  const dir = join(root, 'model');
  const tok = (await loadTokenizer(join(tokDir, 'tokenizer.json'))) as JsonTokenizer;
  // The prompt the template makes, written out by hand: the markers must be single ids.
  const want = tok.encodeWithSpecials('<|im_start|>user\nCall me Ishmael.<|im_end|>\n<|im_start|>assistant\n');
  assert.equal(want[0], IM_START);
  assert.equal(want.filter((t) => t === IM_END).length, 1);

  const m = new Llama(cfg, { initSeed: 11 });
  // Make <|im_end|> the greedy choice wherever the token greedy decoding picks third would be: its
  // output row is twice that token's, so the reply must end early, at the template's end of turn.
  const free = noGrad(() => generateTokens(m, [want], { maxNewTokens: sampling.tokens, temperature: 0, seed: 3 }))[0]!;
  const third = free[2]!;
  noGrad(() => {
    const w = m.namedParameters().find(([n]) => n === 'head.weight')![1];
    w.narrow(0, IM_END, 1).copy_(w.narrow(0, third, 1).mul(2));
  });
  // The directory gets the tokenizer's companions: tokenizer_config.json carries the template.
  savePretrained(m, dir, { tokenizer: join(tokDir, 'tokenizer.json') });
  assert.ok(existsSync(join(dir, 'tokenizer_config.json')));
  m.dispose();

  const base = loadPretrained(dir);
  const ref = noGrad(() => generateTokens(base.model as never, [want], { maxNewTokens: sampling.tokens, temperature: 0, seed: 3 }))[0]!;
  base.model.dispose();
  const end = ref.indexOf(IM_END);
  assert.ok(end >= 0 && end < sampling.tokens - 1, `the reference reply reaches <|im_end|> early (${ref.join(',')})`);

  const [chat] = await generate(dir, { prompts: ['Call me Ishmael.'], ...sampling, ignoreEos: false, chat: '' });
  assert.equal(chat!.text, tok.decode(ref.slice(0, end)), 'the reply is the tokens before <|im_end|>');
  // Without --chat the same prompt is plain text: a different context, so a different continuation.
  const [plain] = await generate(dir, { prompts: ['Call me Ishmael.'], ...sampling, ignoreEos: true });
  assert.notEqual(plain!.text, chat!.text);
  // --ignore-eos goes on through the end of turn.
  const [through] = await generate(dir, { prompts: ['Call me Ishmael.'], ...sampling, ignoreEos: true, chat: '' });
  assert.equal(through!.text, tok.decode(ref));
});

test('generate --chat with a template the directory lacks names the fix', async () => {
  const dir = join(root, 'model');
  await assert.rejects(generate(dir, { prompts: ['hi'], ...sampling, ignoreEos: false, chat: join(root, 'nope.jinja') }), /generate --chat: chat template .*no such file.*"model", "chatml"/);
});
