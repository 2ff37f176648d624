// Chat data: example lines, chat templates (against Python's jinja2 set up as transformers sets it up),
// added tokens as single ids, and assistant-only loss masks (against spans the oracle finds on its own).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { ByteTokenizer, JsonTokenizer, loadTokenizer } from '../src/data/tokenizer.js';
import { WordCounter, trainBpe } from '../src/data/bpe_train.js';
import {
  ChatDataError, ChatTemplateError, chatTemplateFromText, loadChatTemplate, parseExampleLine, parseExampleLines,
  renderChat, tokenizeChat, tokenizeCompletion, tokenizePreference, type ChatTemplate, type Message, type TokenizedExample,
} from '../src/data/chat/index.js';

const FIX = resolve(import.meta.dirname, 'fixtures');
const ORACLE = join(FIX, 'chat_render.py');

interface TemplateCase {
  text: string;
  bos: string;
  eos: string;
  /** What the template writes before an assistant's content (the oracle searches for it). */
  header: string;
  trim?: boolean;
}

const chatml = loadChatTemplate('chatml');
const TEMPLATES: Record<string, TemplateCase> = {
  chatml: { text: chatml.text, bos: '', eos: '<|im_end|>', header: '<|im_start|>assistant\n' },
  qwen: { text: readFileSync(join(FIX, 'chat_templates/qwen2_5.jinja'), 'utf8'), bos: '', eos: '<|im_end|>', header: '<|im_start|>assistant\n' },
  llama3: { text: readFileSync(join(FIX, 'chat_templates/llama3.jinja'), 'utf8'), bos: '<|begin_of_text|>', eos: '<|eot_id|>', header: '<|start_header_id|>assistant<|end_header_id|>\n\n', trim: true },
  mistral: { text: readFileSync(join(FIX, 'chat_templates/mistral.jinja'), 'utf8'), bos: '<s>', eos: '</s>', header: ' [/INST]' },
};
const SPECIALS = ['<|im_start|>', '<|im_end|>', '<|begin_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>', '<s>', '</s>'];

const u = (content: string): Message => ({ role: 'user', content });
const a = (content: string): Message => ({ role: 'assistant', content });
const s = (content: string): Message => ({ role: 'system', content });

/** Conversations every template takes (user/assistant alternating, starting with the user). */
const ALTERNATING: Message[][] = [
  [u('What is the capital of France?'), a('Paris is the capital of France.')],
  [u('Count to three.'), a('One, two, three.'), u('Now backwards, please!'), a('Three, two, one.')],
  [u('Héllo — ça va? 日本語 😀'), a('Très bien, merci!\nAnd you?'), u('Fine.\n\nThanks')],
  [u('  padded  '), a('  Spaces around  '), u('Say "quoted" things'), a('Quoted "things" {braces} <tags>')],
];
/** With system messages (not for the Mistral template, which raises on them). */
const WITH_SYSTEM: Message[][] = [
  [s('You are terse.'), u('Why is the sky blue?'), a('Rayleigh scattering.')],
  [s('You are a pirate.'), u('Hello'), a('Ahoy, matey!'), u('Where is the treasure?'), a('Buried on the island, arr.')],
];

let tmp: string | undefined;
function tmpDir(): string {
  return (tmp ??= mkdtempSync(join(tmpdir(), 'flotilla-chat-')));
}

let tokPromise: Promise<JsonTokenizer> | undefined;
/** A small byte-level BPE trained on the conversations, with the templates' special tokens added. */
function tokenizer(): Promise<JsonTokenizer> {
  return (tokPromise ??= (async () => {
    const counts = new WordCounter();
    const text = [...ALTERNATING, ...WITH_SYSTEM].flat().map((m) => m.content).join('\n') + '\nsystem user assistant INST You are Qwen, created by Alibaba Cloud. You are a helpful assistant.';
    for (let i = 0; i < 4; i++) counts.add(text);
    const { json } = trainBpe(counts.counts, 400);
    const added = json.added_tokens as { id: number }[];
    let id = Math.max(...added.map((t) => t.id)) + 1;
    for (const content of SPECIALS) added.push({ id: id++, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true } as { id: number });
    const path = join(tmpDir(), 'tokenizer.json');
    writeFileSync(path, JSON.stringify(json));
    return (await loadTokenizer(path)) as JsonTokenizer;
  })());
}

interface OracleResult {
  text?: string;
  spans?: string[];
  error?: string;
}

