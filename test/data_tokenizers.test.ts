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

test('token cache: a second load reads the ids the first one tokenized; another tokenizer, a spoiled file or an unwritable directory is a miss, never wrong ids', async () => {
  const { cachedTokens, tokenCacheDir } = await import('../src/data/token_cache.js');
  const { readdirSync, rmSync } = await import('node:fs');
  const cache = join(dir, 'cache');
  const tok = await loadTokenizer(join(ROOT, 'examples', 'moby-dick-bpe512.json'));
  const text = loadMobyDick().slice(0, 50_000);
  const want = Array.from(tok.encode(text));
  let calls = 0;
  const load = (identity = tok.identity, d: string | undefined = cache) => cachedTokens(text, identity, false, () => (calls++, tok.encode(text)), d);
  assert.deepEqual(Array.from(load()), want);
  assert.equal(calls, 1);
  const [file] = readdirSync(cache).map((f) => join(cache, f));
  assert.match(file!, /[0-9a-f]{64}\.u16$/);
  assert.deepEqual(Array.from(load()), want, 'a hit gives the same ids');
  assert.equal(calls, 1, 'a hit does not tokenize');
  load('sha256:another-tokenizer');
  assert.equal(calls, 2, 'another tokenizer identity is a miss');
  assert.equal(cachedTokens(`${text}.`, tok.identity, false, () => (calls++, tok.encode(`${text}.`)), cache).length > 0, true);
  assert.equal(calls, 3, 'other text is a miss');
  // A spoiled file fails its digest: tokenized again (and rewritten), never read as ids.
  const b = readFileSync(file!);
  b[100] = b[100]! ^ 0xff;
  writeFileSync(file!, b);
  assert.deepEqual(Array.from(load()), want);
  assert.equal(calls, 4);
  assert.deepEqual(Array.from(load()), want);
  assert.equal(calls, 4, 'the rewritten file is a hit');
  writeFileSync(file!, readFileSync(file!).subarray(0, 1001));
  assert.deepEqual(Array.from(load()), want, 'a truncated file is a miss');
  // A cache directory that cannot be made (a file stands where it should be): tokenized, no error.
  const blocked = join(dir, 'blocked');
  writeFileSync(blocked, '');
  assert.deepEqual(Array.from(load(tok.identity, join(blocked, 'tokens'))), want);
  // Off: tokenize every time.
  assert.equal(tokenCacheDir({ FLOTILLA_CACHE_DIR: 'off' }), undefined);
  assert.equal(tokenCacheDir({ FLOTILLA_CACHE_DIR: '/x' }), '/x/tokens');
  assert.equal(tokenCacheDir({ XDG_CACHE_HOME: '/y' }), '/y/flotilla/tokens');
  rmSync(cache, { recursive: true, force: true });
});

test('a run on a BPE-tokenized text reads the same corpus with the cache as without it', async () => {
  const { loadTrainData } = await import('../src/data/sources.js');
  const spec = { source: 'moby-dick', sources: [], tokenizer: join(ROOT, 'examples', 'moby-dick-bpe512.json'), valSource: '', valFraction: 0.1, seqLen: 32 };
  const read = async (cacheDir: string) => {
    const before = process.env.FLOTILLA_CACHE_DIR;
    process.env.FLOTILLA_CACHE_DIR = cacheDir;
    try {
      const d = await loadTrainData(spec, { modelVocab: 0 });
      const ids = (s: (typeof d.train)[number]) => {
        const out = new Int32Array(s.corpus.length);
        s.corpus.window(0, s.corpus.length, out, 0);
        return Array.from(out);
      };
      const out = { describe: d.describe, train: ids(d.train[0]!), val: ids(d.val[0]!) };
      d.close();
      return out;
    } finally {
      if (before === undefined) delete process.env.FLOTILLA_CACHE_DIR;
      else process.env.FLOTILLA_CACHE_DIR = before;
    }
  };
  const off = await read('off');
  const cacheDir = join(dir, 'run-cache');
  const miss = await read(cacheDir);
  const hit = await read(cacheDir);
  assert.deepEqual(miss, off);
  assert.deepEqual(hit, off);
});
