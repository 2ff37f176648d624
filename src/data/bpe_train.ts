// Training a byte-level BPE (GPT-2's scheme) on a corpus, written as a Hugging Face tokenizer.json
// that loadTokenizer reads back (src/data/tokenizer.ts).
//
// Why here and not the `tokenizers` npm package: its Node binding installs and runs, but its
// `Tokenizer.train(files)` takes no trainer (no vocabulary size), so it cannot make the small
// vocabulary a small model wants. The algorithm is the textbook one: split text with GPT-2's
// pre-tokenizer regex, count the distinct words, then repeatedly merge the most frequent adjacent
// pair, updating pair counts only in the words that hold the merged pair (a lazy max-heap finds the
// next pair). Ties go to the smaller pair of ids, so training is deterministic.

/** GPT-2's pre-tokenizer: contractions, letters, digits, other symbols, whitespace runs. */
export const GPT2_SPLIT = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu;

const EOT_TOKEN = '<|endoftext|>';

/** GPT-2's printable stand-in for each byte (so merges are strings without spaces or controls). */
export function bytesToUnicode(): string[] {
  const keep: number[] = [];
  for (let b = 0x21; b <= 0x7e; b++) keep.push(b);
  for (let b = 0xa1; b <= 0xac; b++) keep.push(b);
  for (let b = 0xae; b <= 0xff; b++) keep.push(b);
  const out = new Array<string>(256);
  let n = 0;
  for (let b = 0; b < 256; b++) {
    out[b] = keep.includes(b) ? String.fromCharCode(b) : String.fromCharCode(256 + n++);
  }
  return out;
}

/** Word counts of a corpus under the GPT-2 split (feed texts one by one). */
export class WordCounter {
  readonly counts = new Map<string, number>();
  add(text: string): void {
    for (const m of text.matchAll(GPT2_SPLIT)) {
      const w = m[0];
      this.counts.set(w, (this.counts.get(w) ?? 0) + 1);
    }
  }
}

const SHIFT = 2 ** 20; // pair key = a * SHIFT + b; ids stay below 2^20

/** A max-heap of (count, key) with lazy deletion: stale entries are skipped when popped. */
class PairHeap {
  private counts: number[] = [];
  private keys: number[] = [];
  get size(): number {
    return this.counts.length;
  }
  private better(i: number, j: number): boolean {
    const ci = this.counts[i]!;
    const cj = this.counts[j]!;
    return ci > cj || (ci === cj && this.keys[i]! < this.keys[j]!);
  }
  private swap(i: number, j: number): void {
    [this.counts[i], this.counts[j]] = [this.counts[j]!, this.counts[i]!];
    [this.keys[i], this.keys[j]] = [this.keys[j]!, this.keys[i]!];
  }
  push(count: number, key: number): void {
    this.counts.push(count);
    this.keys.push(key);
    let i = this.counts.length - 1;
    while (i > 0) {
      const p = (i - 1) >> 1;
      if (!this.better(i, p)) break;
      this.swap(i, p);
      i = p;
    }
  }
  pop(): [number, number] | undefined {
    if (this.counts.length === 0) return undefined;
    const top: [number, number] = [this.counts[0]!, this.keys[0]!];
    const lastC = this.counts.pop()!;
    const lastK = this.keys.pop()!;
    if (this.counts.length > 0) {
      this.counts[0] = lastC;
      this.keys[0] = lastK;
      let i = 0;
      for (;;) {
        const l = 2 * i + 1;
        const r = l + 1;
        let m = i;
        if (l < this.counts.length && this.better(l, m)) m = l;
        if (r < this.counts.length && this.better(r, m)) m = r;
        if (m === i) break;
        this.swap(i, m);
        i = m;
      }
    }
    return top;
  }
}

export interface BpeTrainResult {
  /** The tokenizer.json object. */
  json: Record<string, unknown>;
  /** Merges learned (may be fewer than asked when the corpus runs out of pairs). */
  merges: number;
  vocabSize: number;
}