function oracle(cases: { template: string; messages: Message[]; gen: boolean }[]): OracleResult[] {
  const r = spawnSync('/usr/bin/python3', [ORACLE], { input: JSON.stringify({ templates: TEMPLATES, cases }), encoding: 'utf8' });
  assert.equal(r.status, 0, `oracle failed: ${r.stderr}`);
  return JSON.parse(r.stdout) as OracleResult[];
}

function template(name: string): ChatTemplate {
  const t = TEMPLATES[name]!;
  return chatTemplateFromText(t.text, { bos_token: t.bos, eos_token: t.eos }, name);
}

/** The decoded text of each maximal run of trained tokens. */
function trainedRuns(tok: JsonTokenizer, ex: TokenizedExample): string[] {
  const runs: string[] = [];
  let k = 0;
  while (k < ex.ids.length) {
    if (!ex.trained[k]) {
      k++;
      continue;
    }
    const from = k;
    while (k < ex.ids.length && ex.trained[k]) k++;
    runs.push(tok.decode(ex.ids.subarray(from, k)));
  }
  return runs;
}

function allCases(): { template: string; messages: Message[]; gen: boolean }[] {
  const cases: { template: string; messages: Message[]; gen: boolean }[] = [];
  for (const name of Object.keys(TEMPLATES)) {
    const convs = name === 'mistral' ? ALTERNATING : [...ALTERNATING, ...WITH_SYSTEM];
    for (const messages of convs) for (const gen of [false, true]) cases.push({ template: name, messages, gen });
  }
  return cases;
}

test('rendered conversations equal jinja2 under transformers\' environment (ChatML, Qwen2.5, Llama 3, Mistral; system turns, generation prompt, tojson)', () => {
  const cases = allCases();
  const tojson = '{{ bos_token }}{% for m in messages %}{{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}';
  const withJson = { ...TEMPLATES, tojson: { text: tojson, bos: '<s>', eos: '</s>', header: null as unknown as string } };
  const r = spawnSync('/usr/bin/python3', [ORACLE], {
    input: JSON.stringify({ templates: withJson, cases: [...cases, ...ALTERNATING.map((messages) => ({ template: 'tojson', messages, gen: true }))] }), encoding: 'utf8',
  });
  assert.equal(r.status, 0, r.stderr);
  const want = JSON.parse(r.stdout) as OracleResult[];
  cases.forEach((c, i) => {
    assert.equal(want[i]!.error, undefined);
    assert.equal(renderChat(template(c.template), c.messages, { addGenerationPrompt: c.gen }), want[i]!.text, `${c.template} case ${i}`);
  });
  const tj = chatTemplateFromText(tojson, { bos_token: '<s>', eos_token: '</s>' });
  ALTERNATING.forEach((messages, i) => assert.equal(renderChat(tj, messages, { addGenerationPrompt: true }), want[cases.length + i]!.text));
  // Qwen's default system prompt appears when the conversation has none; the generation prompt ends the text.
  assert.match(want[0]!.text!, /^<\|im_start\|>user/);
  const qwen = renderChat(template('qwen'), ALTERNATING[0]!, { addGenerationPrompt: true });
  assert.ok(qwen.startsWith('<|im_start|>system\nYou are Qwen') && qwen.endsWith('<|im_start|>assistant\n'));
});

test('special tokens are single ids; the whole rendered text encodes as the library encodes it', async () => {
  const tok = await tokenizer();
  for (const sp of SPECIALS) {
    const id = tok.encodeWithSpecials(sp);
    assert.equal(id.length, 1, sp);
    assert.deepEqual(tok.encodeReference(sp), id, sp);
    assert.ok(tok.encode(sp).length > 1, `plain-text encode keeps ${sp} as text`);
  }
  for (const name of Object.keys(TEMPLATES)) {
    const text = renderChat(template(name), ALTERNATING[1]!, { addGenerationPrompt: true });
    const ids = tok.encodeWithSpecials(text);
    assert.deepEqual(ids, tok.encodeReference(text), name);
    assert.equal(tok.decode(ids), text);
    for (const sp of SPECIALS) {
      const spId = tok.encodeWithSpecials(sp)[0]!;
      assert.equal(ids.filter((x) => x === spId).length, text.split(sp).length - 1, `${name}: ${sp} once per occurrence`);
    }
  }
});

