// The typed TOML config: defaults, overrides, and errors that name the field.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parse as parseToml } from 'smol-toml';
import {
  ConfigError, checkRunnable, configSchema, configToToml, defaultConfig, loadConfig, parseConfig, parseOverrides, validateConfig,
} from '../src/config/index.js';
import { runDirOf } from '../src/train/run_dir.js';
import { schemaDefaults } from '../src/config/schema.js';
import { modelArchs, modelSpec, registerModel } from '../src/models/registry.js';
import { defaultGPTConfig } from '../src/models/gpt_config.js';
import { defaultLlamaConfig } from '../src/models/llama_config.js';

test('every field has a doc line and a default, and the defaults validate', () => {
  for (const [section, spec] of Object.entries(configSchema)) {
    assert.ok(spec.doc.length > 0, `[${section}] has no doc`);
    for (const [name, f] of Object.entries(spec.fields as Record<string, { doc: string; default: unknown }>)) {
      assert.ok(f.doc.length > 10, `${section}.${name} has no doc`);
      assert.notEqual(f.default, undefined, `${section}.${name} has no default`);
    }
  }
  assert.deepEqual(parseConfig(''), defaultConfig());
});

test('TOML values replace defaults; CLI overrides win over the file', () => {
  const text = '[model]\nnLayer = 2\nnEmbd = 64\n[optim]\nlr = 3e-3\n[train]\nname = "demo"\n';
  const c = parseConfig(text, ['--optim.lr=1e-4', '--train.steps', '7', '--model.bias=false', '--data.source=/tmp/x.txt']);
  assert.equal(c.model.nLayer, 2);
  assert.equal(c.model.nEmbd, 64);
  assert.equal(c.model.nHead, 4, 'untouched fields keep their default');
  assert.equal(c.optim.lr, 1e-4);
  assert.equal(c.train.steps, 7);
  assert.equal(c.model.bias, false);
  assert.equal(c.data.source, '/tmp/x.txt');
  assert.equal(runDirOf(c), 'runs/demo');
  assert.equal(runDirOf(parseConfig('', ['--train.runDir=/tmp/r'])), '/tmp/r');
  // A whole number is accepted where a float is expected.
  assert.equal(parseConfig('[optim]\nlr = 1\nminLr = 0\n').optim.lr, 1);
});

test('unknown sections and keys are errors that list the valid ones', () => {
  assert.throws(() => parseConfig('[model]\nnlayer = 3\n', [], 'x.toml'), (e: unknown) => {
    assert.ok(e instanceof ConfigError);
    assert.match(e.message, /^x\.toml: unknown key model\.nlayer \(did you mean nLayer\?\); valid keys in \[model\]: vocabSize, blockSize, nLayer, nHead/);
    return true;
  });
  assert.throws(() => parseConfig('[optimizer]\nlr = 1\n'), /unknown section \[optimizer\].*valid sections: model, moe, lora, dpo, data, optim, train, parallel, checkpoint, log/);
  assert.throws(() => parseConfig('steps = 3\n'), /unknown section "steps"; valid sections/);
  assert.throws(() => parseConfig('', ['--train.stpes=3']), /unknown key --train\.stpes \(did you mean steps\?\); valid keys in \[train\]: name, runDir, steps/);
  assert.throws(() => parseConfig('', ['--nope.x=3']), /unknown section --nope\.x; valid sections/);
});

test('wrong types and ranges name the field', () => {
  assert.throws(() => parseConfig('[model]\nnLayer = 2.5\n'), /model\.nLayer must be an integer, got 2\.5/);
  assert.throws(() => parseConfig('[model]\nbias = "yes"\n'), /model\.bias must be true or false, got "yes"/);
  assert.throws(() => parseConfig('[optim]\nlr = "fast"\n'), /optim\.lr must be a finite number, got "fast"/);
  assert.throws(() => parseConfig('[optim]\nlr = 0\n'), /optim\.lr must be > 0, got 0/);
  assert.throws(() => parseConfig('[model]\ndropout = 1\n'), /model\.dropout must be < 1, got 1/);
  assert.throws(() => parseConfig('[log]\nprogress = "fancy"\n'), /log\.progress must be one of "auto", "bar", "plain", "off", got "fancy"/);
  assert.throws(() => parseConfig('', ['--train.steps=ten']), /--train\.steps must be an integer, got "ten"/);
  assert.throws(() => parseConfig('', ['--model.bias=yes']), /--model\.bias must be true or false/);
  assert.throws(() => parseConfig('', ['--optim.lr=']), /--optim\.lr must be a number/);
  assert.throws(() => parseConfig('', ['--optim.lr']), /--optim\.lr needs a value/);
  assert.throws(() => parseConfig('', ['lr=3']), /cannot read override "lr=3"; write --section\.field=value/);
  assert.throws(() => parseConfig('[model\n'), /not valid TOML/);
});

