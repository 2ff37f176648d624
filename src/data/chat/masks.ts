// Token ids and loss masks of chat, completion and preference examples.
//
// The whole rendered conversation is encoded at once (added tokens as single ids), so the ids equal
// transformers' apply_chat_template(tokenize=True). Then a token is trained iff it holds a byte of
// a trained span of the rendered text (see maskFromSpans). `trained[k] = 1` means token k is a trained TARGET: the loss
// counts the prediction of token k from the tokens before it.
//
// Assistant spans come from prefix renders: assistant turn i spans
//   [ render(messages[:i], add_generation_prompt=true) , render(messages[:i+1]) )
// and both renders must be prefixes of the full render. This is exact for ChatML/Qwen, Llama 3 and
// Mistral-style templates because they render message by message, in order, so a prefix of the
// conversation renders to a prefix of the text; and the generation prompt is exactly the text the
// template puts before an assistant's content. It does not care what the template does to the content
// (Llama 3 `| trim`s it, which defeats the alternative of wrapping each content in marker characters
// and finding them again), and it trains exactly what the model produces at inference after the
// generation prompt. A template for which a prefix does not render to a prefix (one that rewrites
// earlier turns depending on the last, e.g. dropping past reasoning) gets a clear error rather than a
// wrong mask. The span's end is then cut after its end-of-turn token: the text after the last added
// token (or eos) of the span is dropped when it is only whitespace (ChatML's "\n" after <|im_end|>),
// so a span is the content plus the template's end-of-turn token(s), nothing else.
import type { AddedToken, EncodedWithOffsets, Tokenizer } from '../tokenizer.js';
import type { Message } from './examples.js';
import { ChatTemplateError, renderChat, type ChatTemplate } from './template.js';

export type TrainOn = 'assistant' | 'last' | 'all';

/** One tokenized example. */
export interface TokenizedExample {
  ids: Int32Array;
  /** 1 where the token is a trained target. */
  trained: Uint8Array;
}

/** A preference pair: the prompt alone (nothing trained) and the two full sequences, trained on the answer. */
export interface TokenizedPreference {
  prompt: TokenizedExample;
  chosen: TokenizedExample;
  rejected: TokenizedExample;
}

/** What masking needs of a tokenizer: added tokens as single ids, and token byte offsets (JsonTokenizer). */
export interface SpecialsTokenizer extends Tokenizer {
  readonly addedTokens: readonly AddedToken[];
  encodeWithOffsets(text: string): EncodedWithOffsets;
}

export function specialsTokenizer(tok: Tokenizer): SpecialsTokenizer {
  const t = tok as Partial<SpecialsTokenizer>;
  if (typeof t.encodeWithOffsets !== 'function' || !Array.isArray(t.addedTokens)) {
    throw new Error(`tokenizer ${tok.name} cannot encode chat templates (it has no added special tokens); use the model's tokenizer.json`);
  }
  return tok as SpecialsTokenizer;
}

/** A span of the rendered text, in UTF-16 indices [start, end). */
export interface Span {
  start: number;
  end: number;
  /** Index of the assistant message in the conversation. */
  message: number;
}

/** The rendered conversation and its assistant spans (content + end-of-turn). */
export interface RenderedChat {
  text: string;
  turns: Span[];
}

function endOfTurnCut(span: string, markers: readonly string[]): number {
  let best = -1;
  for (const m of markers) {
    const at = span.lastIndexOf(m);
    if (at < 0) continue;
    const end = at + m.length;
    if (span.slice(end).trim() === '' && end > best) best = end;
  }
  return best < 0 ? span.length : best;
}

/** The end-of-turn markers a span may end with: the tokenizer's added tokens and the template's eos. */
function markersOf(t: ChatTemplate, tok?: SpecialsTokenizer): string[] {
  const m = new Set<string>();
  if (t.eos) m.add(t.eos);
  for (const a of tok?.addedTokens ?? []) m.add(a.content);
  return [...m];
}

/** Render `messages` and find every assistant turn's span (see the head of this file). */
export function renderWithTurns(t: ChatTemplate, messages: readonly Message[], tok?: SpecialsTokenizer): RenderedChat {
  const text = renderChat(t, messages);
  const markers = markersOf(t, tok);
  const turns: Span[] = [];
  for (let i = 0; i < messages.length; i++) {
    if (messages[i]!.role !== 'assistant') continue;
    const before = renderChat(t, messages.slice(0, i), { addGenerationPrompt: true });
    const through = i + 1 === messages.length ? text : renderChat(t, messages.slice(0, i + 1));
    if (!text.startsWith(before) || !text.startsWith(through) || through.length < before.length) {
      throw new ChatTemplateError(`the chat template (${t.source}) cannot be aligned to its messages: the conversation up to message ${i} does not render to a prefix of the whole, so assistant turn ${i} cannot be located`);
    }
    const cut = endOfTurnCut(text.slice(before.length, through.length), markers);
    turns.push({ start: before.length, end: before.length + cut, message: i });
  }
  return { text, turns };
}