test('loss masks: exactly the assistant contents + end-of-turn tokens (assistant, last, all), against the oracle\'s spans', async () => {
  const tok = await tokenizer();
  const cases = allCases().filter((c) => !c.gen);
  const want = oracle(cases);
  let checked = 0;
  cases.forEach((c, i) => {
    const t = template(c.template);
    const w = want[i]!;
    const hasAssistant = c.messages.some((m) => m.role === 'assistant');
    const all = tokenizeChat(tok, t, c.messages, 'all');
    assert.deepEqual(Array.from(all.ids), tok.encodeReference(w.text!));
    assert.ok(all.trained.every((x) => x === 1));
    assert.equal(tok.decode(all.ids), w.text);
    if (!hasAssistant) return;
    const ex = tokenizeChat(tok, t, c.messages, 'assistant');
    assert.deepEqual(ex.ids, all.ids);
    const header = TEMPLATES[c.template]!.header;
    // Each run is its span, plus at most the end of the template's header when byte-level BPE merged the
    // header's last whitespace with content that starts with whitespace ("\n" + "  Hi" -> "\n " " Hi").
    const sameSpans = (runs: string[], spans: string[], what: string): void => {
      assert.equal(runs.length, spans.length, `${what}: ${JSON.stringify(runs)} vs ${JSON.stringify(spans)}`);
      runs.forEach((run, j) => {
        const span = spans[j]!;
        assert.ok(run.endsWith(span), `${what}: run ${JSON.stringify(run)} is not span ${JSON.stringify(span)}`);
        const extra = run.slice(0, run.length - span.length);
        if (extra !== '') assert.ok(/^\s/.test(span) && header.endsWith(extra) && extra.trim() === '', `${what}: run ${JSON.stringify(run)} has ${JSON.stringify(extra)} before span`);
      });
    };
    sameSpans(trainedRuns(tok, ex), w.spans!, `${c.template} case ${i}`);
    const last = tokenizeChat(tok, t, c.messages, 'last');
    sameSpans(trainedRuns(tok, last), w.spans!.slice(-1), `${c.template} case ${i} last`);
    // Every trained run ends with the template's end-of-turn token.
    for (const run of w.spans!) assert.ok(run.endsWith(TEMPLATES[c.template]!.eos));
    checked++;
  });
  assert.ok(checked >= 20, `checked ${checked} conversations`);
  // A conversation ending with a user turn, trained on the assistant, still trains only the assistant turns.
  const ex = tokenizeChat(tok, template('chatml'), ALTERNATING[2]!, 'assistant');
  assert.deepEqual(trainedRuns(tok, ex), ['Très bien, merci!\nAnd you?<|im_end|>']);
  // The straddle: the padded content's leading space merges with the header's newline into one trained token.
  const padded = trainedRuns(tok, tokenizeChat(tok, template('chatml'), ALTERNATING[3]!, 'assistant'));
  assert.deepEqual(padded, ['\n  Spaces around  <|im_end|>', 'Quoted "things" {braces} <tags><|im_end|>']);
});

test('completion and preference examples', async () => {
  const tok = await tokenizer();
  const c = tokenizeCompletion(tok, 'Q: What is the capital of France?\nA:', ' Paris.');
  assert.deepEqual(trainedRuns(tok, c), [' Paris.<|endoftext|>']);
  assert.equal(tok.decode(c.ids), 'Q: What is the capital of France?\nA: Paris.<|endoftext|>');
  assert.equal(c.trained[0], 0);
  const withEos = tokenizeCompletion(tok, 'Hello', ' there', { bos: '<s>', eos: '</s>' });
  assert.equal(tok.decode(withEos.ids), '<s>Hello there</s>');
  assert.deepEqual(trainedRuns(tok, withEos), [' there</s>']);

  const qwen = template('qwen');
  const p = tokenizePreference(tok, qwen, [s('You are terse.'), u('Why is the sky blue?')], 'Rayleigh scattering.', 'Because it is.');
  assert.deepEqual(trainedRuns(tok, p.chosen), ['Rayleigh scattering.<|im_end|>']);
  assert.deepEqual(trainedRuns(tok, p.rejected), ['Because it is.<|im_end|>']);
  assert.ok(p.prompt.trained.every((x) => x === 0));
  assert.deepEqual(Array.from(p.chosen.ids.subarray(0, p.prompt.ids.length)), Array.from(p.prompt.ids), 'the prompt is a prefix of each answer');
  assert.ok(tok.decode(p.prompt.ids).endsWith('<|im_start|>assistant\n'));
  const plain = tokenizePreference(tok, template('mistral'), 'Say hi.', ' Hi!', ' No.');
  assert.deepEqual(trainedRuns(tok, plain.chosen), [' Hi!</s>']);
  assert.deepEqual(trainedRuns(tok, plain.rejected), [' No.</s>']);
  assert.equal(tok.decode(plain.prompt.ids), 'Say hi.');
});

