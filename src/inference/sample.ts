// Choosing the next token from a row of logits: greedy at temperature 0, otherwise a draw from
// softmax(logits / temperature) over the k most likely tokens, then over the smallest set of them
// whose probability reaches topP (nucleus sampling). Ties go to the lower id, so a draw is a pure
// function of the logits and the uniform number u.

export interface SampleOptions {
  /** 0 = always the most likely token. */
  temperature: number;
  /** Keep the k most likely tokens (0 = all). */
  topK: number;
  /** Keep the most likely tokens whose probabilities sum to at least topP (1 = all). */
  topP: number;
}

/** The token drawn from `logits` under `o` with the uniform number u in [0, 1). */
export function sampleIndex(logits: ArrayLike<number>, o: SampleOptions, u: number): number {
  const n = logits.length;
  let best = 0;
  for (let i = 1; i < n; i++) if (logits[i]! > logits[best]!) best = i;
  if (o.temperature === 0) return best;
  let ids = Array.from({ length: n }, (_, i) => i).sort((a, b) => logits[b]! - logits[a]! || a - b);
  if (o.topK > 0 && o.topK < n) ids = ids.slice(0, o.topK);
  const m = logits[best]!;
  let w = ids.map((i) => Math.exp((logits[i]! - m) / o.temperature));
  let total = w.reduce((a, b) => a + b, 0);
  if (o.topP < 1) {
    let acc = 0, keep = 0;
    while (keep < w.length && acc < o.topP * total) acc += w[keep++]!;
    ids = ids.slice(0, Math.max(1, keep));
    w = w.slice(0, ids.length);
    total = w.reduce((a, b) => a + b, 0);
  }
  let acc = 0;
  for (let j = 0; j < ids.length; j++) {
    acc += w[j]! / total;
    if (u < acc) return ids[j]!;
  }
  return ids[ids.length - 1]!;
}
