// `flotilla prepare --format chat|completion|preference`: version 2 shards whose ids and mask bits are
// the chat library's, document boundaries, every bad line naming FILE:LINE, --strict, no manifest after
// a failure, resume, a trainOn change preparing again, the .mask checked on open, a run refusing data
// prepared another way, and `flotilla train`'s preparing a .jsonl into the cache.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, truncateSync, unlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { prepare, type PrepareOptions } from '../src/data/prepare.js';
import { datasetProblem, maskBit, openExamples, openPrepared, readDocumentOffsets, readManifest } from '../src/data/prepared.js';
import { JsonTokenizer, loadTokenizer, tokenizerIdentity } from '../src/data/tokenizer.js';
import { WordCounter, trainBpe } from '../src/data/bpe_train.js';
import { CHATML_TEMPLATE, loadChatTemplate, tokenizeChat, tokenizeCompletion, tokenizePreference, type Message, type TrainOn } from '../src/data/chat/index.js';
import { exampleCacheDir, exampleDataProblems, prepareExampleSources, resolveExampleSources, type ExampleDataSpec } from '../src/data/example_source.js';
import { checkRunnable, parseConfig } from '../src/config/index.js';

const ROOT = resolve(import.meta.dirname, '..');
const dir = mkdtempSync(join(tmpdir(), 'flotilla-chatprep-'));
const quiet = { print: () => {}, progress: false };
const u = (content: string): Message => ({ role: 'user', content });
const a = (content: string): Message => ({ role: 'assistant', content });
const s = (content: string): Message => ({ role: 'system', content });

// Conversations: the assistant contents start with a letter, so each trained run is exactly content + <|im_end|>.
const CONVS: Message[][] = Array.from({ length: 40 }, (_, i) => {
  const c = [u(`Question ${i}: what is ${i} plus ${i}?`), a(`It is ${2 * i}.`)];
  if (i % 3 === 0) c.unshift(s('You are terse.'));
  if (i % 4 === 1) c.push(u('And times two?'), a(`That makes ${4 * i}, naïve café.`));
  return c;
});

// An HF directory: a byte-level BPE with ChatML's added tokens, and a tokenizer_config.json holding the template.
const hf = join(dir, 'hf');
mkdirSync(hf);
{
  const counts = new WordCounter();
  const text = CONVS.flat().map((m) => m.content).join('\n') + '\nsystem user assistant prompt completion chosen rejected';
  for (let i = 0; i < 3; i++) counts.add(text);
  const { json } = trainBpe(counts.counts, 350);
  const added = json.added_tokens as { id: number }[];
  let id = Math.max(...added.map((t) => t.id)) + 1;
  for (const content of ['<|im_start|>', '<|im_end|>']) added.push({ id: id++, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true } as { id: number });
  writeFileSync(join(hf, 'tokenizer.json'), JSON.stringify(json));
  writeFileSync(join(hf, 'tokenizer_config.json'), JSON.stringify({ chat_template: CHATML_TEMPLATE, eos_token: '<|im_end|>', bos_token: null, add_bos_token: false }));
}
const tokP = loadTokenizer(hf) as Promise<JsonTokenizer>;
// Another template (ChatML with a comment): another identity. The built-in "chatml" with this directory's
// eos renders exactly as the directory's own template, so it has the same identity.
const variant = join(dir, 'variant.jinja');
writeFileSync(variant, `{# a variant #}${CHATML_TEMPLATE}`);

function writeLines(name: string, lines: (object | string)[]): string {
  const p = join(dir, name);
  writeFileSync(p, lines.map((l) => (typeof l === 'string' ? l : JSON.stringify(l))).join('\n') + '\n');
  return p;
}
const chatFile = writeLines('chat.jsonl', CONVS.map((messages) => ({ messages })));
const completions = Array.from({ length: 25 }, (_, i) => ({ prompt: `Question ${i}: what is ${i}?`, completion: ` It is ${i}.` }));
const completionFile = writeLines('completion.jsonl', completions);
const prefs = Array.from({ length: 12 }, (_, i) => (i % 2 === 0
  ? { prompt: [u(`Question ${i}: what is ${i} plus ${i}?`)], chosen: [a(`It is ${2 * i}.`)], rejected: `It is ${2 * i + 1}.` }
  : { prompt: `Question ${i}: what is ${i}?`, chosen: ` It is ${i}.`, rejected: ' No idea.' }));
