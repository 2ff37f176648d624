// `flotilla prepare`: shards, document indexes, the manifest, re-runs and interrupted runs, parallel
// workers giving the same bytes, and every bad input giving one message that names the file while
// nothing already prepared changes.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, truncateSync, unlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { parquetWriteBuffer } from 'hyparquet-writer';
import { prepare, type PrepareOptions } from '../src/data/prepare.js';
import { openPrepared, readManifest } from '../src/data/prepared.js';
import { fileSha256 } from '../src/io/durable.js';
import { loadTokenizer, tokenizerIdentity } from '../src/data/tokenizer.js';

const ROOT = resolve(import.meta.dirname, '..');
const dir = mkdtempSync(join(tmpdir(), 'flotilla-prep-'));
const quiet = { print: () => {}, progress: false };

const docs = Array.from({ length: 300 }, (_, i) => `Document ${i}: ${'whale '.repeat(i % 17)}and the sea, naïve café 🐋.`);
function writeJsonl(path: string, texts: string[], extra = ''): void {
  writeFileSync(path, texts.map((t) => JSON.stringify({ id: t.length, text: t })).join('\n') + '\n' + extra);
}
const jsonl = join(dir, 'docs.jsonl');
writeJsonl(jsonl, docs);
const texts = join(dir, 'texts');
mkdirSync(join(texts, 'sub'), { recursive: true });
writeFileSync(join(texts, 'a.txt'), 'Call me Ishmael.\n');
writeFileSync(join(texts, 'sub', 'b.md'), '# Chapter\nSome years ago.\n');
writeFileSync(join(texts, 'ignored.bin'), 'not text');
writeFileSync(join(texts, '.hidden.txt'), 'hidden');
const parquet = join(dir, 'docs.parquet');
writeFileSync(parquet, Buffer.from(parquetWriteBuffer({
  columnData: [{ name: 'body', data: docs.slice(0, 120), type: 'STRING' }, { name: 'n', data: docs.slice(0, 120).map((_, i) => i), type: 'INT32' }],
  rowGroupSize: 50,
})));

function readU16(path: string): number[] {
  const b = readFileSync(path);
  return Array.from(new Uint16Array(b.buffer, b.byteOffset, b.byteLength / 2));
}
function readIdx(path: string): number[] {
  const b = readFileSync(path);
  return Array.from({ length: b.byteLength / 8 }, (_, i) => Number(b.readBigUInt64LE(i * 8)));
}
function snapshot(d: string): Record<string, string> {
  return Object.fromEntries(readdirSync(d).sort().map((f) => [f, statSync(join(d, f)).isFile() ? fileSha256(join(d, f)) : 'dir']));
}
const opts = (o: Partial<PrepareOptions> & { out: string }): PrepareOptions => ({ sources: [jsonl, texts], tokenizer: 'byte', workers: 2, ...quiet, ...o });

test('jsonl and a directory of text files become shards whose documents decode back, separated by end-of-text', async () => {
  const out = join(dir, 'ds1');
  const r = await prepare(opts({ out, shardMb: 0.004 }));
  const m = readManifest(out);
  assert.equal(r.made, m.shards.length);
  assert.ok(m.shards.length >= 3, `several jsonl shards (shardMb 0.004): ${m.shards.length}`);
  assert.equal(m.dtype, 'uint16');
  assert.equal(m.documents, docs.length + 2, 'every jsonl line and both text files (the .bin and hidden file are not read)');
  assert.equal(m.tokenizer.identity, tokenizerIdentity('byte').identity);
  const tok = await loadTokenizer('byte');
  const got: string[] = [];
  for (const s of m.shards) {
    const ids = readU16(join(out, s.bin));
    const idx = readIdx(join(out, s.idx));
    assert.equal(ids.length, s.tokens);
    assert.equal(idx.length, s.documents + 1);
    assert.equal(idx[0], 0);
    assert.equal(idx[idx.length - 1], ids.length);
    for (let d = 0; d < s.documents; d++) {
      assert.equal(ids[idx[d + 1]! - 1], tok.eot, 'each document ends with the end-of-text id');
      got.push(tok.decode(ids.slice(idx[d]!, idx[d + 1]! - 1)));
    }
    assert.equal(fileSha256(join(out, s.bin)), s.binSha256);
  }
  assert.deepEqual(got, [...docs, 'Call me Ishmael.\n', '# Chapter\nSome years ago.\n'], 'documents in input order');
  assert.equal(m.tokens, got.reduce((a, d) => a + Buffer.byteLength(d) + 1, 0));
  assert.ok(!readdirSync(out).some((f) => f.endsWith('.tmp')));
});

