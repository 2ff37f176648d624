// Example lines of the masked data formats, one JSON object a line:
//   chat:       {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
//               or ShareGPT's {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}
//   completion: {"prompt": "...", "completion": "..."}
//   preference: {"prompt": string | messages, "chosen": string | assistant message, "rejected": ...}
// Every problem is one ChatDataError naming the line (and the file, when given).

export type Role = 'system' | 'user' | 'assistant';

export interface Message {
  role: Role;
  content: string;
}

export interface ChatExampleLine {
  kind: 'chat';
  messages: Message[];
}

export interface CompletionExampleLine {
  kind: 'completion';
  prompt: string;
  completion: string;
}

export interface PreferenceExampleLine {
  kind: 'preference';
  /** A plain-text prompt (TRL's "standard" format) or a conversation rendered through the template. */
  prompt: string | Message[];
  /** A string, or the content of an assistant message. */
  chosen: string;
  rejected: string;
}

export type ExampleFormat = 'chat' | 'completion' | 'preference';
export type ExampleLine = ChatExampleLine | CompletionExampleLine | PreferenceExampleLine;

/** Where a line came from, for messages: "FILE:LINE: ..." or "line LINE: ...". */
export interface LineOrigin {
  line: number;
  file?: string;
}

/** A bad example line; the message names the file and line and the problem. */
export class ChatDataError extends Error {
  constructor(readonly origin: LineOrigin, readonly problem: string) {
    super(`${origin.file !== undefined ? `${origin.file}:${origin.line}` : `line ${origin.line}`}: ${problem}`);
    this.name = 'ChatDataError';
  }
}

const ROLES: readonly string[] = ['system', 'user', 'assistant'];
const SHAREGPT_ROLES: Record<string, Role> = { human: 'user', user: 'user', gpt: 'assistant', assistant: 'assistant', system: 'system' };

function describe(v: unknown): string {
  if (v === null) return 'null';
  if (Array.isArray(v)) return 'a list';
  return typeof v === 'object' ? 'an object' : `${typeof v} ${JSON.stringify(v)}`;
}

function parseObject(text: string, at: LineOrigin): Record<string, unknown> {
  let v: unknown;
  try {
    v = JSON.parse(text);
  } catch (e) {
    throw new ChatDataError(at, `not JSON (${(e as Error).message})`);
  }
  if (v === null || typeof v !== 'object' || Array.isArray(v)) throw new ChatDataError(at, `expected a JSON object, got ${describe(v)}`);
  return v as Record<string, unknown>;
}

/** One message of a "messages" list ({role, content}) or a ShareGPT "conversations" list ({from, value}). */
function parseMessage(v: unknown, i: number, sharegpt: boolean, at: LineOrigin): Message {
  const where = `${sharegpt ? 'conversations' : 'messages'}[${i}]`;
  if (v === null || typeof v !== 'object' || Array.isArray(v)) throw new ChatDataError(at, `${where} is ${describe(v)}, expected an object`);
  const m = v as Record<string, unknown>;
  const roleKey = sharegpt ? 'from' : 'role';
  const contentKey = sharegpt ? 'value' : 'content';
  const role = m[roleKey];
  if (role === undefined) throw new ChatDataError(at, `${where} has no "${roleKey}"`);
  if (typeof role !== 'string') throw new ChatDataError(at, `${where}.${roleKey} is ${describe(role)}, expected a string`);
  let r: Role | undefined;
  if (sharegpt) r = SHAREGPT_ROLES[role];
  else if (ROLES.includes(role)) r = role as Role;
  if (r === undefined) {
    const known = sharegpt ? Object.keys(SHAREGPT_ROLES).join(', ') : ROLES.join(', ');
    throw new ChatDataError(at, `${where} has the unknown ${roleKey} ${JSON.stringify(role)} (known: ${known})`);
  }
  const content = m[contentKey];
  if (content === undefined) throw new ChatDataError(at, `${where} has no "${contentKey}"`);
  if (typeof content !== 'string') throw new ChatDataError(at, `${where}.${contentKey} is ${describe(content)}, expected a string`);
  return { role: r, content };
}