const prefFile = writeLines('pref.jsonl', prefs);

// In this thread (worker threads are covered by the first test and the cache test): each costs a second to start.
const opts = (o: Partial<PrepareOptions> & { out: string }): PrepareOptions => ({ sources: [chatFile], tokenizer: hf, format: 'chat', workers: 0, shardMb: 0.001, ...quiet, ...o });

/** Every document of a prepared example directory: its ids and trained bits, read back from the shard files. */
function readDocs(out: string): { ids: number[]; trained: number[] }[] {
  const ds = openExamples(out, { checksum: () => true });
  const docs: { ids: number[]; trained: number[] }[] = [];
  for (const sh of ds.shards) {
    assert.equal(sh.dtype, 'uint16');
    const b = readFileSync(sh.bin);
    const ids = new Uint16Array(b.buffer, b.byteOffset, b.byteLength / 2);
    const mask = new Uint8Array(readFileSync(sh.mask));
    assert.equal(mask.length, Math.ceil(sh.tokens / 8));
    const off = readDocumentOffsets(sh.idx);
    assert.equal(off.length, sh.documents + 1);
    assert.equal(off[off.length - 1], sh.tokens);
    for (let d = 0; d < sh.documents; d++) {
      const idsD: number[] = [];
      const tr: number[] = [];
      for (let k = off[d]!; k < off[d + 1]!; k++) {
        idsD.push(ids[k]!);
        tr.push(maskBit(mask, k) ? 1 : 0);
      }
      docs.push({ ids: idsD, trained: tr });
    }
    // The bits past the last token are zero.
    for (let k = sh.tokens; k < mask.length * 8; k++) assert.equal(maskBit(mask, k), false);
  }
  return docs;
}

/** The decoded text of each maximal run of trained tokens. */
function runs(tok: JsonTokenizer, d: { ids: number[]; trained: number[] }): string[] {
  const out: string[] = [];
  for (let k = 0; k < d.ids.length;) {
    if (!d.trained[k]) { k++; continue; }
    const from = k;
    while (k < d.ids.length && d.trained[k]) k++;
    out.push(tok.decode(d.ids.slice(from, k)));
  }
  return out;
}

/** Rethrows an expected rejection's message, for assert.rejects with a regexp. */
async function failure(p: Promise<unknown>): Promise<string> {
  try {
    await p;
  } catch (e) {
    return (e as Error).message;
  }
  assert.fail('expected a failure');
}

test('chat: v2 shards hold the library\'s ids and trained bits, one document an example, no end-of-text added; the mask is exactly the assistant turns (assistant, last, all)', async () => {
  const tok = await tokP;
  const t = loadChatTemplate('model', { tokenizerDir: hf });
  for (const trainOn of ['assistant', 'last', 'all'] as TrainOn[]) {
    const out = join(dir, `chat-${trainOn}`);
    const r = await prepare(opts({ out, trainOn, workers: trainOn === 'assistant' ? 2 : 0 }));
    const m = readManifest(out);
    assert.equal(m.version, 2);
    assert.equal(m.kind, 'chat');
    assert.deepEqual(m.template, { source: 'model', identity: t.identity, trainOn });
    assert.equal(m.examples, CONVS.length);
    assert.equal(m.documents, CONVS.length);
    assert.ok(m.shards.length >= 3, `several shards: ${m.shards.length}`);
    assert.equal(r.made, m.shards.length);
    const docs = readDocs(out);
    assert.equal(docs.length, CONVS.length);
    CONVS.forEach((c, i) => {
      const want = tokenizeChat(tok, t, c, trainOn);
      assert.deepEqual(docs[i]!.ids, Array.from(want.ids), `conversation ${i} ids`);
      assert.deepEqual(docs[i]!.trained, Array.from(want.trained), `conversation ${i} mask`);
      assert.notEqual(docs[i]!.ids.at(-1), tok.eot, 'no end-of-text appended');
      const turns = c.filter((x) => x.role === 'assistant').map((x) => `${x.content}<|im_end|>`);
      const expected = trainOn === 'all' ? [tok.decode(want.ids)] : trainOn === 'last' ? turns.slice(-1) : turns;
      assert.deepEqual(runs(tok, docs[i]!), expected, `conversation ${i} trained text (${trainOn})`);
    });
  }
});

