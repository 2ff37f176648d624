// Paths in a config file start from the file's directory, paths on the command line from the current
// directory ([Note: config paths] in src/train/config.ts): a config with its tokenizer and text beside
// it trains from another directory, and the run it writes samples from a third. A path that does not
// exist is one message naming the config file and the path it resolved to.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { copyFileSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { parse as parseToml } from 'smol-toml';
import { ConfigError, checkRunnable, loadConfig } from '../src/config/index.js';
import { loadMobyDick } from '../src/data/corpus.js';
import { NO_REPORT } from './helpers/cli.js';
import { tinyGptToml } from './fixtures/tiny_gpt.js';

const ROOT = resolve(import.meta.dirname, '..');
const BIN = join(ROOT, 'bin', 'flotilla.js');
const dir = mkdtempSync(join(tmpdir(), 'flotilla-paths-'));
const cfgDir = join(dir, 'project', 'configs');
const elsewhere = join(dir, 'elsewhere');
mkdirSync(join(cfgDir, 'tok'), { recursive: true });
mkdirSync(join(cfgDir, 'text'));
mkdirSync(elsewhere);
copyFileSync(join(ROOT, 'examples', 'moby-dick-bpe512.json'), join(cfgDir, 'tok', 'bpe.json'));
writeFileSync(join(cfgDir, 'text', 'book.txt'), loadMobyDick().slice(0, 40_000));

const config = join(cfgDir, 'run.toml');
writeFileSync(config, tinyGptToml({
  data: { tokenizer: 'tok/bpe.json', source: 'text/book.txt', globalBatch: 4 }, optim: undefined,
  train: { steps: 2, evalEvery: 0, evalBatches: 1 }, checkpoint: { every: 2 }, log: { progress: 'plain' },
}));

/** Runs `fn` with the current directory set to `cwd`. */
function inDir<T>(cwd: string, fn: () => T): T {
  const before = process.cwd();
  process.chdir(cwd);
  try {
    return fn();
  } finally {
    process.chdir(before);
  }
}

function flotilla(args: string[], cwd: string): { code: number | null; out: string; err: string } {
  const r = spawnSync(process.execPath, [BIN, ...args], { cwd, encoding: 'utf8', timeout: 240_000, env: { ...process.env, FLOTILLA_TEST_CHILD: '1', ...NO_REPORT } });
  return { code: r.status, out: r.stdout ?? '', err: r.stderr ?? '' };
}

test('relative paths in a config file resolve against its directory, from any working directory', () => {
  for (const [cwd, path] of [[elsewhere, config], [join(dir, 'project'), 'configs/run.toml'], [cfgDir, 'run.toml']] as const) {
    const c = inDir(cwd, () => loadConfig(path));
    assert.equal(c.data.tokenizer, join(cfgDir, 'tok', 'bpe.json'), `from ${cwd}`);
    assert.equal(c.model.vocabSize, 512, 'vocabSize = 0 followed the tokenizer beside the config');
    assert.equal(c.data.source, join(cfgDir, 'text', 'book.txt'));
    assert.deepEqual(inDir(cwd, () => checkRunnable(c, 1)), []);
  }
  // The example config names its tokenizer beside itself too.
  const demo = inDir(elsewhere, () => loadConfig(join(ROOT, 'examples', 'gpt-tiny.toml')));
  assert.equal(demo.data.tokenizer, join(ROOT, 'examples', 'moby-dick-bpe512.json'));
  assert.equal(demo.model.vocabSize, 512);
});

test('paths on the command line resolve against the current directory; names and absolute paths stay', () => {
  const c = inDir(cfgDir, () => loadConfig(join(dir, 'project', 'configs', 'run.toml'), ['--data.tokenizer=tok/bpe.json', '--data.sources=text/book.txt:1,moby-dick:2', '--data.valSource=text/book.txt']));
  assert.equal(c.data.tokenizer, join(cfgDir, 'tok', 'bpe.json'));
  assert.deepEqual(c.data.sources, [{ path: join(cfgDir, 'text', 'book.txt'), weight: 1 }, { path: 'moby-dick', weight: 2 }]);
  assert.equal(c.data.valSource, join(cfgDir, 'text', 'book.txt'));
  const named = inDir(elsewhere, () => loadConfig(config, ['--data.tokenizer=byte', '--data.source=moby-dick', '--train.initFrom=/abs/ckpt']));
  assert.equal(named.data.tokenizer, 'byte');
  assert.equal(named.model.vocabSize, 256);
  assert.equal(named.data.source, 'moby-dick');
  assert.equal(named.train.initFrom, '/abs/ckpt');
  assert.equal(named.train.runDir, '', 'outputs are not resolved: runs go where the command runs');
  assert.throws(() => inDir(elsewhere, () => loadConfig(config, ['--data.tokenizer=tok/bpe.json'])), (e: unknown) => {
    assert.ok(e instanceof ConfigError);
    assert.equal(e.problems.length, 1);
    assert.equal(e.message, `${config}: --data.tokenizer=tok/bpe.json (relative to the current directory) is ${join(elsewhere, 'tok', 'bpe.json')}, which does not exist; correct the path, or use "byte" or "gpt2"`);
    return true;
  });
});

