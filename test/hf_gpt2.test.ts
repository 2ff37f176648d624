// Hugging Face GPT2LMHeadModel directories both ways, against an independent PyTorch forward of
// transformers' GPT-2 written from the model description (test/oracle/hf_reference.py): directories
// of random weights it writes (tied and untied, gelu_new and exact GELU, float32, bfloat16 and
// float16, one file and shards with an index, the original upload's names with its mask buffers)
// load with logits equal to float64 rounding and the same 20 greedy tokens; what savePretrained
// writes it reads strictly (exactly transformers' names and shapes) with the same logits, and
// loadPretrained reads back bit-identically.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setNumThreads, tensor } from '../src/tensor/index.js';
import { loadPretrained, savePretrained, parseSize, readHfDir } from '../src/checkpoint/hf.js';
import { GPT } from '../src/models/gpt.js';
import { oracleMissing } from './oracle/oracle.js';
import { assertSameParameters, checkAgainst, hfReference, type HfRef, withConfigPatch } from './oracle/hf_oracle.js';

setNumThreads(1);
const skip = oracleMissing();
const root = mkdtempSync(join(tmpdir(), 'flotilla-hf-gpt2-'));
after(() => rmSync(root, { recursive: true, force: true }));

const BASE = { architectures: ['GPT2LMHeadModel'], model_type: 'gpt2', vocab_size: 61, n_positions: 48, n_embd: 32, n_layer: 2, n_head: 4 };
const dirs = {
  tied: join(root, 'tied-f32'),
  untied: join(root, 'untied-bf16-sharded'),
  legacy: join(root, 'legacy-f16'),
  small: join(root, 'small'),
};
let refs: Record<keyof typeof dirs, HfRef> | undefined;

/** The reference's directories, made once (one PyTorch process). */
function made(): Record<keyof typeof dirs, HfRef> {
  if (refs) return refs;
  const [tied, untied, legacy, small] = hfReference([
    { mode: 'make', dir: dirs.tied, config: { ...BASE, activation_function: 'gelu_new' }, seed: 1, dtype: 'float32' },
    { mode: 'make', dir: dirs.untied, config: { ...BASE, activation_function: 'gelu', tie_word_embeddings: false }, seed: 2, dtype: 'bfloat16', maxShardBytes: 12_000 },
    { mode: 'make', dir: dirs.legacy, config: { ...BASE, n_layer: 1 }, seed: 3, dtype: 'float16', legacy: true },
    { mode: 'make', dir: dirs.small, config: { ...BASE, n_layer: 1 }, seed: 4, dtype: 'float32' },
  ]) as [HfRef, HfRef, HfRef, HfRef];
  refs = { tied, untied, legacy, small };
  return refs;
}

test('directories the reference writes load with its logits to float64 rounding and its 20 greedy tokens', { skip }, () => {
  const r = made();
  const files = readdirSync(dirs.untied);
  assert.ok(files.includes('model.safetensors.index.json') && files.filter((f) => /^model-\d{5}-of-\d{5}\.safetensors$/.test(f)).length > 2, files.join(' '));
  const { model, config } = loadPretrained(dirs.tied);
  assert.ok(model instanceof GPT);
  assert.equal(config.arch, 'gpt');
  assert.equal(config.gelu, 'tanh');
  assert.equal(config.tieEmbeddings, true);
  model.dispose();
  assert.equal(loadPretrained(dirs.untied).config.gelu, 'exact');
  checkAgainst(dirs.tied, r.tied);
  checkAgainst(dirs.untied, r.untied);
  checkAgainst(dirs.legacy, r.legacy);
});