test('completion and preference: ids and bits equal tokenizeCompletion / tokenizePreference; pair i is documents 2i (chosen) and 2i + 1 (rejected)', async () => {
  const tok = await tokP;
  const out = join(dir, 'completion');
  await prepare(opts({ out, sources: [completionFile], format: 'completion' }));
  const cm = readManifest(out);
  assert.equal(cm.kind, 'completion');
  assert.equal(cm.template, undefined);
  assert.equal(cm.examples, completions.length);
  const docs = readDocs(out);
  completions.forEach((c, i) => {
    // The directory's eos_token ends each completion.
    const want = tokenizeCompletion(tok, c.prompt, c.completion, { eos: '<|im_end|>' });
    assert.deepEqual(docs[i]!.ids, Array.from(want.ids));
    assert.deepEqual(docs[i]!.trained, Array.from(want.trained));
    assert.deepEqual(runs(tok, docs[i]!), [`${c.completion}<|im_end|>`]);
  });

  const pout = join(dir, 'pref');
  await prepare(opts({ out: pout, sources: [prefFile], format: 'preference' }));
  const pm = readManifest(pout);
  assert.equal(pm.kind, 'preference');
  assert.equal(pm.examples, prefs.length);
  assert.equal(pm.documents, 2 * prefs.length);
  assert.equal(pm.template?.source, 'model');
  const t = loadChatTemplate('model', { tokenizerDir: hf });
  const pdocs = readDocs(pout);
  prefs.forEach((p, i) => {
    const prompt = typeof p.prompt === 'string' ? p.prompt : p.prompt;
    const answer = (v: string | Message[]): string => (typeof v === 'string' ? v : v[0]!.content);
    const want = tokenizePreference(tok, t, prompt, answer(p.chosen), answer(p.rejected));
    assert.deepEqual(pdocs[2 * i]!.ids, Array.from(want.chosen.ids), `pair ${i} chosen`);
    assert.deepEqual(pdocs[2 * i]!.trained, Array.from(want.chosen.trained));
    assert.deepEqual(pdocs[2 * i + 1]!.ids, Array.from(want.rejected.ids), `pair ${i} rejected`);
    assert.deepEqual(pdocs[2 * i + 1]!.trained, Array.from(want.rejected.trained));
    assert.deepEqual(runs(tok, pdocs[2 * i + 1]!), [`${answer(p.rejected)}<|im_end|>`]);
  });
});