test('example lines: chat, ShareGPT, completion, preference; each bad line is one error naming its line', () => {
  assert.deepEqual(parseExampleLine('{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}', 'chat', { line: 1 }),
    { kind: 'chat', messages: [u('hi'), a('yo')] });
  assert.deepEqual(parseExampleLine('{"conversations":[{"from":"system","value":"s"},{"from":"human","value":"hi"},{"from":"gpt","value":"yo"}]}', 'chat', { line: 1 }),
    { kind: 'chat', messages: [s('s'), u('hi'), a('yo')] });
  assert.deepEqual(parseExampleLine('{"prompt":"p","completion":"c"}', 'completion', { line: 1 }), { kind: 'completion', prompt: 'p', completion: 'c' });
  assert.deepEqual(parseExampleLine('{"prompt":[{"role":"user","content":"q"}],"chosen":{"role":"assistant","content":"good"},"rejected":[{"role":"assistant","content":"bad"}]}', 'preference', { line: 1 }),
    { kind: 'preference', prompt: [u('q')], chosen: 'good', rejected: 'bad' });
  assert.deepEqual(parseExampleLine('{"prompt":"q","chosen":"good","rejected":"bad"}', 'preference', { line: 1 }),
    { kind: 'preference', prompt: 'q', chosen: 'good', rejected: 'bad' });
  const lines = parseExampleLines('{"prompt":"a","completion":"b"}\n\n{"prompt":"c","completion":"d"}\r\n', 'completion');
  assert.equal(lines.length, 2);

  const bad: [string, 'chat' | 'completion' | 'preference', RegExp, boolean?][] = [
    ['{"messages": [', 'chat', /^data\.jsonl:7: not JSON/],
    ['[1, 2]', 'chat', /^data\.jsonl:7: expected a JSON object, got a list/],
    ['{"text": "x"}', 'chat', /^data\.jsonl:7: has neither "messages" nor "conversations"/],
    ['{"messages": []}', 'chat', /^data\.jsonl:7: "messages" is empty/],
    ['{"messages": [{"role": "robot", "content": "x"}]}', 'chat', /^data\.jsonl:7: messages\[0\] has the unknown role "robot"/],
    ['{"messages": [{"role": "user"}]}', 'chat', /^data\.jsonl:7: messages\[0\] has no "content"/],
    ['{"messages": [{"content": "x"}]}', 'chat', /^data\.jsonl:7: messages\[0\] has no "role"/],
    ['{"messages": [{"role": "user", "content": 3}]}', 'chat', /^data\.jsonl:7: messages\[0\]\.content is number 3, expected a string/],
    ['{"conversations": [{"from": "bot", "value": "x"}]}', 'chat', /^data\.jsonl:7: conversations\[0\] has the unknown from "bot"/],
    ['{"messages": [{"role": "user", "content": "x"}]}', 'chat', /^data\.jsonl:7: the conversation has no assistant turn/, true],
    ['{"prompt": "p"}', 'completion', /^data\.jsonl:7: missing "completion"/],
    ['{"prompt": "p", "chosen": "c"}', 'preference', /^data\.jsonl:7: missing "rejected"/],
    ['{"prompt": "p", "chosen": {"role": "user", "content": "c"}, "rejected": "r"}', 'preference', /^data\.jsonl:7: "chosen" is a user message, expected an assistant message/],
    ['{"prompt": 5, "chosen": "c", "rejected": "r"}', 'preference', /^data\.jsonl:7: "prompt" is number 5/],
  ];
  for (const [line, format, re, requireAssistant] of bad) {
    assert.throws(() => parseExampleLine(line, format, { line: 7, file: 'data.jsonl' }, { requireAssistant }), (e: unknown) => e instanceof ChatDataError && re.test(e.message), line);
  }
  // Without a file name, the line number alone; parseExampleLines counts lines from 1, blank ones included.
  assert.throws(() => parseExampleLines('{"prompt":"a","completion":"b"}\n\n{"prompt":"c"}', 'completion'), /^ChatDataError: line 3: missing "completion"/);
});

