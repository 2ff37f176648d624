// Chat templates: the Jinja text that turns a message list into the model's prompt format, rendered
// through @huggingface/jinja (the engine of transformers.js) with the context transformers'
// apply_chat_template gives: messages, bos_token, eos_token (and the other *_token strings of the
// tokenizer_config.json), add_generation_prompt and raise_exception.
import { createHash } from 'node:crypto';
import { existsSync, readFileSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { Template } from '@huggingface/jinja';
import type { Message } from './examples.js';

/** A loaded chat template. */
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
  readonly compiled: Template;
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

function compile(text: string, source: string): Template {
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

/** The text `messages` render to, as transformers' apply_chat_template(tokenize=False) gives it. */
export function renderChat(t: ChatTemplate, messages: readonly Message[], o: { addGenerationPrompt?: boolean } = {}): string {
  const ctx: Record<string, unknown> = {
    ...t.tokens,
    bos_token: t.bos,
    eos_token: t.eos,
    messages: messages.map((m) => ({ role: m.role, content: m.content })),
    add_generation_prompt: o.addGenerationPrompt ?? false,
    raise_exception: (message: unknown) => {
      throw new TemplateRaised(String(message));
    },
  };
  try {
    return t.compiled.render(ctx);
  } catch (e) {
    if (e instanceof TemplateRaised) throw new ChatTemplateError(`the chat template (${t.source}) rejected the conversation: ${e.message}`);
    throw new ChatTemplateError(`the chat template (${t.source}) failed to render: ${(e as Error).message}`);
  }
}

class TemplateRaised extends Error {}
