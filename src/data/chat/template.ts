// Chat templates: the Jinja text that turns a message list into the model's prompt format, rendered
// through @huggingface/jinja (the engine of transformers.js) with the context transformers'
// apply_chat_template gives: messages, bos_token, eos_token (and the other *_token strings of the
// tokenizer_config.json), add_generation_prompt and raise_exception.
import { createHash } from 'node:crypto';
import { existsSync, readFileSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { Environment, Interpreter, Template } from '@huggingface/jinja';
import type { Message } from './examples.js';

/** A loaded chat template. */
/** A template as the engine parsed it (see ChatTemplate.compiled). */
export interface CompiledTemplate {
  readonly parsed: unknown;
}

export interface ChatTemplate {
  /** "model" (a Hugging Face directory's), "chatml" or the .jinja path. */
  source: string;
  text: string;
  bos: string;
  eos: string;
  /** Every *_token string of the tokenizer config (bos_token, eos_token, pad_token, ...), passed to the template. */
  tokens: Record<string, string>;
  /** sha256 of the template text, bos and eos: what decides the rendered text. */
  identity: string;
  /**
   * The parsed template. Opaque on purpose: the engine's own type declarations stay out of
   * flotilla's, so a project compiling against flotilla's types does not compile the engine's.
   */
  readonly compiled: CompiledTemplate;
}

/** A template that cannot be loaded or that fails (raise_exception included) on a conversation. */
export class ChatTemplateError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ChatTemplateError';
  }
}

/** ChatML (Qwen, many fine-tunes): `<|im_start|>role\ncontent<|im_end|>\n` a message. */
export const CHATML_TEMPLATE =
  "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}" +
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/** A special token of tokenizer_config.json: a string, or an AddedToken object {content, ...}. */
function tokenString(v: unknown): string | undefined {
  if (typeof v === 'string') return v;
  if (v !== null && typeof v === 'object' && typeof (v as { content?: unknown }).content === 'string') return (v as { content: string }).content;
  return undefined;
}

interface TokenizerConfig {
  template?: string;
  tokens: Record<string, string>;
}

function readTokenizerConfig(dir: string): TokenizerConfig {
  const path = join(dir, 'tokenizer_config.json');
  if (!existsSync(path)) return { tokens: {} };
  let json: Record<string, unknown>;
  try {
    json = JSON.parse(readFileSync(path, 'utf8')) as Record<string, unknown>;
  } catch (e) {
    throw new ChatTemplateError(`${path} is not JSON (${(e as Error).message})`);
  }
  const tokens: Record<string, string> = {};
  for (const [k, v] of Object.entries(json)) {
    if (!k.endsWith('_token')) continue;
    const s = tokenString(v);
    if (s !== undefined) tokens[k] = s;
  }
  const ct = json.chat_template;
  let template: string | undefined;
  if (typeof ct === 'string') {
    template = ct;
  } else if (Array.isArray(ct)) {
    // The named form: [{name: "default", template: ...}, {name: "tool_use", ...}]; a conversation uses "default".
    const named = ct as { name?: unknown; template?: unknown }[];
    const def = named.find((t) => t && t.name === 'default');
    if (!def || typeof def.template !== 'string') {
      const names = named.map((t) => JSON.stringify(t?.name)).join(', ');
      throw new ChatTemplateError(`${path}: chat_template is a list of named templates (${names}) without one named "default"`);
    }
    template = def.template;
  } else if (ct !== undefined && ct !== null) {
    throw new ChatTemplateError(`${path}: chat_template is neither a string nor a list of {name, template}`);
  }
  return { template, tokens };
}

/**
 * The bos and eos strings a Hugging Face directory's tokenizer_config.json names, and whether the
 * tokenizer adds bos in front of a text (add_bos_token): what a completion example begins and ends with.
 */
export function tokenizerSpecials(dir: string): { bos?: string; eos?: string; addBos: boolean } {
  const cfg = readTokenizerConfig(resolve(dir));
  let addBos = false;
  const path = join(resolve(dir), 'tokenizer_config.json');
  if (existsSync(path)) addBos = (JSON.parse(readFileSync(path, 'utf8')) as { add_bos_token?: unknown }).add_bos_token === true;
  return { ...(cfg.tokens.bos_token ? { bos: cfg.tokens.bos_token } : {}), ...(cfg.tokens.eos_token ? { eos: cfg.tokens.eos_token } : {}), addBos };
}

function compile(text: string, source: string): CompiledTemplate {
  try {
    return new Template(text);
  } catch (e) {
    throw new ChatTemplateError(`chat template ${source} does not parse: ${(e as Error).message}`);
  }
}

function make(source: string, text: string, tokens: Record<string, string>): ChatTemplate {
  const bos = tokens.bos_token ?? '';
  const eos = tokens.eos_token ?? '';
  const identity = `sha256:${createHash('sha256').update(JSON.stringify([text, bos, eos])).digest('hex')}`;
  return { source, text, bos, eos, tokens, identity, compiled: compile(text, source) };
}

/**
 * The chat template `spec` names: "model" reads the Hugging Face directory `tokenizerDir`
 * (tokenizer_config.json's chat_template, a string or the list form's "default"; else
 * chat_template.jinja beside it) with its bos/eos tokens; "chatml" the built-in ChatML; anything else
 * is the path of a .jinja file (bos/eos then come from `tokenizerDir` when given).
 */