test('cross-field rules', () => {
  assert.throws(() => parseConfig('[model]\nnEmbd = 100\nnHead = 3\n'), /model\.nEmbd \(100\) must be divisible by model\.nHead \(3\)/);
  assert.throws(() => parseConfig('[data]\nseqLen = 256\n'), /data\.seqLen \(256\) must be <= model\.blockSize \(128\)/);
  assert.throws(() => parseConfig('[optim]\nlr = 1e-4\nminLr = 1e-3\n'), /optim\.minLr \(0\.001\) must be <= optim\.lr \(0\.0001\)/);
  assert.throws(() => parseConfig('[data]\nglobalBatch = 10\n[parallel]\ndp = 4\n'), /data\.globalBatch \(10\) must be a multiple of parallel\.dp x data\.microBatches \(4 x 1 = 4\)/);
  assert.throws(() => parseConfig('[parallel]\ndp = 0\n'), /parallel\.dp must be -1/);
});

test('the [model] defaults are the models\' own configs (vocabSize 0: the tokenizer\'s)', () => {
  const m = schemaDefaults().model as unknown as Record<string, unknown>;
  for (const [k, v] of Object.entries({ ...defaultLlamaConfig, ...defaultGPTConfig })) assert.equal(m[k], k === 'vocabSize' ? 0 : v, `model.${k}`);
  assert.equal(m.arch, 'gpt');
});

test('one map of architectures: a registered spec is a choice of model.arch for the validation and the registry alike', () => {
  assert.deepEqual(modelArchs(), ['gpt', 'llama']);
  assert.throws(() => parseConfig('', ['--model.arch=mine']), /model\.arch = "mine" is not a known architecture; choose one of "gpt", "llama"/);
  const mine = { ...modelSpec('gpt'), arch: 'mine' };
  registerModel(mine);
  assert.equal(parseConfig('', ['--model.arch=mine']).model.arch, 'mine');
  assert.equal(modelSpec('mine'), mine);
  assert.throws(() => registerModel({ ...modelSpec('gpt') }), /a model architecture "gpt" is already registered/);
});

test('[optim] name chooses the optimizer; an unknown name is a config error listing the known ones', () => {
  assert.equal(parseConfig('').optim.name, 'adamw');
  assert.equal(parseConfig('[optim]\nname = "sgd"\n').optim.name, 'sgd');
  assert.throws(() => parseConfig('[optim]\nname = "adam"\n'), (e: unknown) => {
    assert.ok(e instanceof ConfigError);
    assert.match(e.message, /optim\.name = "adam" is not a known optimizer; choose one of "adamw", "sgd"/);
    return true;
  });
});

test('several problems are reported together', () => {
  assert.throws(() => parseConfig('[model]\nnLayers = 1\n[optim]\nlr = -1\n'), (e: unknown) => {
    assert.ok(e instanceof ConfigError);
    assert.equal(e.problems.length, 2);
    assert.match(e.message, /2 problems in the config:\n {2}- unknown key model\.nLayers.*\n {2}- optim\.lr must be > 0/);
    return true;
  });
});

test('parseOverrides accepts both --a.b=v and --a.b v', () => {
  const { raw, problems } = parseOverrides(['--optim.lr=3e-4', '--train.name', 'x', '--model.tieEmbeddings=true']);
  assert.deepEqual(problems, []);
  assert.deepEqual(raw, { optim: { lr: 3e-4 }, train: { name: 'x' }, model: { tieEmbeddings: true } });
});