test('every bad line is one error naming FILE:LINE, and nothing is left behind', async () => {
  const raising = join(dir, 'no_system.jinja');
  writeFileSync(raising, "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}");
  const broken = join(dir, 'broken.jinja');
  writeFileSync(broken, '{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}');
  const good = { messages: [u('Hi'), a('Hello.')] };
  const cases: { name: string; lines: (object | string)[]; line: number; want: RegExp; o?: Partial<PrepareOptions> }[] = [
    { name: 'not JSON', lines: [good, good, '{"messages": [oops'], line: 3, want: /not JSON/ },
    { name: 'no content', lines: [good, { messages: [u('Hi'), { role: 'assistant' }] }], line: 2, want: /messages\[1\] has no "content"/ },
    { name: 'no role', lines: [{ messages: [{ content: 'Hi' }] }], line: 1, want: /messages\[0\] has no "role"/ },
    { name: 'unknown role', lines: [good, good, good, { messages: [{ role: 'tool', content: 'x' }, a('y')] }], line: 4, want: /unknown role "tool"/ },
    { name: 'role the template rejects', lines: [good, { messages: [s('Be nice.'), u('Hi'), a('Hello.')] }], line: 2, want: /rejected the conversation: System role not supported/, o: { chatTemplate: raising } },
    { name: 'render failure', lines: [good], line: 1, want: /failed to render: .*nosuchfilter/, o: { chatTemplate: broken } },
    { name: 'preference without chosen', lines: [{ prompt: 'p', chosen: 'c', rejected: 'r' }, { prompt: 'p', rejected: 'r' }], line: 2, want: /missing "chosen"/, o: { format: 'preference' } },
    { name: 'preference without rejected', lines: [{ prompt: 'p', chosen: 'c' }], line: 1, want: /missing "rejected"/, o: { format: 'preference' } },
  ];
  for (const c of cases) {
    const file = writeLines(`bad-${c.name.replace(/ /g, '_')}.jsonl`, c.lines);
    const out = join(dir, `bad-${c.name.replace(/ /g, '_')}`);
    const msg = await failure(prepare(opts({ out, sources: [file], shardMb: 64, ...c.o })));
    assert.ok(msg.startsWith(`prepare: ${file}:${c.line}: `), `${c.name}: ${msg}`);
    assert.match(msg, c.want, c.name);
    assert.match(msg, /--skip-bad/, `${c.name}: names the fix`);
    assert.equal(existsSync(out), false, `${c.name}: no directory left`);
  }
  // --skip-bad counts them instead.
  const file = writeLines('mixed.jsonl', [good, '{oops', good, { messages: [u('x'), { role: 'assistant' }] }]);
  const out = join(dir, 'mixed');
  await prepare(opts({ out, sources: [file], skipBad: true }));
  const m = readManifest(out);
  assert.equal(m.examples, 2);
  assert.equal(m.skipped, 2);
  assert.deepEqual(m.skippedWhy, { 'bad line (--skip-bad)': 2 });
});

test('a conversation without an assistant turn is skipped and counted, or with --strict an error naming FILE:LINE', async () => {
  const file = writeLines('noassistant.jsonl', [{ messages: [u('Hi'), a('Hello.')] }, { messages: [s('sys'), u('Only a question')] }, { messages: [u('Q'), a('A.')] }]);
  const out = join(dir, 'noassistant');
  await prepare(opts({ out, sources: [file] }));
  const m = readManifest(out);
  assert.equal(m.examples, 2);
  assert.deepEqual(m.skippedWhy, { 'no assistant turn': 1 });
  assert.equal(m.skipped, 0);
  const sout = join(dir, 'noassistant-strict');
  const msg = await failure(prepare(opts({ out: sout, sources: [file], strict: true })));
  assert.match(msg, new RegExp(`^prepare: ${file.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}:2: the conversation has no assistant turn.*drop --strict`));
  assert.equal(existsSync(sout), false);
  // trainOn = all trains it whole.
  const aout = join(dir, 'noassistant-all');
  await prepare(opts({ out: aout, sources: [file], trainOn: 'all', strict: true }));
  assert.equal(readManifest(aout).examples, 3);
});

test('a failure in a later file or shard leaves no manifest and none of this run\'s shards; a kept --out keeps what it held', async () => {
  const lines: object[] = CONVS.map((messages) => ({ messages }));
  const late = writeLines('late_bad.jsonl', [...lines, { messages: [u('x'), { role: 'assistant', content: 7 }] }]);
  const out = join(dir, 'late');
  const msg = await failure(prepare(opts({ out, sources: [chatFile, late] })));
  assert.match(msg, new RegExp(`late_bad\\.jsonl:${lines.length + 1}: messages\\[1\\]\\.content is number 7`));
  assert.equal(existsSync(out), false);
  // Into an existing directory: nothing of the failed run remains (no manifest, no shard, no temp).
  mkdirSync(out);
  writeFileSync(join(out, 'notes.txt'), 'mine');
  await failure(prepare(opts({ out, sources: [chatFile, late], workers: 0 })));
  assert.deepEqual(readdirSync(out), ['notes.txt']);
});

