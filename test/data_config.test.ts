// The [data] fields: sources in TOML and on the command line, their errors, the TOML round trip of
// the resolved config, and model.vocabSize following data.tokenizer.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { ConfigError, checkRunnable, configToToml, parseConfig } from '../src/config/index.js';
import { prepare } from '../src/data/prepare.js';
import { writeFileSync } from 'node:fs';

test('data.sources from TOML and from --data.sources, and back through the saved TOML', () => {
  const c = parseConfig('[data]\nsources = [{ path = "a", weight = 0.7 }, { path = "b", weight = 0.3 }]\n');
  // Relative paths become absolute (text without a file: from the current directory).
  assert.deepEqual(c.data.sources, [{ path: resolve('a'), weight: 0.7 }, { path: resolve('b'), weight: 0.3 }]);
  const o = parseConfig('', ['--data.sources=/x/web:2,/x/books:1']);
  assert.deepEqual(o.data.sources, [{ path: '/x/web', weight: 2 }, { path: '/x/books', weight: 1 }]);
  assert.deepEqual(parseConfig('', ['--data.sources=[{"path":"p","weight":1}]']).data.sources, [{ path: resolve('p'), weight: 1 }]);
  assert.deepEqual(parseConfig(configToToml(o)).data.sources, o.data.sources);
  assert.deepEqual(parseConfig('').data.sources, []);
});

test('bad sources are config errors naming the field', () => {
  const bad: [string, string[], RegExp][] = [
    ['[data]\nsources = [{ path = "a", weight = 0 }]\n', [], /data\.sources must be an array of \{ path = "\.\.\.", weight = number > 0 \}; the weight of a is 0/],
    ['[data]\nsources = [{ path = "a", weight = 1, wieght = 2 }]\n', [], /unknown key wieght in the entry for a/],
    ['[data]\nsources = "a"\n', [], /data\.sources must be an array/],
    ['', ['--data.sources=a'], /--data\.sources entry "a" needs a weight: write path:weight/],
  ];
  for (const [toml, cli, re] of bad) assert.throws(() => parseConfig(toml, cli), (e: unknown) => e instanceof ConfigError && re.test((e as Error).message));
});

test('model.vocabSize follows data.tokenizer unless set; too small is an error before any rank starts', async () => {
  assert.equal(parseConfig('').model.vocabSize, 256);
  assert.equal(parseConfig('', ['--data.tokenizer=gpt2']).model.vocabSize, 50257);
  assert.equal(parseConfig('', ['--data.tokenizer=gpt2', '--model.vocabSize=50304']).model.vocabSize, 50304, 'padded, as nanoGPT does');
  assert.throws(() => parseConfig('', ['--data.tokenizer=/no/such/tokenizer.json']), /data\.tokenizer: tokenizer "\/no\/such\/tokenizer\.json": no such file/);
  const small = parseConfig('', ['--data.tokenizer=gpt2', '--model.vocabSize=1000']);
  assert.match(checkRunnable(small, 1).join('\n'), /model\.vocabSize = 1000 is below the 50257 ids of data\.tokenizer = "gpt2"/);
  // A prepared directory made with bytes, read as GPT-2: named with the fix.
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-datacfg-'));
  writeFileSync(join(dir, 'a.txt'), 'Call me Ishmael. '.repeat(40));
  await prepare({ sources: [join(dir, 'a.txt')], tokenizer: 'byte', out: join(dir, 'ds'), workers: 0, print: () => {}, progress: false });
  assert.deepEqual(checkRunnable(parseConfig('', [`--data.source=${join(dir, 'ds')}`]), 1), []);
  assert.match(checkRunnable(parseConfig('', [`--data.source=${join(dir, 'ds')}`, '--data.tokenizer=gpt2']), 1).join('\n'), /was prepared with tokenizer byte .* set data\.tokenizer = "byte"/);
  assert.match(checkRunnable(parseConfig('', [`--data.source=${dir}`]), 1).join('\n'), /is a directory without manifest\.json; prepare it with `flotilla prepare/);
  assert.match(checkRunnable(parseConfig('', [`--data.valSource=${join(dir, 'missing')}`]), 1).join('\n'), /data\.valSource: text file .*missing does not exist/);
});