/**
 * Token k is trained iff one of its bytes lies in a span. Spans end at a special token, so only a span's
 * start can cut through a token: when the content begins with whitespace, byte-level BPE may merge the
 * template's last newline with it ("\n" + " Hi" -> "\n " "Hi"), and that token is trained so that no
 * byte the assistant said goes untrained.
 */
function maskFromSpans(text: string, enc: EncodedWithOffsets, spans: readonly Span[]): Uint8Array {
  const ranges = spans.map((s) => [Buffer.byteLength(text.slice(0, s.start), 'utf8'), Buffer.byteLength(text.slice(0, s.end), 'utf8')] as const);
  const total = Buffer.byteLength(text, 'utf8');
  const trained = new Uint8Array(enc.ids.length);
  for (let k = 0; k < enc.ids.length; k++) {
    const lo = enc.starts[k]!;
    const hi = k + 1 < enc.ids.length ? enc.starts[k + 1]! : total;
    for (const [a, b] of ranges) {
      if (lo < b && hi > a) {
        trained[k] = 1;
        break;
      }
    }
  }
  return trained;
}

/** The single id of a special-token string (eos, bos); throws when the tokenizer splits it. */
export function singleId(tok: SpecialsTokenizer, s: string, what: string): number {
  const ids = tok.encodeWithOffsets(s).ids;
  if (ids.length !== 1) {
    throw new Error(`the ${what} ${JSON.stringify(s)} is ${ids.length} tokens in tokenizer ${tok.name}, not one; add it to the tokenizer's added_tokens`);
  }
  return ids[0]!;
}

/** Ids and mask of a conversation rendered with its template. */
export function tokenizeChat(tok: Tokenizer, t: ChatTemplate, messages: readonly Message[], trainOn: TrainOn): TokenizedExample {
  const st = specialsTokenizer(tok);
  const r = renderWithTurns(t, messages, st);
  if (trainOn !== 'all' && r.turns.length === 0) {
    throw new ChatTemplateError(`the conversation has no assistant turn, so nothing in it is trained (trainOn = "${trainOn}")`);
  }
  const enc = st.encodeWithOffsets(r.text);
  const trained = trainOn === 'all' ? new Uint8Array(enc.ids.length).fill(1) : maskFromSpans(r.text, enc, trainOn === 'last' ? r.turns.slice(-1) : r.turns);
  return { ids: Int32Array.from(enc.ids), trained };
}

/**
 * A completion example: [bos] ++ prompt ++ completion ++ [eos], trained on the completion and eos.
 * eos defaults to the tokenizer's end-of-text token; bos is added only when given.
 */
export function tokenizeCompletion(tok: Tokenizer, prompt: string, completion: string, o: { bos?: string; eos?: string } = {}): TokenizedExample {
  const st = specialsTokenizer(tok);
  const head: number[] = [];
  if (o.bos) head.push(singleId(st, o.bos, 'bos token'));
  head.push(...st.encodeWithOffsets(prompt).ids);
  const tail = [...st.encodeWithOffsets(completion).ids, o.eos ? singleId(st, o.eos, 'eos token') : st.eot];
  const ids = Int32Array.from([...head, ...tail]);
  const trained = new Uint8Array(ids.length);
  trained.fill(1, head.length);
  return { ids, trained };
}

/**
 * A preference pair. A message-list prompt goes through the template: each answer is appended as an
 * assistant turn and trained alone (its content + end-of-turn); the prompt is rendered with the
 * generation prompt. A string prompt is completion-style: prompt ++ answer ++ [eos].
 */
export function tokenizePreference(tok: Tokenizer, t: ChatTemplate | undefined, prompt: string | readonly Message[], chosen: string, rejected: string): TokenizedPreference {
  const st = specialsTokenizer(tok);
  if (typeof prompt === 'string') {
    const eos = t?.eos || undefined;
    const p = Int32Array.from(st.encodeWithOffsets(prompt).ids);
    return {
      prompt: { ids: p, trained: new Uint8Array(p.length) },
      chosen: tokenizeCompletion(st, prompt, chosen, { eos }),
      rejected: tokenizeCompletion(st, prompt, rejected, { eos }),
    };
  }
  if (!t) throw new ChatTemplateError('a preference prompt given as messages needs a chat template');
  const p = Int32Array.from(st.encodeWithOffsets(renderChat(t, prompt, { addGenerationPrompt: true })).ids);
  const answer = (content: string): TokenizedExample => tokenizeChat(st, t, [...prompt, { role: 'assistant', content }], 'last');
  return { prompt: { ids: p, trained: new Uint8Array(p.length) }, chosen: answer(chosen), rejected: answer(rejected) };
}