test('parquet (by row groups, --field) and GPT-2 ids; a re-run skips every shard', async () => {
  const out = join(dir, 'pq');
  const r = await prepare({ sources: [parquet], tokenizer: 'gpt2', field: 'body', out, workers: 2, shardMb: 0.0001, ...quiet });
  const m = readManifest(out);
  assert.equal(m.documents, 120);
  assert.equal(m.shards.length, 3, 'row groups of 50 rows: 50, 50, 20');
  assert.equal(r.made, 3);
  const tok = await loadTokenizer('gpt2');
  const ids = readU16(join(out, m.shards[0]!.bin));
  const idx = readIdx(join(out, m.shards[0]!.idx));
  assert.deepEqual(ids.slice(0, idx[1]! - 1), Array.from(tok.encode(docs[0]!)));
  assert.equal(ids[idx[1]! - 1], 50256);
  const before = snapshot(out);
  const again = await prepare({ sources: [parquet], tokenizer: 'gpt2', field: 'body', out, workers: 2, shardMb: 0.0001, ...quiet });
  assert.equal(again.made, 0);
  assert.deepEqual(snapshot(out), before, 'nothing rewritten');
});

test('one worker, two workers and the main thread write the same bytes', async () => {
  const sums = [];
  for (const workers of [0, 1, 2]) {
    const out = join(dir, `w${workers}`);
    await prepare(opts({ out, workers, shardMb: 0.004 }));
    const m = readManifest(out);
    sums.push(m.shards.map((s) => s.binSha256 + s.idxSha256));
  }
  assert.deepEqual(sums[1], sums[0]);
  assert.deepEqual(sums[2], sums[0]);
});

test('an interrupted prepare: leftover temp files and an unfinished shard are redone, finished shards are kept', async () => {
  const out = join(dir, 'interrupted');
  await prepare(opts({ out, shardMb: 0.004 }));
  const m = readManifest(out);
  const want = m.shards.map((s) => s.binSha256);
  // What a kill leaves: no manifest, one shard without its done file, a half-written temp file.
  unlinkSync(join(out, 'manifest.json'));
  unlinkSync(join(out, 'shard_00001.done.json'));
  truncateSync(join(out, 'shard_00001.bin'), 10);
  writeFileSync(join(out, 'shard_00002.bin.tmp'), 'partial');
  const keptMtime = statSync(join(out, 'shard_00000.bin')).mtimeMs;
  const r = await prepare(opts({ out, shardMb: 0.004 }));
  assert.equal(r.made, 1, 'only the shard without a done file');
  assert.equal(r.reused, m.shards.length - 1);
  assert.deepEqual(readManifest(out).shards.map((s) => s.binSha256), want);
  assert.equal(statSync(join(out, 'shard_00000.bin')).mtimeMs, keptMtime);
  assert.ok(!existsSync(join(out, 'shard_00002.bin.tmp')));
});

test('a vocabulary above 65,536 is stored as uint32', async () => {
  // A byte-level BPE with no merges whose end-of-text id is 70,000.
  const { trainBpe } = await import('../src/data/bpe_train.js');
  const json = trainBpe(new Map([['ab', 1]]), 257).json as { added_tokens: { id: number }[]; model: { vocab: Record<string, number> } };
  json.added_tokens[0]!.id = 70_000;
  json.model.vocab['<|endoftext|>'] = 70_000;
  const tokPath = join(dir, 'wide.json');
  writeFileSync(tokPath, JSON.stringify(json));
  const out = join(dir, 'wide');
  await prepare({ sources: [join(texts, 'a.txt')], tokenizer: tokPath, out, workers: 0, ...quiet });
  const m = readManifest(out);
  assert.equal(m.dtype, 'uint32');
  const b = readFileSync(join(out, m.shards[0]!.bin));
  const ids = Array.from(new Uint32Array(b.buffer, b.byteOffset, b.byteLength / 4));
  assert.equal(ids[ids.length - 1], 70_000);
  assert.equal(ids.length, 'Call me Ishmael.\n'.length + 1);
});

