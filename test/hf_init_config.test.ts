// `[train] initFrom = HF_DIR` gives the run its [model] ([Note: initFrom model] in
// src/config/init_from.ts): every field the user did not set comes from the directory's
// config.json, a set field that disagrees is one error naming it, model.vocabSize is the
// directory's, the directory's tokenizer comes along when data.tokenizer is left at its default
// (and its absence is an error when examples need it), a checkpoint's saved [model] the same way;
// the launcher resolves it without loading libtorch, and the run's saved config.toml holds the
// values. `flotilla generate` stops at config.json's and generation_config.json's eos_token_id.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { execFileSync } from 'node:child_process';
import { setNumThreads } from '../src/tensor/index.js';
import { Llama } from '../src/models/llama.js';
import { loadPretrained, savePretrained } from '../src/checkpoint/hf.js';
import { generate } from '../src/cli/checkpoint.js';
import { generate as generateTokens } from '../src/inference/generate.js';
import { loadTokenizer } from '../src/data/index.js';
import { ConfigError, parseConfig } from '../src/config/index.js';
import { flotilla, NO_REPORT, ROOT } from './helpers/cli.js';
import { CHAT_VOCAB, writeChatTokenizer } from './fixtures/chat_model.js';

setNumThreads(1);
const root = mkdtempSync(join(tmpdir(), 'flotilla-hf-init-config-'));
after(() => rmSync(root, { recursive: true, force: true }));

const MODEL = { vocabSize: CHAT_VOCAB, blockSize: 128, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 48, ropeTheta: 10000, tieEmbeddings: false };
const tok = writeChatTokenizer(join(root, 'tok'));
/** A Hugging Face Llama directory, with the chat tokenizer or without any. */
function hfDir(name: string, withTokenizer: boolean): string {
  const dir = join(root, name);
  const m = new Llama(MODEL, { initSeed: 5 });
  savePretrained(m, dir, withTokenizer ? { tokenizer: join(tok, 'tokenizer.json') } : {});
  m.dispose();
  return dir;
}
const base = hfDir('base', true);
const bare = hfDir('bare', false);

const problemsOf = (f: () => unknown): string[] => {
  try {
    f();
  } catch (e) {
    assert.ok(e instanceof ConfigError, String(e));
    return e.problems;
  }
  assert.fail('expected a ConfigError');
};

test('[model] comes from the directory\'s config.json, the tokenizer with it; the resolved TOML holds the values', () => {
  const c = parseConfig('', [`--train.initFrom=${base}`]);
  assert.equal(c.model.arch, 'llama');
  for (const [k, v] of Object.entries(MODEL)) assert.equal((c.model as unknown as Record<string, unknown>)[k], v, `model.${k}`);
  assert.equal(c.model.vocabSize, CHAT_VOCAB, 'model.vocabSize = 0 (the default) is the directory\'s vocabulary');
  assert.equal(c.data.tokenizer, base, 'data.tokenizer left at its default is the directory');
  // Set fields equal to the directory's (a derived 0 included) are allowed and keep it.
  const same = parseConfig('[model]\narch = "llama"\nvocabSize = 0\nheadDim = 0\n', [`--train.initFrom=${base}`, '--model.nLayer=2', '--model.nEmbd=32', '--data.tokenizer=byte']);
  assert.equal(same.model.headDim, 8);
  assert.equal(same.model.vocabSize, CHAT_VOCAB);
  assert.equal(same.data.tokenizer, 'byte', 'a data.tokenizer the user set stays');
  // A relative initFrom in a file starts from the file's directory.
  const fromFile = parseConfig('[train]\ninitFrom = "base"\n', [], 'run.toml', root);
  assert.equal(fromFile.model.nLayer, 2);
  assert.equal(fromFile.train.initFrom, base);
});