test('a bad relative path is one error naming the config file and the path it resolved to', () => {
  const bad = join(cfgDir, 'bad.toml');
  writeFileSync(bad, '[data]\ntokenizer = "toks/bpe.json"\n');
  assert.throws(() => inDir(elsewhere, () => loadConfig(bad)), (e: unknown) => {
    assert.ok(e instanceof ConfigError);
    assert.equal(e.message, `${bad}: data.tokenizer = "toks/bpe.json" in the config file (relative to its directory) is ${join(cfgDir, 'toks', 'bpe.json')}, which does not exist; correct the path, or use "byte" or "gpt2"`);
    return true;
  });
  // With model.vocabSize given the tokenizer is checked with the data, before any rank starts.
  writeFileSync(bad, '[model]\nvocabSize = 512\n[data]\ntokenizer = "toks/bpe.json"\nsource = "texts/book.txt"\n');
  const c = inDir(elsewhere, () => loadConfig(bad));
  const p = checkRunnable(c, 1);
  assert.equal(p.length, 1, p.join('\n'));
  assert.match(p[0]!, new RegExp(`no such file ${join(cfgDir, 'toks', 'bpe.json')}.*\\[data\\.tokenizer = "toks/bpe\\.json" in the config file \\(relative to its directory\\)\\]$`));
  const p2 = checkRunnable(inDir(elsewhere, () => loadConfig(bad, ['--data.tokenizer=byte'])), 1);
  assert.equal(p2.length, 1, p2.join('\n'));
  assert.match(p2[0]!, new RegExp(`text file ${join(cfgDir, 'texts', 'book.txt')} does not exist.*\\[data\\.source = "texts/book\\.txt" in the config file \\(relative to its directory\\)\\]$`));
  // The command line: exit 2, one line, nothing written.
  const r = flotilla(['train', bad, '--train.runDir=never'], elsewhere);
  assert.equal(r.code, 2, r.out + r.err);
  assert.equal(r.err.trim().split('\n').length, 1, r.err);
  assert.ok(r.err.includes(bad) && r.err.includes(join(cfgDir, 'toks', 'bpe.json')), r.err);
  assert.ok(!existsSync(join(elsewhere, 'never')));
});

test('trained from another directory, the run resumes and samples from a third', () => {
  const runDir = join(dir, 'runs', 'r');
  const tr = flotilla(['train', config, `--train.runDir=${runDir}`], elsewhere);
  assert.equal(tr.code, 0, tr.out + tr.err);
  assert.match(tr.out, /\[data\] .*book\.txt: .*bpe\.json tokens \(vocabulary 512\)/);
  // The saved config names the tokenizer and the text by absolute paths, so it works from anywhere.
  const saved = parseToml(readFileSync(join(runDir, 'config.toml'), 'utf8')) as { data: { tokenizer: string; source: string }; model: { vocabSize: number } };
  assert.equal(saved.data.tokenizer, join(cfgDir, 'tok', 'bpe.json'));
  assert.equal(saved.data.source, join(cfgDir, 'text', 'book.txt'));
  assert.equal(saved.model.vocabSize, 512);
  const third = join(dir, 'third');
  mkdirSync(third);
  const res = flotilla(['train', join(runDir, 'config.toml'), `--train.runDir=${runDir}`, '--train.steps=3', '--resume'], third);
  assert.equal(res.code, 0, res.out + res.err);
  assert.match(res.out, /step 3\/3/);
  const g = flotilla(['generate', runDir, '--prompt', 'Call me Ishmael.', '--tokens', '8', '--seed', '1'], third);
  assert.equal(g.code, 0, g.out + g.err);
  assert.match(g.out, /^Call me Ishmael\./);
});

test.after(() => rmSync(dir, { recursive: true, force: true }));