test('resume: a re-run keeps the finished shards (byte for byte) and makes the rest; a trainOn change prepares again', async () => {
  const out = join(dir, 'resume');
  const first = await prepare(opts({ out }));
  const n = first.manifest.shards.length;
  const before = Object.fromEntries(readdirSync(out).filter((f) => !f.endsWith('.json')).map((f) => [f, readFileSync(join(out, f)).toString('hex')]));
  // As if interrupted: no manifest, and one shard without its done file and mask.
  unlinkSync(join(out, 'manifest.json'));
  unlinkSync(join(out, 'shard_00001.done.json'));
  unlinkSync(join(out, 'shard_00001.mask'));
  const again = await prepare(opts({ out }));
  assert.equal(again.reused, n - 1);
  assert.equal(again.made, 1);
  const after = Object.fromEntries(readdirSync(out).filter((f) => !f.endsWith('.json')).map((f) => [f, readFileSync(join(out, f)).toString('hex')]));
  assert.deepEqual(after, before);
  assert.equal(again.manifest.key, first.manifest.key);
  // Up to date: nothing to do.
  assert.equal((await prepare(opts({ out }))).made, 0);
  // Another trainOn is another dataset: refused into the same --out, and no shard of it is reused.
  assert.match(await failure(prepare(opts({ out, trainOn: 'last' }))), /already holds a prepared dataset/);
  unlinkSync(join(out, 'manifest.json'));
  const last = await prepare(opts({ out, trainOn: 'last' }));
  assert.equal(last.reused, 0);
  assert.equal(last.made, n);
  assert.notEqual(last.manifest.key, first.manifest.key);
  // So is another template; the built-in ChatML renders as the directory's template does: the same shards.
  unlinkSync(join(out, 'manifest.json'));
  assert.equal((await prepare(opts({ out, trainOn: 'last', chatTemplate: 'chatml' }))).reused, n);
  unlinkSync(join(out, 'manifest.json'));
  const other = await prepare(opts({ out, trainOn: 'last', chatTemplate: variant }));
  assert.equal(other.reused, 0);
});

test('openPrepared checks the .mask: a truncated one is refused, a changed one fails its checksum', async () => {
  const out = join(dir, 'chat-assistant');
  const m = readManifest(out);
  const ok = openPrepared(out, { checksum: () => true });
  assert.equal(ok.masks?.length, m.shards.length);
  const mask = join(out, m.shards[1]!.mask!);
  const bytes = readFileSync(mask);
  truncateSync(mask, bytes.length - 1);
  assert.throws(() => openPrepared(out), /shard_00001\.mask has \d+ bytes but .* says \d+: the shard is truncated/);
  const flipped = Buffer.from(bytes);
  flipped[0] = flipped[0]! ^ 1;
  writeFileSync(mask, flipped);
  openPrepared(out); // sizes only
  assert.throws(() => openPrepared(out, { checksum: (i) => i === 1 }), /shard_00001\.mask does not match its checksum/);
  writeFileSync(mask, bytes);
  unlinkSync(mask);
  assert.throws(() => openExamples(out), /shard_00001\.mask is missing/);
  writeFileSync(mask, bytes);
  // A text directory is not an example dataset.
  const text = join(dir, 'text');
  await prepare({ sources: [join(ROOT, 'README.md')], tokenizer: 'byte', out: text, ...quiet });
  assert.equal(readManifest(text).version, 1);
  assert.throws(() => openExamples(text), /is a text dataset \(no loss masks\)/);
});