test('a family of the Llama (Qwen2ForCausalLM) gives its family fields too, and a set one against it is named', () => {
  const dir = join(root, 'qwen2');
  const m = new Llama({ ...MODEL, family: 'qwen2', attnBias: 'qkv' }, { initSeed: 6 });
  savePretrained(m, dir);
  m.dispose();
  const c = parseConfig('', [`--train.initFrom=${dir}`]);
  assert.deepEqual([c.model.arch, c.model.family, c.model.attnBias, c.model.qkNorm, c.model.nKvHead], ['llama', 'qwen2', 'qkv', false, 2]);
  assert.match(problemsOf(() => parseConfig('', [`--train.initFrom=${dir}`, '--model.attnBias=none'])).join('\n'), /^model\.attnBias = "none" is set, and train\.initFrom is the Hugging Face directory .*qwen2 \(Qwen2ForCausalLM\), whose model has model\.attnBias = "qkv": remove model\.attnBias/);
});

test('a [model] field set against the directory is one error naming it, both values and the fix', () => {
  const p = problemsOf(() => parseConfig('[model]\nnLayer = 3\n', [`--train.initFrom=${base}`]));
  assert.equal(p.length, 1, p.join('\n'));
  assert.match(p[0]!, /^model\.nLayer = 3 is set, and train\.initFrom is the Hugging Face directory .*base \(LlamaForCausalLM\), whose model has model\.nLayer = 2: remove model\.nLayer/);
  const two = problemsOf(() => parseConfig('', [`--train.initFrom=${base}`, '--model.nEmbd=64', '--model.tieEmbeddings=true']));
  assert.deepEqual(two.map((x) => /^model\.(\w+)/.exec(x)![1]), ['nEmbd', 'tieEmbeddings']);
  const arch = problemsOf(() => parseConfig('', [`--train.initFrom=${base}`, '--model.arch=gpt']));
  assert.equal(arch.length, 1);
  assert.match(arch[0]!, /^model\.arch = "gpt" is set, and train\.initFrom is .*, arch "llama": remove model\.arch/);
  // A directory's config.json that is not readable by any architecture names the file.
  const odd = join(root, 'odd');
  mkdirSync(odd);
  writeFileSync(join(odd, 'config.json'), JSON.stringify({ model_type: 'bert', architectures: ['BertModel'] }));
  assert.match(problemsOf(() => parseConfig('', [`--train.initFrom=${odd}`])).join('\n'), /train\.initFrom: .*odd\/config\.json: model_type "bert" is not supported; flotilla reads /);
});

test('a directory without tokenizer.json: a text run keeps its tokenizer, an example run is told to add one', () => {
  const c = parseConfig('', [`--train.initFrom=${bare}`]);
  assert.equal(c.data.tokenizer, 'byte');
  assert.equal(c.model.vocabSize, CHAT_VOCAB, 'the vocabulary is still the model\'s');
  const p = problemsOf(() => parseConfig('', [`--train.initFrom=${bare}`, '--data.format=chat', '--data.source=x.jsonl']));
  assert.match(p.join('\n'), /data\.format = "chat" needs the model's tokenizer, and train\.initFrom is the Hugging Face directory .*bare \(LlamaForCausalLM\), which has no tokenizer\.json: put the model's tokenizer\.json and tokenizer_config\.json in the directory, or set data\.tokenizer/);
});

test('a flotilla checkpoint as initFrom gives its saved [model]', () => {
  const ckpt = join(root, 'ckpt', 'step-000004');
  mkdirSync(ckpt, { recursive: true });
  const saved = parseConfig('', ['--model.arch=llama', '--model.nLayer=3', '--model.nEmbd=48', '--model.nHead=6', '--model.nKvHead=3']);
  writeFileSync(join(ckpt, 'meta.json'), JSON.stringify({ step: 4, config: saved }));
  const c = parseConfig('', [`--train.initFrom=${ckpt}`, '--model.dropout=0.1']);
  assert.deepEqual({ ...c.model, dropout: 0 }, saved.model);
  assert.equal(c.model.dropout, 0.1, 'dropout is the run\'s');
  assert.match(problemsOf(() => parseConfig('', [`--train.initFrom=${ckpt}`, '--model.nHead=4'])).join('\n'), /^model\.nHead = 4 is set, and train\.initFrom is the checkpoint .*step-000004, whose model has model\.nHead = 6: remove model\.nHead/);
});