/** A non-empty message list: from "messages" or, failing that, ShareGPT's "conversations". */
function parseMessages(o: Record<string, unknown>, at: LineOrigin, key?: string): Message[] {
  let list: unknown;
  let sharegpt = false;
  let name: string;
  if (key !== undefined) {
    list = o[key];
    name = key;
  } else if (o.messages !== undefined) {
    list = o.messages;
    name = 'messages';
  } else if (o.conversations !== undefined) {
    list = o.conversations;
    name = 'conversations';
    sharegpt = true;
  } else {
    throw new ChatDataError(at, 'has neither "messages" nor "conversations" (a chat line is {"messages": [{"role": ..., "content": ...}, ...]})');
  }
  if (!Array.isArray(list)) throw new ChatDataError(at, `"${name}" is ${describe(list)}, expected a list of messages`);
  if (list.length === 0) throw new ChatDataError(at, `"${name}" is empty`);
  return list.map((m, i) => parseMessage(m, i, sharegpt, at));
}

function requireString(o: Record<string, unknown>, key: string, at: LineOrigin): string {
  const v = o[key];
  if (v === undefined) throw new ChatDataError(at, `missing "${key}"`);
  if (typeof v !== 'string') throw new ChatDataError(at, `"${key}" is ${describe(v)}, expected a string`);
  return v;
}

/** A preference answer: a string, an assistant message, or a list holding exactly one assistant message. */
function parseAnswer(o: Record<string, unknown>, key: string, at: LineOrigin): string {
  const v = o[key];
  if (v === undefined) throw new ChatDataError(at, `missing "${key}"`);
  if (typeof v === 'string') return v;
  const one = Array.isArray(v) && v.length === 1 ? v[0] : v;
  if (one === null || typeof one !== 'object' || Array.isArray(one)) {
    throw new ChatDataError(at, `"${key}" is ${describe(v)}, expected a string or an assistant message`);
  }
  const m = parseMessage(one, 0, false, at);
  if (m.role !== 'assistant') throw new ChatDataError(at, `"${key}" is a ${m.role} message, expected an assistant message`);
  return m.content;
}

/**
 * One line of a chat, completion or preference file. `requireAssistant` (chat lines trained on the
 * assistant) makes a conversation without an assistant turn an error, since it has nothing to train.
 */
export function parseExampleLine(text: string, format: ExampleFormat, at: LineOrigin, o: { requireAssistant?: boolean } = {}): ExampleLine {
  const obj = parseObject(text, at);
  if (format === 'chat') {
    const messages = parseMessages(obj, at);
    if (o.requireAssistant && !messages.some((m) => m.role === 'assistant')) {
      throw new ChatDataError(at, 'the conversation has no assistant turn, so nothing in it is trained (trainOn = "assistant")');
    }
    return { kind: 'chat', messages };
  }
  if (format === 'completion') {
    return { kind: 'completion', prompt: requireString(obj, 'prompt', at), completion: requireString(obj, 'completion', at) };
  }
  let prompt: string | Message[];
  if (obj.prompt === undefined) throw new ChatDataError(at, 'missing "prompt"');
  if (typeof obj.prompt === 'string') prompt = obj.prompt;
  else if (Array.isArray(obj.prompt)) prompt = parseMessages(obj, at, 'prompt');
  else throw new ChatDataError(at, `"prompt" is ${describe(obj.prompt)}, expected a string or a list of messages`);
  return { kind: 'preference', prompt, chosen: parseAnswer(obj, 'chosen', at), rejected: parseAnswer(obj, 'rejected', at) };
}

/** Every non-blank line of a .jsonl text, numbered from 1. */
export function parseExampleLines(text: string, format: ExampleFormat, o: { file?: string; requireAssistant?: boolean } = {}): ExampleLine[] {
  const out: ExampleLine[] = [];
  const lines = text.split('\n');
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i]!.replace(/\r$/, '');
    if (line.trim() === '') continue;
    out.push(parseExampleLine(line, format, { line: i + 1, file: o.file }, o));
  }
  return out;
}