test('bad inputs: one message naming the file, and nothing prepared is overwritten', async () => {
  const out = join(dir, 'bad');
  const fail = (o: Partial<PrepareOptions>, re: RegExp) => assert.rejects(prepare(opts({ out, ...o })), re);
  await fail({ sources: [join(dir, 'missing.jsonl')] }, /source .*missing\.jsonl does not exist/);
  writeFileSync(join(dir, 'empty.txt'), '');
  await fail({ sources: [join(dir, 'empty.txt')] }, /empty\.txt is empty/);
  mkdirSync(join(dir, 'emptydir'), { recursive: true });
  await fail({ sources: [join(dir, 'emptydir')] }, /emptydir holds no \.txt, \.md, \.text, \.jsonl or \.parquet file/);
  writeFileSync(join(dir, 'blank.jsonl'), '\n\n  \n');
  await fail({ sources: [join(dir, 'blank.jsonl')] }, /blank\.jsonl has no documents \(an empty source/);
  const broken = join(dir, 'broken.jsonl');
  writeJsonl(broken, docs.slice(0, 5), '{"text": "fine"}\n{"text": oops\n{"other": "x"}\n');
  await fail({ sources: [broken] }, /broken\.jsonl:7: line 7 is not JSON .*--skip-bad/);
  await fail({ sources: [parquet] }, /parquet file .*docs\.parquet has no column "text" \(columns: body, n\); pass --field NAME/);
  await fail({ sources: [jsonl], tokenizer: join(dir, 'no-tokenizer.json') }, /no such file .*no-tokenizer\.json/);
  assert.ok(!existsSync(out), 'a failed first prepare leaves no directory');
  // --skip-bad counts the bad lines (not JSON, no text field) and keeps the rest.
  const skipped = await prepare(opts({ out: join(dir, 'skipped'), sources: [broken], skipBad: true }));
  assert.equal(skipped.manifest.skipped, 2);
  assert.equal(skipped.manifest.documents, 6);
  // A prepared directory is never overwritten by other inputs or another tokenizer, and a bad
  // input in a run over it changes nothing.
  const good = join(dir, 'good');
  await prepare(opts({ out: good }));
  const before = snapshot(good);
  await assert.rejects(prepare(opts({ out: good, tokenizer: 'gpt2' })), /already holds a prepared dataset made from other inputs or with another tokenizer/);
  await assert.rejects(prepare(opts({ out: good, sources: [broken] })), /already holds a prepared dataset/);
  assert.deepEqual(snapshot(good), before);
  // A bad line found mid-way removes this run's shards, keeping an earlier run's finished ones.
  const partial = join(dir, 'partial');
  await prepare(opts({ out: partial, sources: [jsonl], shardMb: 0.004 }));
  unlinkSync(join(partial, 'manifest.json'));
  const kept = snapshot(partial);
  await assert.rejects(prepare(opts({ out: partial, sources: [jsonl, broken], shardMb: 0.004 })), /broken\.jsonl:7/);
  assert.deepEqual(snapshot(partial), kept);
});

test('flotilla prepare on the command line: exit 0, and exit 2 with one line naming the file', () => {
  const run = (args: string[]) => spawnSync(process.execPath, [join(ROOT, 'bin', 'flotilla.js'), 'prepare', ...args], { cwd: ROOT, encoding: 'utf8' });
  const out = join(dir, 'cli');
  const ok = run([jsonl, '--tokenizer', 'byte', '--out', out, '--workers', '1']);
  assert.equal(ok.status, 0, ok.stderr);
  assert.match(ok.stderr, /prepare: \d[\d,]* tokens in 300 document\(s\), 1 shard\(s\)/);
  const bad = run([join(dir, 'broken.jsonl'), '--tokenizer', 'byte', '--out', join(dir, 'cli-bad')]);
  assert.equal(bad.status, 2);
  assert.equal(bad.stderr.trim().split('\n').length, 2, bad.stderr); // the plan line, then the error
  assert.match(bad.stderr, /^flotilla: prepare: .*broken\.jsonl:7: line 7 is not JSON/m);
  assert.ok(!existsSync(join(dir, 'cli-bad')));
  const usage = run([jsonl, '--out', out]);
  assert.equal(usage.status, 2);
  assert.match(usage.stderr, /--tokenizer is required/);
  rmSync(out, { recursive: true });
});

test('the loader side: missing, truncated or changed shards and another tokenizer are refused by name', async () => {
  const out = join(dir, 'checked');
  await prepare(opts({ out, shardMb: 0.004 }));
  const byte = tokenizerIdentity('byte');
  assert.equal(openPrepared(out, { tokenizer: byte, checksum: () => true }).segments.length, readManifest(out).shards.length);
  assert.throws(() => openPrepared(out, { tokenizer: tokenizerIdentity('gpt2') }), /checked\/manifest\.json was prepared with tokenizer byte .* but this run uses gpt2 .*set data\.tokenizer = "byte"/);
  assert.throws(() => openPrepared(out, { vocabSize: 200 }), /holds token id 2\d\d, at or above model\.vocabSize = 200/);
  const shard = join(out, 'shard_00001.bin');
  const bytes = readFileSync(shard);
  const flipped = Buffer.from(bytes);
  flipped[3] = flipped[3]! ^ 1;
  writeFileSync(shard, flipped);
  assert.throws(() => openPrepared(out, { checksum: () => true }), /shard_00001\.bin does not match its checksum in .*manifest\.json/);
  truncateSync(shard, bytes.length - 2);
  assert.throws(() => openPrepared(out, {}), /shard_00001\.bin has \d+ bytes but .*manifest\.json says \d+: the shard is truncated/);
  unlinkSync(shard);
  assert.throws(() => openPrepared(out, {}), /shard_00001\.bin is missing \(listed in .*manifest\.json\)/);
  assert.throws(() => openPrepared(join(dir, 'texts')), /texts has no manifest\.json: it is not a prepared dataset/);
});
