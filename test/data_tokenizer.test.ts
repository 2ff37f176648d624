// Byte tokenizer and text sources.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ByteTokenizer } from '../src/data/tokenizer.js';
import { loadMobyDick, loadCorpus, loadTextFile } from '../src/data/corpus.js';
import { splitTokens, loadTextDataset } from '../src/data/dataset.js';

test('byte tokenizer round-trips ASCII, multi-byte UTF-8 and control bytes', () => {
  const tok = new ByteTokenizer();
  for (const s of ['', 'Call me Ishmael.', 'naïve café — “quoted” 🐋 日本語', 'tab\tnew\nline\0nul']) {
    const ids = tok.encode(s);
    assert.equal(ids.length, Buffer.byteLength(s, 'utf8'));
    assert.ok(ids.every((v) => v >= 0 && v < tok.vocabSize));
    assert.equal(tok.decode(ids), s);
    assert.equal(tok.decode(Array.from(ids)), s);
    assert.deepEqual(Array.from(tok.encodeInt32(s)), Array.from(ids));
  }
  assert.equal(tok.vocabSize, 256);
});

test('decode rejects ids outside the byte vocabulary and tolerates cut characters', () => {
  const tok = new ByteTokenizer();
  assert.throws(() => tok.decode([72, 256]), /id 256 at position 1 is outside the byte vocabulary 0..255/);
  assert.throws(() => tok.decode([-1]), /outside the byte vocabulary/);
  const whale = tok.encode('🐋');
  assert.equal(tok.decode(whale.subarray(0, 2)), '\ufffd');
});

test('Moby-Dick loads from the npm package, in reading order', () => {
  const text = loadMobyDick();
  assert.ok(text.length > 1_000_000, `only ${text.length} characters`);
  const first = text.indexOf('CHAPTER 1. Loomings.');
  const second = text.indexOf('CHAPTER 2. The Carpet-Bag.');
  const last = text.lastIndexOf('CHAPTER 135.');
  assert.ok(first >= 0 && first < second && second < last, 'chapters out of order');
  assert.ok(text.includes('Call me Ishmael.'));
  assert.equal(loadCorpus('moby-dick'), text);
});

test('a user text file loads; a missing one is a clear error', () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-data-'));
  const p = join(dir, 'poem.txt');
  writeFileSync(p, 'There is no Frigate like a Book\n');
  assert.equal(loadTextFile(p), 'There is no Frigate like a Book\n');
  assert.equal(loadCorpus(p), 'There is no Frigate like a Book\n');
  assert.throws(() => loadCorpus(join(dir, 'missing.txt')), /data\.source: text file .*missing\.txt does not exist/);
  writeFileSync(join(dir, 'empty.txt'), '');
  assert.throws(() => loadTextFile(join(dir, 'empty.txt')), /is empty/);
  assert.throws(() => loadTextFile(dir), /is not a file/);
});

test('train/validation split keeps the last fraction for validation, without copying', () => {
  const tokens = Uint8Array.from({ length: 1000 }, (_, i) => i % 256);
  const { train, val } = splitTokens(tokens, 0.1);
  assert.equal(train.length, 900);
  assert.equal(val.length, 100);
  assert.equal(val[0], 900 % 256);
  assert.equal(train.buffer, tokens.buffer);
  assert.throws(() => splitTokens(tokens, 0), /data\.valFraction must be in \(0, 1\)/);
  assert.throws(() => splitTokens(tokens, 0.1, 129 * 2), /each needs at least 258 \(data\.seqLen \+ 1\)/);
  const ds = loadTextDataset({ source: 'moby-dick', valFraction: 0.1, seqLen: 64 });
  assert.equal(ds.train.length + ds.val.length, ds.tokens.length);
  assert.equal(ds.vocabSize, 256);
});