test('savePretrained writes exactly the tensors transformers expects (one file; shards with an index above the size) and loads back bit-identically', { skip }, () => {
  const r = made();
  // float32 weights read into float32 parameters are the stored bits.
  const a = loadPretrained(dirs.tied);
  const outA = join(root, 'out-tied');
  const wa = savePretrained(a.model, outA);
  assert.deepEqual(wa.files, ['model.safetensors']);
  assert.deepEqual(readdirSync(outA).sort(), ['config.json', 'model.safetensors']);
  const cfg = JSON.parse(readFileSync(join(outA, 'config.json'), 'utf8')) as Record<string, unknown>;
  assert.deepEqual([cfg.architectures, cfg.model_type, cfg.activation_function, cfg.tie_word_embeddings, cfg.n_embd], [['GPT2LMHeadModel'], 'gpt2', 'gelu_new', true, 32]);
  assert.ok(!readHfDir(outA).stored.has('lm_head.weight'), 'a tied head is not written');
  const backA = loadPretrained(outA);
  assertSameParameters(a.model, backA.model, 'float32 round trip');

  // bfloat16 weights, read as float64 and written as bfloat16, are the same numbers.
  const b = loadPretrained(dirs.untied, { dtype: 'float64' });
  const outB = join(root, 'out-untied');
  const wb = savePretrained(b.model, outB, { dtype: 'bfloat16', maxShardSize: '20KB' });
  assert.ok(wb.files.length > 1 && wb.files.every((f, k) => f === `model-0000${k + 1}-of-0000${wb.files.length}.safetensors`), wb.files.join(' '));
  const index = JSON.parse(readFileSync(join(outB, 'model.safetensors.index.json'), 'utf8')) as { metadata: { total_size: number }; weight_map: Record<string, string> };
  assert.equal(index.metadata.total_size, wb.bytes);
  assert.ok(index.weight_map['lm_head.weight'], 'an untied head is written');
  const backB = loadPretrained(outB, { dtype: 'float64' });
  assertSameParameters(b.model, backB.model, 'bfloat16 round trip');
  for (const m of [a.model, backA.model, b.model, backB.model]) m.dispose();

  // The reference reads both strictly (names, shapes, the index, {"format": "pt"}) with the same logits.
  const [ra, rb] = hfReference([{ mode: 'read', dir: outA }, { mode: 'read', dir: outB }]) as [HfRef, HfRef];
  assert.deepEqual(ra.greedy, r.tied.greedy);
  assert.deepEqual(rb.greedy, r.untied.greedy);
  checkAgainst(outA, r.tied);
  checkAgainst(outB, r.untied);
});

test('a directory that is not a supported GPT-2 is one error naming the field or tensor; nothing is written over a non-empty directory', { skip }, () => {
  made();
  const dir = dirs.small;
  const cfgPath = join(dir, 'config.json');
  const withCfg = (patch: Record<string, unknown>, re: RegExp) => withConfigPatch(cfgPath, patch, () => assert.throws(() => loadPretrained(dir), re));
  withCfg({ model_type: 'bert', architectures: ['BertModel'] }, /model_type "bert" is not supported; flotilla reads .*GPT2LMHeadModel/);
  withCfg({ architectures: ['GPT2Model'] }, /architectures = \["GPT2Model"\] is not supported.*GPT2LMHeadModel/);
  withCfg({ activation_function: 'relu' }, /activation_function = "relu" is not supported/);
  withCfg({ layer_norm_epsilon: 1e-6 }, /layer_norm_epsilon = 0.000001 is not supported/);
  withCfg({ n_embd: 48 }, /tensor 'transformer\.wte\.weight' is \[61, 32\], but config\.json implies \[61, 48\]/);
  withCfg({ n_layer: 2 }, /has no tensor 'transformer\.h\.1\.ln_1\.weight'/);
  withCfg({ n_layer: 1, tie_word_embeddings: false }, /no tensor 'lm_head\.weight'.*tie_word_embeddings/);
  withCfg({ vocab_size: 62 }, /'transformer\.wte\.weight' is \[61, 32\], but config\.json implies \[62, 32\]/);

  const { model } = loadPretrained(dir);
  const taken = join(root, 'taken');
  mkdirSync(taken);
  writeFileSync(join(taken, 'keep.txt'), 'mine');
  assert.throws(() => savePretrained(model, taken), /exists and is not empty; choose a new directory/);
  assert.deepEqual(readdirSync(taken), ['keep.txt']);
  // An empty directory is fine.
  const empty = join(root, 'empty');
  mkdirSync(empty);
  savePretrained(model, empty);
  assert.deepEqual(readdirSync(empty).sort(), ['config.json', 'model.safetensors']);
  assert.deepEqual(readdirSync(root).filter((f) => f.includes('.tmp-')), [], 'no temporary directory left behind');
  model.dispose();
});

test('a bias-free GPT is written as GPT-2 with zero biases and gives the same logits', () => {
  const m = new GPT({ vocabSize: 19, blockSize: 8, nLayer: 1, nHead: 2, nEmbd: 8, bias: false, gelu: 'tanh' }, { initSeed: 3 });
  const out = join(root, 'nobias');
  savePretrained(m, out);
  const back = loadPretrained(out);
  assert.equal(back.config.bias, true);
  assert.deepEqual(back.model.namedParameters().find(([n]) => n === 'layers.0.mlp.fc.bias')![1].toNumbers(), new Array(32).fill(0));
  const ids = tensor(Int32Array.from([1, 5, 7, 2]), { shape: [1, 4], dtype: 'int64' });
  assert.deepEqual(back.model.call(ids).logits.toNumbers(), m.call(ids).logits.toNumbers());
  m.dispose();
  back.model.dispose();
});

test('parseSize reads transformers-style sizes', () => {
  assert.equal(parseSize('2GB'), 2e9);
  assert.equal(parseSize('500MB'), 5e8);
  assert.equal(parseSize('1GiB'), 2 ** 30);
  assert.equal(parseSize(1234), 1234);
  assert.throws(() => parseSize('lots'), /not a size; write e\.g\. 2GB/);
});