test('the launcher resolves the directory\'s [model] without loading libtorch', () => {
  const script = `const { parseConfig } = await import(${JSON.stringify(join(ROOT, 'src', 'config', 'index.ts'))});
const c = parseConfig('', ['--train.initFrom=${base}']);
const { readFileSync } = await import('node:fs');
console.log(JSON.stringify({ arch: c.model.arch, nLayer: c.model.nLayer, libtorch: readFileSync('/proc/self/maps', 'utf8').includes('libtorch') }));`;
  const out = execFileSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], { cwd: ROOT, encoding: 'utf8' });
  assert.deepEqual(JSON.parse(out.trim().split('\n').at(-1)!), { arch: 'llama', nLayer: 2, libtorch: false });
});

test('generate stops at config.json\'s and generation_config.json\'s eos_token_id (an id or a list)', async () => {
  const dir = hfDir('eos', true);
  const o = { prompts: ['Call me'], tokens: 24, temperature: 1, topK: 0, topP: 1, seed: 3, ignoreEos: false };
  // The ids generate samples without any eos_token_id: the same weights, options and seed.
  const p = loadPretrained(dir);
  const codec = await loadTokenizer(join(dir, 'tokenizer.json'));
  const prompt = Array.from(codec.encode('Call me'), Number);
  const [ids] = generateTokens(p.model as never, [prompt], { maxNewTokens: 24, temperature: 1, topK: 0, topP: 1, seed: 3, stopIds: [codec.eot] });
  p.model.dispose();
  const cont = ids!;
  assert.equal((await generate(dir, o))[0]!.text, codec.decode(cont.at(-1) === codec.eot ? cont.slice(0, -1) : cont), 'without eos_token_id, as before');
  const k = cont.findIndex((id, i) => i >= 4 && id !== codec.eot);
  assert.ok(k >= 4, 'a continuation long enough to stop inside');
  const stopId = cont[k]!;
  const unused = Array.from({ length: CHAT_VOCAB }, (_, i) => i).filter((i) => !cont.includes(i));
  const cfgPath = join(dir, 'config.json');
  writeFileSync(cfgPath, JSON.stringify({ ...JSON.parse(readFileSync(cfgPath, 'utf8')), eos_token_id: unused[0] }));
  writeFileSync(join(dir, 'generation_config.json'), JSON.stringify({ eos_token_id: [unused[1], stopId] }));
  const first = cont.findIndex((id) => id === stopId || id === codec.eot);
  const [s] = await generate(dir, o);
  assert.equal(s!.text, codec.decode(cont.slice(0, first)), 'the reply ends before the first end id of the list');
  writeFileSync(join(dir, 'generation_config.json'), JSON.stringify({ eos_token_id: 'x' }));
  await assert.rejects(generate(dir, o), /generation_config\.json: eos_token_id = "x" is not a token id or a list of token ids/);
});

test('flotilla train on 2 ranks from a directory with no [model] section: the saved config holds the directory\'s model and tokenizer', { timeout: 300_000 }, async () => {
  const config = join(root, 'run.toml');
  writeFileSync(config, ['[train]', 'initFrom = "base"', 'steps = 2', 'evalEvery = 0', '[data]', 'seqLen = 32', 'globalBatch = 4', '[log]', 'progress = "plain"', 'sampleTokens = 0', ''].join('\n'));
  const run = join(root, 'run');
  const r = await flotilla(['train', config, '--nproc', '2', `--train.runDir=${run}`], { env: NO_REPORT });
  assert.equal(r.code, 0, r.out + r.err);
  assert.match(r.out, /weights from .*base; step 0/);
  const saved = parseConfig(readFileSync(join(run, 'config.toml'), 'utf8'));
  assert.equal(saved.model.arch, 'llama');
  for (const [k, v] of Object.entries(MODEL)) assert.equal((saved.model as unknown as Record<string, unknown>)[k], v, `model.${k} in the saved config.toml`);
  assert.equal(saved.data.tokenizer, base);
  // A field set against the directory stops before any rank starts.
  const bad = await flotilla(['train', config, '--nproc', '2', `--train.runDir=${join(root, 'bad')}`, '--model.nLayer=4'], { env: NO_REPORT });
  assert.notEqual(bad.code, 0);
  assert.match(bad.err, /model\.nLayer = 4 is set, and train\.initFrom is the Hugging Face directory .*base \(LlamaForCausalLM\), whose model has model\.nLayer = 2: remove model\.nLayer/);
  assert.doesNotMatch(bad.out + bad.err, /\[world\]/, 'no rank started');
});
