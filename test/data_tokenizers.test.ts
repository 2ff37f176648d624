// Tokenizers: GPT-2's published ids, round trips, the BPE trainer and its tokenizer.json, and the
// errors loadTokenizer and `flotilla tokenizer train` give.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { loadTokenizer, tokenizerIdentity } from '../src/data/tokenizer.js';
import { WordCounter, trainBpe, GPT2_SPLIT } from '../src/data/bpe_train.js';
import { loadMobyDick } from '../src/data/corpus.js';

const ROOT = resolve(import.meta.dirname, '..');
const dir = mkdtempSync(join(tmpdir(), 'flotilla-tok-'));
const SAMPLES = ['Call me Ishmael.', 'naïve café — “quoted” 🐋 日本語', '  leading spaces\n\n\ttabs', "it's we'll they've 12345 3.14", '<|endoftext|> inside text', ''];

test('GPT-2: the published ids for fixed strings, <|endoftext|> = 50256, and round trips', async () => {
  const tok = await loadTokenizer('gpt2');
  assert.equal(tok.vocabSize, 50257);
  assert.equal(tok.eot, 50256);
  assert.deepEqual(Array.from(tok.encode('Hello world')), [15496, 995]);
  assert.deepEqual(Array.from(tok.encode('hello world')), [31373, 995]);
  assert.deepEqual(Array.from(tok.encode('The quick brown fox')), [464, 2068, 7586, 21831]);
  assert.deepEqual(Array.from(tok.encode(' the')), [262]);
  // Special-token text in a document is ordinary text (nanoGPT's encode_ordinary), never id 50256.
  assert.ok(!Array.from(tok.encode('a <|endoftext|> b')).includes(50256));
  for (const s of SAMPLES) assert.equal(tok.decode(tok.encode(s)), s);
  assert.equal(tok.identity, tokenizerIdentity('gpt2').identity);
});

test('byte tokenizer through loadTokenizer: 256 ids, NUL between documents', async () => {
  const tok = await loadTokenizer('byte');
  assert.equal(tok.vocabSize, 256);
  assert.equal(tok.eot, 0);
  for (const s of SAMPLES) assert.equal(tok.decode(tok.encode(s)), s);
});

test('BPE training: deterministic, the asked vocabulary, and a tokenizer.json that round-trips any text', async () => {
  const text = loadMobyDick().slice(0, 300_000);
  const counts = new WordCounter();
  counts.add(text);
  const a = trainBpe(counts.counts, 600);
  const b = trainBpe(counts.counts, 600);
  assert.deepEqual(a.json, b.json, 'the same corpus gives the same merges');
  assert.equal(a.vocabSize, 600);
  const path = join(dir, 'bpe600.json');
  writeFileSync(path, JSON.stringify(a.json));
  const tok = await loadTokenizer(path);
  assert.equal(tok.vocabSize, 600);
  assert.equal(tok.eot, 599);
  for (const s of [...SAMPLES, text.slice(1000, 5000)]) {
    const ids = Array.from(tok.encode(s));
    assert.ok(ids.every((v) => v >= 0 && v < 600));
    assert.equal(tok.decode(ids), s);
  }
  // The piece-by-piece encoder equals the library's own on text without special tokens.
  const sample0 = text.slice(0, 50_000);
  assert.deepEqual(Array.from(tok.encode(sample0)), (tok as unknown as { encodeReference(t: string): number[] }).encodeReference(sample0));
  // Merges compress: fewer ids than bytes on the text it learned from.
  const sample = text.slice(0, 20_000);
  assert.ok(tok.encode(sample).length < 0.6 * Buffer.byteLength(sample), 'a 600-id BPE should take well under 0.6 ids per byte');
  // The first merge is the most frequent adjacent byte pair over the pre-tokenized words.
  const pairs = new Map<string, number>();
  for (const m of text.matchAll(GPT2_SPLIT)) {
    const bytes = Buffer.from(m[0], 'utf8');
    for (let i = 0; i + 1 < bytes.length; i++) {
      const k = `${bytes[i]},${bytes[i + 1]}`;
      pairs.set(k, (pairs.get(k) ?? 0) + 1);
    }
  }
  const best = [...pairs.entries()].sort((x, y) => y[1] - x[1] || (x[0] < y[0] ? -1 : 1))[0]![0].split(',').map(Number);
  const first = (a.json.model as { merges: string[] }).merges[0]!;
  const map = (await import('../src/data/bpe_train.js')).bytesToUnicode();
  assert.equal(first, `${map[best[0]!]} ${map[best[1]!]}`);
  // The identity is the file's digest: another file, another identity.
  writeFileSync(join(dir, 'bpe601.json'), JSON.stringify(trainBpe(counts.counts, 601).json));
  assert.notEqual(tokenizerIdentity(join(dir, 'bpe601.json')).identity, tok.identity);
});

test('loadTokenizer errors name the file and the fix', async () => {
  await assert.rejects(loadTokenizer(join(dir, 'nope.json')), /no such file .*nope\.json; use "byte", "gpt2" or the path of a tokenizer\.json/);
  writeFileSync(join(dir, 'bad.json'), '{ not json');
  await assert.rejects(loadTokenizer(join(dir, 'bad.json')), /bad\.json is not JSON/);
  writeFileSync(join(dir, 'nomodel.json'), '{"version":"1.0"}');
  await assert.rejects(loadTokenizer(join(dir, 'nomodel.json')), /has no "model" table/);
});

test('flotilla tokenizer train writes a tokenizer.json; bad arguments exit 2 and write nothing', () => {
  const out = join(dir, 'cli.json');
  const corpus = join(dir, 'corpus.txt');
  writeFileSync(corpus, loadMobyDick().slice(0, 100_000));
  const run = (args: string[]) => spawnSync(process.execPath, [join(ROOT, 'bin', 'flotilla.js'), 'tokenizer', ...args], { cwd: ROOT, encoding: 'utf8' });
  const r = run(['train', '--vocab', '300', corpus, '--out', out]);
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /300 ids \(256 bytes, 43 merges, <\|endoftext\|> = 299\)/);
  assert.equal(tokenizerIdentity(out).vocabSize, 300);
  const again = run(['train', '--vocab', '300', corpus, '--out', out]);
  assert.equal(again.status, 2);
  assert.match(again.stderr, /already exists; choose another --out/);
  const small = run(['train', '--vocab', '100', corpus, '--out', join(dir, 'x.json')]);
  assert.equal(small.status, 2);
  assert.match(small.stderr, /--vocab N needs an integer >= 257/);
  const missing = run(['train', '--vocab', '300', join(dir, 'missing.txt'), '--out', join(dir, 'y.json')]);
  assert.equal(missing.status, 2);
  assert.match(missing.stderr, /missing\.txt does not exist/);
  assert.ok(!existsSync(join(dir, 'x.json')) && !existsSync(join(dir, 'y.json')));
  assert.ok(readFileSync(out, 'utf8').includes('"merges"'));
});