test('a run refuses prepared data of another kind, trainOn or template, naming the field and the fix', async () => {
  const out = join(dir, 'chat-assistant');
  const spec = (o: Partial<ExampleDataSpec>): ExampleDataSpec => ({ source: out, sources: [], valSource: '', tokenizer: hf, format: 'chat', chatTemplate: '', trainOn: 'assistant', ...o });
  assert.deepEqual(exampleDataProblems(spec({})), []);
  assert.deepEqual(exampleDataProblems(spec({ chatTemplate: 'model' })), []);
  const [trainOn] = exampleDataProblems(spec({ trainOn: 'last' }));
  assert.match(trainOn!, /^data\.source: .* was prepared with --train-on assistant, but data\.trainOn = "last".*set data\.trainOn = "assistant", or prepare it again with `flotilla prepare \.\.\. --format chat --train-on last`/);
  assert.deepEqual(exampleDataProblems(spec({ chatTemplate: 'chatml' })), [], 'the same identity');
  const [tmpl] = exampleDataProblems(spec({ chatTemplate: variant }));
  assert.match(tmpl!, /prepared with the chat template model .* but data\.chatTemplate gives .*variant\.jinja .*set data\.chatTemplate = "model", or prepare it again with `flotilla prepare \.\.\. --format chat --chat-template .*variant\.jinja`/);
  const [kind] = exampleDataProblems(spec({ format: 'text' }));
  assert.match(kind!, /holds chat data \(prepared with --format chat\), but data\.format = "text"; set data\.format = "chat"/);
  const [kind2] = exampleDataProblems(spec({ format: 'completion' }));
  assert.match(kind2!, /data\.format = "completion"; set data\.format = "chat"/);
  // Chat needs a template: "" means the model's only with a Hugging Face directory.
  const alone = join(dir, 'alone');
  mkdirSync(alone, { recursive: true });
  const tokFile = join(alone, 'tokenizer.json');
  writeFileSync(tokFile, readFileSync(join(hf, 'tokenizer.json')));
  assert.match(exampleDataProblems(spec({ tokenizer: tokFile }))[0]!, /needs a chat template.*set data\.chatTemplate = "chatml"/);
  // A tokenizer.json with its tokenizer_config.json beside it is the directory's.
  assert.deepEqual(exampleDataProblems(spec({ tokenizer: join(hf, 'tokenizer.json') })), []);
  assert.match(exampleDataProblems(spec({ chatTemplate: join(dir, 'missing.jinja') }))[0]!, /^data\.chatTemplate = ".*missing\.jinja": chat template .*no such file/);
  assert.match(exampleDataProblems(spec({ source: join(ROOT, 'README.md') }))[0]!, /reads a \.jsonl file of examples/);
  assert.equal(datasetProblem(readManifest(out), out, { format: 'chat', trainOn: 'assistant', template: { source: 'model', identity: loadChatTemplate('model', { tokenizerDir: hf }).identity } }), undefined);

  // Wired into the run's checks (before any rank starts): the config names the directory and the fields.
  const cfg = parseConfig('', [`--data.source=${out}`, `--data.tokenizer=${hf}`, '--data.format=chat', '--data.trainOn=all', '--data.seqLen=32']);
  assert.equal(cfg.model.vocabSize, tokenizerIdentity(hf).vocabSize, 'an HF directory is a data.tokenizer');
  const problems = checkRunnable(cfg, 1);
  assert.ok(problems.some((p) => /data\.trainOn = "all".*set data\.trainOn = "assistant"/.test(p)), problems.join('\n'));
  assert.deepEqual(checkRunnable(parseConfig('', [`--data.source=${out}`, `--data.tokenizer=${hf}`, '--data.format=chat', '--data.seqLen=32']), 1), []);
  assert.throws(() => parseConfig('', ['--data.format=chat', '--data.tokenizer=byte']), /data\.format = "chat" renders examples with special tokens.*data\.tokenizer = "byte"/);
});

