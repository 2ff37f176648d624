// Text generation for any causal language model that can decode with a key/value cache (the GPT,
// the Llama): the prompts are run once (prefill), then one token per step for every row at once
// ([Note: kv cache] in src/nn/kv_cache.ts). Prompts of different lengths share the batch,
// left-padded. Each row draws from its own seeded stream, so a prompt's continuation does not
// depend on the prompts beside it. Once the context is full the model's window slides one token
// per step, each step recomputed over the last contextLength tokens, exactly as without a cache.
import { type Tensor, noGrad, tensor, tidy } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import type { KVCache } from '../nn/kv_cache.js';
import { uniformStream } from '../data/sampler.js';
import { sampleIndex, type SampleOptions } from './sample.js';

/** A model generate() can drive. */
export interface CausalLM extends Module {
  /** A cache for `batch` rows of at most `maxLen` tokens, the first pad[b] of row b padding. */
  newCache(batch: number, maxLen: number, pad?: readonly number[]): KVCache;
  /** The logits (B, T, V) of the new tokens; the cache then holds them too. */
  decode(ids: Tensor, cache: KVCache): Tensor;
  /** Longest context the model takes. */
  readonly contextLength: number;
  /** The whole-context forward (the uncached path): logits (B, T, V), or { logits }. */
  forward(ids: Tensor): Tensor | { logits: Tensor };
}

export interface GenerateOptions extends Partial<SampleOptions> {
  /** Tokens to add to each prompt (fewer when a row reaches eosId). */
  maxNewTokens: number;
  /** A row stops after producing this id (kept as its last token). */
  eosId?: number;
  /** More ids that end a row, as eosId does (a chat template's end-of-turn token). */
  stopIds?: readonly number[];
  /** Seeds the draws (default 0); row r draws from stream r. */
  seed?: number;
  /** Use the key/value cache (default true); false recomputes the whole context for every token. */
  cache?: boolean;
}

/** The logits of the last position of a forward over ids (1, T): the uncached step. */
function lastLogits(model: CausalLM, ids: readonly number[]): number[] {
  return tidy(() => {
    const x = tensor(Float64Array.from(ids), { shape: [1, ids.length], dtype: 'int64' });
    const out = model.call(x) as Tensor | { logits: Tensor };
    const logits = 'logits' in out ? out.logits : out;
    return logits.narrow(1, ids.length - 1, 1).reshape(-1).toNumbers();
  });
}

/** Continues each prompt (token ids); returns the new tokens of each row. Row r draws from stream r of the seed. */
export function generate(model: CausalLM, prompts: readonly (readonly number[])[], opts: GenerateOptions): number[][] {
  const o: SampleOptions = { temperature: opts.temperature ?? 1, topK: opts.topK ?? 0, topP: opts.topP ?? 1 };
  if (prompts.length === 0) return [];
  for (const [r, p] of prompts.entries()) if (p.length === 0) throw new Error(`generate: prompt ${r} is empty; give at least one token`);
  if (!(opts.maxNewTokens >= 0) || !Number.isInteger(opts.maxNewTokens)) throw new Error(`generate: maxNewTokens must be a whole number >= 0, got ${opts.maxNewTokens}`);
  if (!(o.temperature >= 0) || !(o.topP > 0 && o.topP <= 1) || !(o.topK >= 0)) throw new Error('generate: temperature >= 0, 0 < topP <= 1 and topK >= 0 are needed');
  const draws = prompts.map((_, r) => uniformStream(opts.seed ?? 0, r, opts.maxNewTokens));
  const ctx = model.contextLength;
  const rows = prompts.map((p) => p.slice(-ctx)); // what fits in the context, as the window would see it
  const out: number[][] = prompts.map(() => []);
  const done = prompts.map(() => opts.maxNewTokens === 0);
  const stops = new Set([...(opts.eosId !== undefined ? [opts.eosId] : []), ...(opts.stopIds ?? [])]);
  const take = (r: number, logits: ArrayLike<number>, step: number): number => {
    const t = sampleIndex(logits, o, draws[r]![step]!);
    out[r]!.push(t);
    if (stops.has(t) || out[r]!.length >= opts.maxNewTokens) done[r] = true;
    return t;
  };
  const wasTraining = model.training;
  model.eval();
  try {
    noGrad(() => {
      if (opts.cache === false) {
        for (const [r, p] of prompts.entries()) {
          for (let s = 0; !done[r]; s++) take(r, lastLogits(model, [...p, ...out[r]!].slice(-ctx)), s);
        }
        return;
      }
      const B = rows.length;
      const L = Math.max(...rows.map((p) => p.length));
      const pad = rows.map((p) => L - p.length);
      const cache = model.newCache(B, Math.min(ctx, L + opts.maxNewTokens), pad);
      try {
        // Prefill: every prompt at once, left-padded (padding keys are masked, positions start at each row's first token).
        const ids = Float64Array.from(rows.flatMap((p, r) => [...Array<number>(pad[r]!).fill(0), ...p]));
        let next = tidy(() => {
          const logits = model.decode(tensor(ids, { shape: [B, L], dtype: 'int64' }), cache);
          return rows.map((_, r) => (done[r] ? 0 : take(r, logits.select(0, r).select(0, L - 1).toNumbers(), 0)));
        });
        for (let s = 1; !done.every(Boolean); s++) {
          if (cache.length + 1 > cache.maxLen) {
            // The context is full: slide the window a token per step, as without a cache.
            for (const [r, p] of prompts.entries()) {
              for (let t = s; !done[r]; t++) take(r, lastLogits(model, [...p, ...out[r]!].slice(-ctx)), t);
            }
            break;
          }
          const step = s;
          next = tidy(() => {
            const logits = model.decode(tensor(Float64Array.from(next), { shape: [B, 1], dtype: 'int64' }), cache); // (B, 1, V)
            return rows.map((_, r) => (done[r] ? 0 : take(r, logits.select(0, r).select(0, 0).toNumbers(), step)));
          });
        }
      } finally {
        cache.dispose();
      }
    });
  } finally {
    if (wasTraining) model.train();
  }
  return out;
}