test('the resolved config saves as documented TOML that loads back identically', () => {
  const c = parseConfig('', ['--optim.lr=3e-4', '--train.name=with "quotes" \\ and more', '--model.dropout=0.1']);
  const text = configToToml(c, { header: 'resolved' });
  assert.match(text, /^# resolved\n/);
  assert.match(text, /# Peak learning rate/);
  assert.deepEqual(JSON.parse(JSON.stringify(parseToml(text))), JSON.parse(JSON.stringify(c)));
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-config-'));
  writeFileSync(join(dir, 'c.toml'), text);
  assert.deepEqual(loadConfig(join(dir, 'c.toml')), c);
  assert.throws(() => loadConfig(join(dir, 'missing.toml')), /config file .*missing\.toml does not exist/);
});

test('the example config is valid: the demo trains on the 512-id BPE beside it', () => {
  const c = loadConfig(join(import.meta.dirname, '..', 'examples', 'gpt-tiny.toml'));
  assert.equal(c.model.vocabSize, 512);
  assert.equal(c.data.tokenizer, join(import.meta.dirname, '..', 'examples', 'moby-dick-bpe512.json'));
  assert.equal(c.data.source, 'moby-dick');
  assert.deepEqual(checkRunnable(c, 2), []);
});

test('checkRunnable: the config against the world it will run in', () => {
  const c = parseConfig('', ['--data.globalBatch=12', '--data.microBatches=2']);
  assert.deepEqual(checkRunnable(c, 1), []);
  assert.deepEqual(checkRunnable(c, 2), []);
  assert.deepEqual(checkRunnable(c, 3), []);
  assert.match(checkRunnable(c, 4).join('\n'), /data\.globalBatch=12 does not split over 4 data-parallel rank\(s\) x 2 micro-batch\(es\) = 8 equal parts; set data\.globalBatch to a multiple of 8 \(e\.g\. 8 or 16\)/);
  const fixed = parseConfig('', ['--parallel.dp=2']);
  assert.deepEqual(checkRunnable(fixed, 2), []);
  assert.match(checkRunnable(fixed, 1).join('\n'), /parallel\.dp=2 but the world has 1 rank\(s\)/);
  assert.match(checkRunnable(parseConfig('', ['--data.source=/no/such.txt']), 1).join('\n'), /data\.source: text file \/no\/such\.txt does not exist/);
});

test('sharding layouts: one clear error per mistake, naming the field and the fix', () => {
  const err = (overrides: string[]) => {
    try {
      parseConfig('', overrides);
      return '';
    } catch (e) {
      return (e as Error).message;
    }
  };
  assert.equal(err(['--parallel.zero=3', '--parallel.dpReplicate=2']), '');
  assert.match(err(['--parallel.zero=4']), /parallel\.zero/);
  assert.match(err(['--parallel.dpReplicate=2']), /parallel\.zero = 0 replicates everything; set parallel\.zero to 1, 2 or 3/);
  assert.match(err(['--parallel.zero=1', '--parallel.accumulate=reduceEach']), /"reduceEach" reduces into gradient shards, which parallel\.zero = 1 does not keep; use "reduceLast"/);
  assert.match(err(['--parallel.zero=2', '--parallel.accumulate=reduceScatterEachAllReduceLast']), /is for hybrid sharding: set parallel\.dpReplicate > 1/);
  assert.doesNotMatch(err(['--parallel.zero=2', '--parallel.pp=2']), /pipeline/);
  assert.doesNotMatch(err(['--parallel.zero=3', '--parallel.pp=2']), /pipeline/);
  assert.equal(err(['--parallel.zero=3', '--parallel.pp=2', '--parallel.dpReplicate=2']), '', 'hybrid sharding inside a pipeline is a valid layout');
  assert.match(err(['--parallel.zero=2', '--parallel.pp=2', '--parallel.accumulate=reduceEach']), /a pipeline reduces its gradients once per step; use "auto" or "reduceLast"/);
  assert.match(err(['--parallel.accumulate=sometimes']), /parallel\.accumulate/);
  // Against the world: dpReplicate x dpShard must be the data-parallel ranks.
  const hsdp = parseConfig('', ['--parallel.zero=2', '--parallel.dpReplicate=2', '--data.globalBatch=8']);
  assert.deepEqual(checkRunnable(hsdp, 4), []);
  assert.match(checkRunnable(hsdp, 3).join('\n'), /parallel\.dpReplicate=2 x parallel\.dpShard=-1 \(3 \/ 2\) must equal the 3 data-parallel rank\(s\)/);
  const fixed = parseConfig('', ['--parallel.zero=3', '--parallel.dpShard=3', '--data.globalBatch=12']);
  assert.match(checkRunnable(fixed, 2).join('\n'), /dpShard=3 must equal the 2 data-parallel rank\(s\)/);
});

test('context parallelism: seqLen, MoE, dropout, ep and the world checked before any rank starts, each naming the fix', () => {
  const err = (overrides: string[]) => {
    try {
      parseConfig('', overrides);
      return '';
    } catch (e) {
      return (e as Error).message;
    }
  };
  assert.equal(err(['--parallel.cp=2', '--data.seqLen=64']), '');
  assert.match(err(['--parallel.cp=3', '--data.seqLen=64']), /data\.seqLen \(64\) must divide by 2 x parallel\.cp = 6 .*choose a seqLen that is a multiple of 6, or another cp/);
  assert.match(err(['--parallel.cp=2', '--data.seqLen=68', '--parallel.tp=4', '--parallel.sequenceParallel=true', '--model.nHead=4']), /a context-parallel rank's 34 tokens \(data\.seqLen \/ parallel\.cp\) must divide by parallel\.tp = 4 under sequenceParallel/);
  // MoE blocks run under cp, and expert parallelism borrows its ranks from dpShard x cp.
  assert.equal(err(['--parallel.cp=2', '--data.seqLen=64', '--moe.experts=4']), '');
  assert.equal(err(['--parallel.cp=2', '--data.seqLen=64', '--parallel.ep=2', '--moe.experts=4']), '');
  assert.match(err(['--parallel.cp=2', '--model.dropout=0.1']), /ring attention has no attention dropout; set model\.dropout = 0 or parallel\.cp = 1/);
  const epcp = (ep: number, more: string[] = []) => parseConfig('', ['--parallel.cp=2', '--data.seqLen=64', `--parallel.ep=${ep}`, '--moe.experts=8', '--data.globalBatch=8', ...more]);
  assert.deepEqual(checkRunnable(epcp(4), 4), []);
  assert.match(checkRunnable(epcp(8), 4).join('\n'), /parallel\.ep = 8 must divide the 2 data-parallel rank\(s\) x parallel\.cp \(2\) = 4 \(expert-parallel ranks are carved from them\); choose an ep that divides 4/);
  const hsdp = ['--parallel.zero=2', '--parallel.dpReplicate=2', '--parallel.dpShard=2'];
  assert.deepEqual(checkRunnable(epcp(4, hsdp), 8), []);
  assert.match(checkRunnable(epcp(8, hsdp), 8).join('\n'), /parallel\.ep = 8 must divide parallel\.dpShard \(2\) x parallel\.cp \(2\) = 4: expert-parallel ranks are carved from the shard ranks of one replica/);
  // Against the world: pp x cp x tp must divide it, and dp is what is left.
  const cp = parseConfig('', ['--parallel.cp=2', '--parallel.tp=2', '--data.globalBatch=4']);
  assert.deepEqual(checkRunnable(cp, 4), []);
  assert.deepEqual(checkRunnable(cp, 8), []);
  assert.match(checkRunnable(cp, 6).join('\n'), /parallel\.pp=1 x parallel\.cp=2 x parallel\.tp=2 = 4 does not divide the world of 6 rank\(s\)/);
  assert.match(checkRunnable(parseConfig('', ['--parallel.cp=2', '--data.globalBatch=3']), 4).join('\n'), /data\.globalBatch=3 does not split over 2 data-parallel rank\(s\)/);
});

test('[lora] targets: a TOML array, a comma list on the command line, round-tripped through the saved config; a bad value names the field', () => {
  const base = '[model]\narch = "llama"\n[train]\ninitFrom = "/some/base"\n[lora]\nrank = 4\n';
  const c = parseConfig(`${base}targets = ["q_proj", "v_proj"]\n`);
  assert.deepEqual(c.lora.targets, ['q_proj', 'v_proj']);
  assert.deepEqual(parseConfig(base, ['--lora.targets=q_proj,v_proj']).lora.targets, ['q_proj', 'v_proj']);
  assert.deepEqual(parseConfig(base, ['--lora.targets=["o_proj"]']).lora.targets, ['o_proj']);
  assert.deepEqual(parseConfig(base).lora.targets, ['all-linear']);
  // The saved config.toml holds targets as a TOML array and loads back the same.
  const text = configToToml(c, { header: 'resolved' });
  assert.match(text, /^\[lora\]$[\s\S]*^targets = \["q_proj", "v_proj"\]$/m);
  assert.deepEqual(parseConfig(text), c);
  assert.throws(() => parseConfig(`${base}targets = "q_proj"\n`), /lora\.targets must be an array of names, e\.g\. \["q_proj", "v_proj"\], got/);
  assert.throws(() => parseConfig(`${base}targets = ["q_proj", 3]\n`), /lora\.targets must be an array of names/);
  assert.throws(() => parseConfig(base, ['--lora.targets=[q_proj']), /--lora\.targets is not a JSON array .* write --lora\.targets=a,b/);
});

test('[lora] rules before any rank starts: a base to adapt, targets that name Linears of the model, a rank they can hold; tensor parallelism welcome', () => {
  const llama = ['--model.arch=llama', '--model.vocabSize=64', '--model.nLayer=2', '--model.nEmbd=32', '--model.nHead=4', '--model.nKvHead=2', '--model.intermediateSize=48'];
  const ok = [...llama, '--lora.rank=4', '--train.initFrom=/some/base'];
  assert.deepEqual(validateConfig(parseConfig('', ok)), []);
  assert.throws(() => parseConfig('', [...llama, '--lora.rank=4']), /LoRA trains adapters on a frozen base: set train\.initFrom to a Hugging Face directory or a checkpoint/);
  assert.throws(() => parseConfig('', [...ok, '--lora.targets=q_proj,c_attn']),
    /lora\.targets: target "c_attn" matches no Linear of this model; its Linears are named "down", "down_proj", "gate", "gate_proj", "head", "k", "k_proj", "lm_head", "o", "o_proj", "q", "q_proj", "up", "up_proj", "v", "v_proj" \(or use "all-linear"\)/);
  // k_proj is 32 -> 2 heads x 8 = 16 wide: rank 17 does not fit; q_proj (32 -> 32) takes it.
  assert.throws(() => parseConfig('', [...ok, '--lora.rank=17', '--lora.targets=k_proj']), /lora\.rank: rank 17 is larger than the smaller dimension of layers\.0\.attn\.k \(16 x 32\); use a rank of at most 16/);
  assert.deepEqual(validateConfig(parseConfig('', [...ok, '--lora.rank=17', '--lora.targets=q_proj'])), []);
  assert.throws(() => parseConfig('', [...ok, '--lora.targets=']), /lora\.targets is empty; name the modules to adapt/);
  // Tensor parallelism splits adapters with their base (test/lora_tp.test.ts).
  assert.deepEqual(validateConfig(parseConfig('', [...ok, '--parallel.tp=2', '--parallel.sequenceParallel=true'])), []);
  // GPT-2's Conv1D names and flotilla's module paths both resolve; the vocabulary may be unresolved (0).
  assert.deepEqual(validateConfig(parseConfig('', ['--lora.rank=2', '--train.initFrom=/b', '--lora.targets=c_attn,layers.0.mlp.fc'])), []);
});

test('[moe] denseLayers: a TOML array or a comma list of block indices, round-tripped through the saved config; blocks the model lacks and a list that leaves no experts are refused', () => {
  const base = '[model]\narch = "llama"\nnLayer = 4\n[moe]\nexperts = 4\ntopK = 2\n';
  const c = parseConfig(`${base}denseLayers = [0, 2]\n`);
  assert.deepEqual(c.moe.denseLayers, [0, 2]);
  assert.deepEqual(parseConfig(base, ['--moe.denseLayers=1,3']).moe.denseLayers, [1, 3]);
  assert.deepEqual(parseConfig(base).moe.denseLayers, []);
  assert.deepEqual(parseConfig(configToToml(c, { header: 'resolved' })), c);
  assert.throws(() => parseConfig(`${base}denseLayers = [0.5]\n`), /moe\.denseLayers must be an array of whole numbers, e\.g\. \[0, 3\]/);
  assert.throws(() => parseConfig(base, ['--moe.denseLayers=a']), /--moe\.denseLayers must be whole numbers separated by commas/);
  assert.throws(() => parseConfig(base, ['--moe.denseLayers=4']), /moe\.denseLayers \(\[4\]\) must list blocks from 0 to model\.nLayer - 1 \(3\)/);
  assert.throws(() => parseConfig(base, ['--moe.every=2', '--moe.denseLayers=1,3']), /moe\.denseLayers \(\[1,3\]\) leaves no block with experts/);
});
