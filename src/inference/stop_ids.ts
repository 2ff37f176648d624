// The ids a model family ends a reply with, as its Hugging Face directory records them:
// config.json's and generation_config.json's eos_token_id, an id or a list of them (Llama 3's
// instruct models end a turn with <|eot_id|> and text with <|end_of_text|>; Qwen's with
// <|im_end|> and <|endoftext|>). Sampling stops at any of them.
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';

export const HF_GENERATION_CONFIG = 'generation_config.json';

/** eos_token_id of one JSON file: its ids, none when absent; a malformed value is an error naming the file. */
function eosOf(path: string): number[] {
  if (!existsSync(path)) return [];
  let j: unknown;
  try {
    j = JSON.parse(readFileSync(path, 'utf8'));
  } catch (e) {
    throw new Error(`${path} is not valid JSON (${(e as Error).message})`);
  }
  const v = (j as { eos_token_id?: unknown } | null)?.eos_token_id;
  if (v === undefined || v === null) return [];
  const ids = Array.isArray(v) ? v : [v];
  if (!ids.every((x) => Number.isInteger(x) && (x as number) >= 0)) throw new Error(`${path}: eos_token_id = ${JSON.stringify(v)} is not a token id or a list of token ids`);
  return ids as number[];
}

/** Every end id the directories record (config.json and generation_config.json of each), in order, once each. */
export function modelEosIds(dirs: readonly (string | undefined)[]): number[] {
  const out: number[] = [];
  for (const d of dirs) {
    if (d === undefined) continue;
    for (const f of ['config.json', HF_GENERATION_CONFIG]) for (const id of eosOf(join(d, f))) if (!out.includes(id)) out.push(id);
  }
  return out;
}
