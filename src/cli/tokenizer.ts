// `flotilla tokenizer train --vocab N FILES... --out tokenizer.json`: a byte-level BPE learned from
// text files, directories of them, .jsonl files (--field) or "moby-dick" (src/data/bpe_train.ts).
import { existsSync, readFileSync, statSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { UsageError } from './usage.js';

const TOKENIZER_USAGE = 'flotilla tokenizer train --vocab N FILES... --out tokenizer.json [--field text]';

export async function tokenizerCommand(args: readonly string[]): Promise<number> {
  const [sub, ...rest] = args;
  if (sub !== 'train') throw new UsageError(`tokenizer: unknown subcommand ${JSON.stringify(sub ?? '')}; usage: ${TOKENIZER_USAGE}`);
  const files: string[] = [];
  const vals: Record<string, string> = {};
  for (let i = 0; i < rest.length; i++) {
    const a = rest[i]!;
    const m = /^--(vocab|out|field)(?:=(.*))?$/s.exec(a);
    if (m) {
      const v = m[2] ?? rest[++i];
      if (v === undefined || v === '') throw new UsageError(`tokenizer train: --${m[1]} needs a value; usage: ${TOKENIZER_USAGE}`);
      vals[m[1]!] = v;
    } else if (a.startsWith('-')) throw new UsageError(`tokenizer train: unknown option ${a}; usage: ${TOKENIZER_USAGE}`);
    else files.push(a);
  }
  const vocab = Number(vals.vocab);
  if (vals.vocab === undefined || !Number.isInteger(vocab) || vocab < 257) throw new UsageError(`tokenizer train: --vocab N needs an integer >= 257 (256 bytes + end-of-text), got ${JSON.stringify(vals.vocab ?? 'nothing')}`);
  if (vals.out === undefined) throw new UsageError(`tokenizer train: --out tokenizer.json is required; usage: ${TOKENIZER_USAGE}`);
  if (files.length === 0) throw new UsageError(`tokenizer train: no FILES given; usage: ${TOKENIZER_USAGE}`);
  const out = resolve(vals.out);
  if (existsSync(out)) throw new UsageError(`tokenizer train: ${out} already exists; choose another --out or delete it`);
  if (!existsSync(dirname(out)) || !statSync(dirname(out)).isDirectory()) throw new UsageError(`tokenizer train: the directory of --out ${out} does not exist`);
  const { WordCounter, trainBpe } = await import('../data/bpe_train.js');
  const { listInputs, PrepareError } = await import('../data/prepare.js');
  const { loadMobyDick } = await import('../data/corpus.js');
  const { writeDurable } = await import('../io/durable.js');
  const field = vals.field ?? 'text';
  const counter = new WordCounter();
  let bytes = 0;
  const t0 = performance.now();
  const paths = files.filter((f) => f !== 'moby-dick');
  if (files.includes('moby-dick')) {
    const t = loadMobyDick();
    bytes += Buffer.byteLength(t);
    counter.add(t);
  }
  let inputs: ReturnType<typeof listInputs> = [];
  try {
    if (paths.length > 0) inputs = listInputs(paths);
  } catch (e) {
    if (e instanceof PrepareError) throw new UsageError(e.message.replace(/^prepare:/, 'tokenizer train:'));
    throw e;
  }
  for (const f of inputs) {
    if (f.kind === 'parquet') throw new UsageError(`tokenizer train: ${f.path}: parquet is not read here; prepare text or .jsonl files`);
    const text = readFileSync(f.path, 'utf8');
    bytes += f.size;
    if (f.kind === 'text') {
      counter.add(text);
      continue;
    }
    text.split('\n').forEach((line, i) => {
      if (line.trim() === '') return;
      let v: unknown;
      try {
        v = (JSON.parse(line) as Record<string, unknown>)[field];
      } catch (e) {
        throw new UsageError(`tokenizer train: ${f.path}:${i + 1}: line ${i + 1} is not JSON (${(e as Error).message})`);
      }
      if (typeof v !== 'string') throw new UsageError(`tokenizer train: ${f.path}:${i + 1}: line ${i + 1} has no string field ${JSON.stringify(field)}; pass --field NAME`);
      counter.add(v);
    });
  }
  const r = trainBpe(counter.counts, vocab);
  writeDurable(out, `${JSON.stringify(r.json)}\n`);
  process.stdout.write(
    `tokenizer: ${r.vocabSize} ids (256 bytes, ${r.vocabSize - 257} merges, <|endoftext|> = ${r.vocabSize - 1}) from ${(bytes / 1e6).toFixed(2)} MB ` +
      `(${counter.counts.size.toLocaleString('en-US')} distinct words) in ${((performance.now() - t0) / 1000).toFixed(1)} s -> ${out}\n`,
  );
  if (r.vocabSize < vocab) process.stdout.write(`tokenizer: the corpus ran out of pairs to merge before --vocab ${vocab}\n`);
  return 0;
}