test('templates from a Hugging Face directory, a .jinja file or the built-in; template errors', async () => {
  const tok = await tokenizer();
  const dir = join(tmpDir(), 'hf');
  mkdirSync(dir, { recursive: true });
  const llama = TEMPLATES.llama3!;
  // The string form, with bos/eos as AddedToken objects.
  writeFileSync(join(dir, 'tokenizer_config.json'), JSON.stringify({ chat_template: llama.text, bos_token: { content: '<|begin_of_text|>', lstrip: false }, eos_token: '<|eot_id|>' }));
  const t = loadChatTemplate('model', { tokenizerDir: dir });
  assert.equal(t.bos, '<|begin_of_text|>');
  assert.equal(t.eos, '<|eot_id|>');
  assert.equal(renderChat(t, WITH_SYSTEM[0]!), renderChat(template('llama3'), WITH_SYSTEM[0]!));
  assert.ok(renderChat(t, WITH_SYSTEM[0]!).startsWith('<|begin_of_text|><|start_header_id|>system'));
  // The list form takes "default".
  writeFileSync(join(dir, 'tokenizer_config.json'), JSON.stringify({ chat_template: [{ name: 'tool_use', template: 'TOOLS' }, { name: 'default', template: chatml.text }], eos_token: '<|im_end|>' }));
  assert.equal(loadChatTemplate('model', { tokenizerDir: dir }).text, chatml.text);
  writeFileSync(join(dir, 'tokenizer_config.json'), JSON.stringify({ chat_template: [{ name: 'tool_use', template: 'TOOLS' }] }));
  assert.throws(() => loadChatTemplate('model', { tokenizerDir: dir }), /without one named "default"/);
  // A directory without a template.
  writeFileSync(join(dir, 'tokenizer_config.json'), JSON.stringify({ eos_token: '</s>' }));
  assert.throws(() => loadChatTemplate('model', { tokenizerDir: dir }), (e: unknown) => e instanceof ChatTemplateError && /has no chat template/.test(e.message));
  assert.throws(() => loadChatTemplate('model'), /needs the model's Hugging Face directory/);
  // A .jinja file, with the directory's eos.
  const file = join(FIX, 'chat_templates/mistral.jinja');
  const m = loadChatTemplate(file, { tokenizerDir: dir });
  assert.equal(m.eos, '</s>');
  assert.throws(() => loadChatTemplate(join(dir, 'none.jinja')), /no such file/);
  // A template that raises: its own message, as jinja2 gives it.
  const want = oracle([{ template: 'mistral', messages: WITH_SYSTEM[0]!, gen: false }]);
  assert.equal(want[0]!.error, 'Conversation roles must alternate user/assistant/user/assistant/...');
  assert.throws(() => renderChat(template('mistral'), WITH_SYSTEM[0]!), (e: unknown) => e instanceof ChatTemplateError && e.message.endsWith(`rejected the conversation: ${want[0]!.error}`));
  assert.throws(() => tokenizeChat(tok, template('mistral'), [u('a'), u('b')], 'assistant'), /rejected the conversation: Conversation roles must alternate/);
  assert.throws(() => chatTemplateFromText('{% for %}'), /does not parse/);
  // Nothing to train, a tokenizer without special tokens.
  assert.throws(() => tokenizeChat(tok, chatml, [u('hi')], 'assistant'), /no assistant turn/);
  assert.throws(() => tokenizeChat(new ByteTokenizer(), chatml, ALTERNATING[0]!, 'assistant'), /cannot encode chat templates/);
});

test('added tokens with lstrip/rstrip absorb the whitespace beside them, as the library does', async () => {
  const counts = new WordCounter();
  counts.add('hello world foo bar baz hello world '.repeat(3));
  const { json } = trainBpe(counts.counts, 300);
  const added = json.added_tokens as object[];
  added.push({ id: 300, content: '<L>', single_word: false, lstrip: true, rstrip: false, normalized: false, special: true });
  added.push({ id: 301, content: '<R>', single_word: false, lstrip: false, rstrip: true, normalized: false, special: true });
  const path = join(tmpDir(), 'strip.json');
  writeFileSync(path, JSON.stringify(json));
  const tok = (await loadTokenizer(path)) as JsonTokenizer;
  for (const text of ['hello  <L> world', 'hello <R>  world', 'a\n<L>b', '<L> x <R>\n\ny']) {
    const { ids, starts } = tok.encodeWithOffsets(text);
    assert.deepEqual(ids, tok.encodeReference(text), text);
    assert.equal(starts[0], 0);
  }
  assert.deepEqual(tok.encodeWithOffsets('hello  <L> world').starts.length, 3);
});