export function loadChatTemplate(spec: string, o: { tokenizerDir?: string } = {}): ChatTemplate {
  const cfg = o.tokenizerDir !== undefined ? readTokenizerConfig(resolve(o.tokenizerDir)) : { tokens: {} as Record<string, string> };
  if (spec === 'chatml') {
    return make('chatml', CHATML_TEMPLATE, { ...cfg.tokens, eos_token: '<|im_end|>', bos_token: cfg.tokens.bos_token ?? '' });
  }
  if (spec === 'model') {
    if (o.tokenizerDir === undefined) {
      throw new ChatTemplateError('chatTemplate = "model" needs the model\'s Hugging Face directory (its tokenizer_config.json holds the template); or use "chatml" or a .jinja file');
    }
    const dir = resolve(o.tokenizerDir);
    let text = cfg.template;
    if (text === undefined && existsSync(join(dir, 'chat_template.jinja'))) text = readFileSync(join(dir, 'chat_template.jinja'), 'utf8');
    if (text === undefined) {
      throw new ChatTemplateError(`${dir} has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja); set chatTemplate to "chatml" or the path of a .jinja file`);
    }
    return make('model', text, cfg.tokens);
  }
  const path = resolve(spec);
  if (!existsSync(path) || !statSync(path).isFile()) {
    throw new ChatTemplateError(`chat template ${JSON.stringify(spec)}: no such file ${path}; use "model", "chatml" or the path of a .jinja file`);
  }
  return make(path, readFileSync(path, 'utf8'), cfg.tokens);
}

/** A template from its text (tests, callers holding the text already). */
export function chatTemplateFromText(text: string, tokens: Record<string, string> = {}, source = 'inline'): ChatTemplate {
  return make(source, text, tokens);
}

const MONTHS = ['January', 'February', 'March', 'April', 'May', 'June', 'July', 'August', 'September', 'October', 'November', 'December'];

/** Python's datetime.now().strftime for the directives chat templates use (C locale: English names). */
function strftimeNow(format: unknown): string {
  const d = new Date();
  const pad = (n: number): string => String(n).padStart(2, '0');
  return String(format).replace(/%[YmdbBHMSpIjaA%]/g, (f) => {
    switch (f) {
      case '%Y': return String(d.getFullYear());
      case '%m': return pad(d.getMonth() + 1);
      case '%d': return pad(d.getDate());
      case '%b': return MONTHS[d.getMonth()]!.slice(0, 3);
      case '%B': return MONTHS[d.getMonth()]!;
      case '%H': return pad(d.getHours());
      case '%M': return pad(d.getMinutes());
      case '%S': return pad(d.getSeconds());
      case '%I': return pad(((d.getHours() + 11) % 12) + 1);
      case '%p': return d.getHours() < 12 ? 'AM' : 'PM';
      case '%j': return String(Math.floor((d.getTime() - new Date(d.getFullYear(), 0, 1).getTime()) / 86_400_000) + 1).padStart(3, '0');
      case '%a': return ['Sun', 'Mon', 'Tue', 'Wed', 'Thu', 'Fri', 'Sat'][d.getDay()]!;
      case '%A': return ['Sunday', 'Monday', 'Tuesday', 'Wednesday', 'Thursday', 'Friday', 'Saturday'][d.getDay()]!;
      default: return '%';
    }
  });
}

/** Python's range(). */
function range(start: number, stop?: number, step = 1): number[] {
  if (stop === undefined) [start, stop] = [0, start];
  if (step === 0) throw new Error('range() arg 3 must not be zero');
  const out: number[] = [];
  for (let i = start; step > 0 ? i < stop : i > stop; i += step) out.push(i);
  return out;
}

/** Thrown by the template's raise_exception, so its message is told apart from a failure to render. */
class TemplateRaised extends Error {}

/**
 * The text `messages` render to, as transformers' apply_chat_template(tokenize=False) gives it. The
 * globals are set here rather than by Template.render, whose own raise_exception cannot be told apart
 * from other errors: a raise becomes "the chat template rejected the conversation: <its message>".
 */
export function renderChat(t: ChatTemplate, messages: readonly Message[], o: { addGenerationPrompt?: boolean } = {}): string {
  const env = new Environment();
  const globals: Record<string, unknown> = {
    false: false, true: true, none: null, False: false, True: true, None: null,
    range,
    strftime_now: strftimeNow,
    raise_exception: (message: unknown) => {
      throw new TemplateRaised(String(message));
    },
    ...t.tokens,
    bos_token: t.bos,
    eos_token: t.eos,
    messages: messages.map((m) => ({ role: m.role, content: m.content })),
    add_generation_prompt: o.addGenerationPrompt ?? false,
  };
  try {
    for (const [k, v] of Object.entries(globals)) env.set(k, v);
    return new Interpreter(env).run((t.compiled as Template).parsed).value as string;
  } catch (e) {
    if (e instanceof TemplateRaised) throw new ChatTemplateError(`the chat template (${t.source}) rejected the conversation: ${e.message}`);
    throw new ChatTemplateError(`the chat template (${t.source}) failed to render: ${(e as Error).message}`);
  }
}