test('flotilla train\'s .jsonl source: prepared into the cache under a key of the inputs, reused, and read from there by the ranks', async () => {
  const cache = join(dir, 'cache');
  const env = { ...process.env, FLOTILLA_CACHE_DIR: cache };
  const prev = process.env.FLOTILLA_CACHE_DIR;
  process.env.FLOTILLA_CACHE_DIR = cache;
  try {
    const d: ExampleDataSpec = { source: chatFile, sources: [], valSource: '', tokenizer: hf, format: 'chat', chatTemplate: '', trainOn: 'assistant' };
    assert.throws(() => resolveExampleSources({ ...d }), /has not been prepared yet.*flotilla train/);
    const lines: string[] = [];
    await prepareExampleSources(d, { print: (l) => lines.push(l), workers: 2 });
    const where = exampleCacheDir(d, chatFile, undefined, env)!;
    assert.ok(where.startsWith(join(cache, 'prepared')));
    const m = readManifest(where);
    assert.equal(m.kind, 'chat');
    assert.equal(m.examples, CONVS.length);
    const r = { ...d };
    resolveExampleSources(r);
    assert.equal(r.source, where);
    // The same inputs: up to date, nothing made.
    lines.length = 0;
    await prepareExampleSources(d, { print: (l) => lines.push(l), workers: 0 });
    assert.ok(lines.some((l) => /is up to date/.test(l)), lines.join('\n'));
    // Another trainOn: another directory.
    const last = { ...d, trainOn: 'last' as const };
    assert.notEqual(exampleCacheDir(last, chatFile, undefined, env), where);
    // A bad line: FILE:LINE, and nothing in the cache a run would read.
    const bad = writeLines('train_bad.jsonl', [{ messages: [u('Hi'), a('Hello.')] }, 'nope']);
    const bd = { ...d, source: bad };
    const msg = await failure(prepareExampleSources(bd, { workers: 0, print: () => {} }));
    assert.match(msg, new RegExp(`train_bad\\.jsonl:2: not JSON`));
    // The hint names what a run can do: prepare the file with --skip-bad and name the directory (no
    // --skip-bad alone, which is prepare's flag and not train's).
    assert.match(msg, /fix the line, or prepare the file with `flotilla prepare .*train_bad\.jsonl --format chat --tokenizer .* --chat-template model --train-on assistant --skip-bad --out DIR` \(bad lines counted and skipped\) and set data\.source to DIR$/);
    assert.equal(existsSync(exampleCacheDir(bd, bad, undefined, env)!), false);
  } finally {
    if (prev === undefined) delete process.env.FLOTILLA_CACHE_DIR;
    else process.env.FLOTILLA_CACHE_DIR = prev;
  }
});

test('a run\'s example sources: each wrong source is one problem (the data check and the examples\' check do not both report it), a missing .jsonl among them', async () => {
  const text = join(dir, 'text-prepared');
  await prepare({ sources: [join(ROOT, 'README.md')], tokenizer: hf, out: text, workers: 0, ...quiet });
  const empty = join(dir, 'no-manifest');
  mkdirSync(empty, { recursive: true });
  for (const [source, why] of [
    [text, /holds text data \(prepared with --format text\), but data\.format = "completion"/],
    [join(ROOT, 'README.md'), /data\.format = "completion" reads a \.jsonl file of examples/],
    [empty, /no-manifest has no manifest\.json/],
    [join(dir, 'missing.jsonl'), /missing\.jsonl does not exist; name a \.jsonl file of examples/],
  ] as const) {
    const problems = checkRunnable(parseConfig('', [`--data.source=${source}`, `--data.tokenizer=${hf}`, '--data.format=completion', '--data.seqLen=32']), 1);
    assert.equal(problems.length, 1, problems.join('\n'));
    assert.match(problems[0]!, why);
  }
});

test('the command line: --format chat --tokenizer DIR --train-on last, and a bad line\'s FILE:LINE with exit code 2', () => {
  const out = join(dir, 'cli');
  const ok = spawnSync(process.execPath, [join(ROOT, 'bin/flotilla.js'), 'prepare', chatFile, '--tokenizer', hf, '--out', out, '--format', 'chat', '--train-on', 'last', '--workers', '0', '--no-progress'], { encoding: 'utf8' });
  assert.equal(ok.status, 0, ok.stderr);
  const m = readManifest(out);
  assert.equal(m.kind, 'chat');
  assert.equal(m.template?.trainOn, 'last');
  const bad = writeLines('cli_bad.jsonl', [{ messages: [u('Hi')] }]);
  const r = spawnSync(process.execPath, [join(ROOT, 'bin/flotilla.js'), 'prepare', bad, '--tokenizer', hf, '--out', join(dir, 'cli-bad'), '--format', 'chat', '--strict', '--workers', '0', '--no-progress'], { encoding: 'utf8' });
  assert.equal(r.status, 2, r.stderr);
  assert.ok(r.stderr.includes(`${bad}:1: the conversation has no assistant turn`), r.stderr);
  const u2 = spawnSync(process.execPath, [join(ROOT, 'bin/flotilla.js'), 'prepare', bad, '--tokenizer', hf, '--out', join(dir, 'cli-bad'), '--strict'], { encoding: 'utf8' });
  assert.equal(u2.status, 2);
  assert.match(u2.stderr, /--strict are for --format chat\|completion\|preference/);
});

test.after(() => rmSync(dir, { recursive: true, force: true }));
