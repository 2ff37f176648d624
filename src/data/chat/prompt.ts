// A user's text as the model's chat template presents it for an answer (`flotilla generate --chat`):
// the conversation [user] rendered with the generation prompt and encoded with its special tokens as
// single ids, and the ids that end the assistant's turn, so sampling stops where a trained model
// ends its answer.
import { existsSync, statSync } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';
import type { Tokenizer } from '../tokenizer.js';
import { renderChat, type ChatTemplate } from './template.js';
import { specialsTokenizer, type SpecialsTokenizer } from './masks.js';

export interface ChatPrompt {
  ids: number[];
  /** Ids that end the reply: the tokenizer's end of text, the template's eos and its end-of-turn token. */
  stop: number[];
}

/** The added token the template writes right after an assistant's content (ChatML's <|im_end|>, Llama 3's <|eot_id|>). */
function endOfTurn(st: SpecialsTokenizer, t: ChatTemplate): number | undefined {
  const probe = 'flotilla-probe';
  const text = renderChat(t, [{ role: 'user', content: 'hi' }, { role: 'assistant', content: probe }]);
  const after = text.indexOf(probe);
  if (after < 0) return undefined;
  let best: { at: number; id: number } | undefined;
  for (const a of st.addedTokens) {
    const at = text.indexOf(a.content, after + probe.length);
    if (at >= 0 && (best === undefined || at < best.at)) best = { at, id: a.id };
  }
  return best?.id;
}

export function chatPrompt(tok: Tokenizer, t: ChatTemplate, user: string): ChatPrompt {
  const st = specialsTokenizer(tok);
  const ids = st.encodeWithOffsets(renderChat(t, [{ role: 'user', content: user }], { addGenerationPrompt: true })).ids;
  const stop = new Set<number>([st.eot]);
  if (t.eos) {
    const e = st.encodeWithOffsets(t.eos).ids;
    if (e.length === 1) stop.add(e[0]!);
  }
  const eot = endOfTurn(st, t);
  if (eot !== undefined) stop.add(eot);
  return { ids, stop: [...stop] };
}

/** The Hugging Face directory a tokenizer spec lives in (its tokenizer_config.json holds the chat template), if any. */
export function tokenizerDirOf(spec: string): string | undefined {
  const p = resolve(spec);
  if (existsSync(p) && statSync(p).isDirectory()) return p;
  if (basename(p) === 'tokenizer.json' && existsSync(join(dirname(p), 'tokenizer_config.json'))) return dirname(p);
  return undefined;
}