/**
 * Learns `vocabSize - 257` merges from word counts (256 byte tokens, the merges, then
 * <|endoftext|> as the last id) and returns a byte-level BPE tokenizer.json.
 */
export function trainBpe(counts: Map<string, number>, vocabSize: number, onMerge?: (done: number, total: number) => void): BpeTrainResult {
  if (!Number.isInteger(vocabSize) || vocabSize < 257 || vocabSize >= SHIFT) {
    throw new Error(`--vocab must be an integer in 257..${SHIFT - 1} (256 bytes + at least the end-of-text token), got ${vocabSize}`);
  }
  const words: number[][] = [];
  const freq: number[] = [];
  for (const [w, c] of counts) {
    words.push(Array.from(Buffer.from(w, 'utf8')));
    freq.push(c);
  }
  const pairCount = new Map<number, number>();
  const where = new Map<number, Set<number>>();
  const heap = new PairHeap();
  const addPairs = (wi: number, sign: 1 | -1, touched: Set<number>): void => {
    const w = words[wi]!;
    const f = freq[wi]! * sign;
    for (let i = 0; i + 1 < w.length; i++) {
      const key = w[i]! * SHIFT + w[i + 1]!;
      pairCount.set(key, (pairCount.get(key) ?? 0) + f);
      if (sign > 0) {
        let s = where.get(key);
        if (!s) where.set(key, (s = new Set()));
        s.add(wi);
      }
      touched.add(key);
    }
  };
  const initial = new Set<number>();
  for (let wi = 0; wi < words.length; wi++) addPairs(wi, 1, initial);
  for (const k of initial) heap.push(pairCount.get(k)!, k);

  // A merge whose string an earlier merge already made (e.g. "a"+"bc" after "ab"+"c") reuses its id.
  const byteChar = bytesToUnicode();
  const tokenStr: string[] = [...byteChar];
  const idOf = new Map<string, number>(tokenStr.map((t, i) => [t, i]));
  const target = vocabSize - 257;
  const mergeList: [number, number][] = [];
  while (tokenStr.length - 256 < target) {
    const top = heap.pop();
    if (!top) break;
    const [c, key] = top;
    if (pairCount.get(key) !== c || c <= 0) continue; // stale
    const a = Math.floor(key / SHIFT);
    const b = key % SHIFT;
    const str = tokenStr[a]! + tokenStr[b]!;
    let id = idOf.get(str);
    if (id === undefined) {
      id = tokenStr.length;
      tokenStr.push(str);
      idOf.set(str, id);
    }
    mergeList.push([a, b]);
    const touched = new Set<number>();
    for (const wi of where.get(key) ?? []) {
      const w = words[wi]!;
      addPairs(wi, -1, touched);
      const out: number[] = [];
      for (let i = 0; i < w.length; i++) {
        if (i + 1 < w.length && w[i] === a && w[i + 1] === b) {
          out.push(id);
          i++;
        } else {
          out.push(w[i]!);
        }
      }
      words[wi] = out;
      addPairs(wi, 1, touched);
    }
    where.delete(key);
    pairCount.delete(key);
    touched.delete(key);
    for (const k of touched) {
      const n = pairCount.get(k) ?? 0;
      if (n > 0) heap.push(n, k);
      else pairCount.delete(k);
    }
    onMerge?.(tokenStr.length - 256, target);
  }

  const vocab: Record<string, number> = {};
  tokenStr.forEach((t, i) => (vocab[t] = i));
  const eotId = tokenStr.length;
  vocab[EOT_TOKEN] = eotId;
  const byteLevel = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true };
  const json = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: [{ id: eotId, content: EOT_TOKEN, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }],
    normalizer: null,
    pre_tokenizer: byteLevel,
    post_processor: null,
    decoder: byteLevel,
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: false, byte_fallback: false, ignore_merges: false,
      vocab,
      merges: mergeList.map(([a, b]) => `${tokenStr[a]} ${tokenStr[b]}`),
    },
  };
  return { json, merges: mergeList.length, vocabSize: eotId + 1 };
}
