// `flotilla prepare SOURCES... --tokenizer T --out DIR`: tokenizes text files, directories of them,
// .jsonl and parquet into shards of token ids with document indexes and a manifest (format in
// src/data/prepared.ts), over a pool of worker threads.
//
// Inputs are cut into units (a group of text files, a line range of a .jsonl, row groups of a
// parquet file) of about `shardMb` of input each; a unit becomes one shard. A unit's key hashes its
// inputs (path, size, mtime, range), the tokenizer and the field, so a re-run skips shards already
// made from the same inputs. Every check a user can fail without tokenizing (missing or empty
// sources, a parquet file without the field, an --out that holds another dataset) runs before
// anything is written.
//
// --format chat|completion|preference reads .jsonl examples (src/data/chat) into version 2 shards
// that carry a loss mask; the unit key then also hashes the format, the template's identity, the
// trained turns (chat), the bos/eos and --strict/--skip-bad, so a change to any prepares again.
import { createHash } from 'node:crypto';
import { closeSync, existsSync, mkdirSync, openSync, readdirSync, readFileSync, readSync, rmSync, statSync } from 'node:fs';
import { availableParallelism } from 'node:os';
import { extname, join, resolve } from 'node:path';
import type { Worker } from 'node:worker_threads';
import { loadTokenizer, type Tokenizer } from './tokenizer.js';
import type { TokenDtype } from './corpus_files.js';
import { FORMAT, FORMAT_VERSION, MANIFEST, TEXT_FORMAT_VERSION, maskBytes, readManifest, shardName, type Manifest, type ShardRecord, type TemplateRecord } from './prepared.js';
import { processUnit, removeTemps, SKIP_NO_ASSISTANT, type ExampleContext, type Unit, type UnitContext, type UnitJob } from './prepare_unit.js';
import { loadChatTemplate, singleId, tokenizerDirOf, specialsTokenizer, tokenizerSpecials, type ChatTemplate, type ExampleFormat, type TrainOn } from './chat/index.js';
import { fsyncDir, writeDurable } from '../io/durable.js';
import { siblingUrl, startWorker } from './workers.js';

export interface PrepareOptions {
  sources: string[];
  tokenizer: string;
  out: string;
  /** The jsonl/parquet field holding the text (default "text"). */
  field?: string;
  /** Worker threads (default: the machine's cores). 0 tokenizes in this thread. */
  workers?: number;
  /** Count and skip jsonl lines that are not JSON or lack the field, instead of stopping. */
  skipBad?: boolean;
  /** How a bad example line's error ends, when the --skip-bad of `flotilla prepare` is not the caller's to give (a run's .jsonl source). */
  badLineHint?: string;
  /** Input megabytes per shard (default 64). */
  shardMb?: number;
  /** Progress: a bar on a terminal, else a line per 10% (default), or nothing. */
  progress?: boolean;
  print?: (line: string) => void;
  /** "text" (default), or .jsonl examples: "chat", "completion", "preference" (version 2 shards with a loss mask). */
  format?: 'text' | ExampleFormat;
  /** The chat template: "model" (the --tokenizer directory's), "chatml" or a .jinja path; "" = "model" when the tokenizer is a directory. */
  chatTemplate?: string;
  /** Chat: the trained turns (default "assistant"). */
  trainOn?: TrainOn;
  /** Chat: a conversation with no assistant turn is an error (default: counted and skipped). */
  strict?: boolean;
}

export interface PrepareResult {
  manifest: Manifest;
  /** Shards made by this run, and reused from an earlier (interrupted) one. */
  made: number;
  reused: number;
  bytes: number;
  seconds: number;
}

/** An input a user can fix: one message naming the file; nothing has been written. */
export class PrepareError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'PrepareError';
  }
}

const TEXT_EXT = new Set(['.txt', '.text', '.md']);

interface InputFile {
  path: string;
  kind: 'text' | 'jsonl' | 'parquet';
  size: number;
  mtimeMs: number;
}

function kindOf(path: string): InputFile['kind'] {
  const e = extname(path).toLowerCase();
  return e === '.jsonl' ? 'jsonl' : e === '.parquet' ? 'parquet' : 'text';
}

function walk(dir: string, out: string[]): void {
  for (const name of readdirSync(dir).sort()) {
    if (name.startsWith('.')) continue;
    const p = join(dir, name);
    const st = statSync(p);
    if (st.isDirectory()) walk(p, out);
    else if (st.isFile() && (TEXT_EXT.has(extname(name).toLowerCase()) || kindOf(name) !== 'text')) out.push(p);
  }
}

/** The files SOURCES name, in a stable order; missing and empty sources are errors. */
export function listInputs(sources: string[]): InputFile[] {
  if (sources.length === 0) throw new PrepareError('prepare: no sources given; usage: flotilla prepare SOURCES... --tokenizer T --out DIR');
  const files: InputFile[] = [];
  const seen = new Set<string>();
  for (const s of sources) {
    const p = resolve(s);
    if (!existsSync(p)) throw new PrepareError(`prepare: source ${p} does not exist`);
    const st = statSync(p);
    const paths: string[] = [];
    if (st.isDirectory()) {
      walk(p, paths);
      if (paths.length === 0) throw new PrepareError(`prepare: source directory ${p} holds no .txt, .md, .text, .jsonl or .parquet file (an empty source)`);
    } else {
      paths.push(p);
    }
    for (const f of paths) {
      if (seen.has(f)) continue;
      seen.add(f);
      const fs = statSync(f);
      if (fs.size === 0) throw new PrepareError(`prepare: source ${f} is empty; remove it from the sources`);
      files.push({ path: f, kind: kindOf(f), size: fs.size, mtimeMs: fs.mtimeMs });
    }
  }
  return files;
}

/** Cuts a .jsonl file at line starts into ranges of about `target` bytes (counting lines). */
function jsonlUnits(f: InputFile, target: number): Unit[] {
  const units: Unit[] = [];
  const fd = openSync(f.path, 'r');
  let start = 0;
  let line = 1;
  try {
    const buf = Buffer.allocUnsafe(4 << 20);
    let pos = 0;
    let linesInUnit = 0;
    for (;;) {
      const n = readSync(fd, buf, 0, buf.length, pos);
      if (n === 0) break;
      let from = 0;
      for (;;) {
        const nl = buf.indexOf(10, from);
        if (nl < 0 || nl >= n) break;
        linesInUnit++;
        from = nl + 1;
        const end = pos + from;
        if (end - start >= target && end < f.size) {
          units.push({ kind: 'jsonl', file: f.path, start, end, firstLine: line, bytes: end - start });
          start = end;
          line += linesInUnit;
          linesInUnit = 0;
        }
      }
      pos += n;
    }
  } finally {
    closeSync(fd);
  }
  units.push({ kind: 'jsonl', file: f.path, start, end: f.size, firstLine: line, bytes: f.size - start });
  return units;
}

/** Row groups of a parquet file grouped into units of about `target` compressed bytes; checks the field. */
async function parquetUnits(f: InputFile, field: string, target: number): Promise<Unit[]> {
  const { asyncBufferFromFile, parquetMetadataAsync, parquetSchema } = await import('hyparquet');
  let meta;
  try {
    meta = await parquetMetadataAsync(await asyncBufferFromFile(f.path));
  } catch (e) {
    throw new PrepareError(`prepare: ${f.path} is not a readable parquet file (${(e as Error).message})`);
  }
  const columns = parquetSchema(meta).children.map((c) => c.element.name);
  if (!columns.includes(field)) {
    throw new PrepareError(`prepare: parquet file ${f.path} has no column ${JSON.stringify(field)} (columns: ${columns.join(', ')}); pass --field NAME`);
  }
  if (Number(meta.num_rows) === 0) throw new PrepareError(`prepare: parquet file ${f.path} has no rows (an empty source); remove it from the sources`);
  const units: Unit[] = [];
  let rowStart = 0;
  let row = 0;
  let bytes = 0;
  for (const rg of meta.row_groups) {
    row += Number(rg.num_rows);
    bytes += Number(rg.total_compressed_size ?? rg.total_byte_size);
    if (bytes >= target) {
      units.push({ kind: 'parquet', file: f.path, rowStart, rowEnd: row, bytes });
      rowStart = row;
      bytes = 0;
    }
  }
  if (row > rowStart) units.push({ kind: 'parquet', file: f.path, rowStart, rowEnd: row, bytes });
  return units;
}

/** Units in input order: runs of text files up to `target` bytes, jsonl line ranges, parquet row groups. */
async function planUnits(files: InputFile[], field: string, target: number): Promise<Unit[]> {
  const units: Unit[] = [];
  let text: Extract<Unit, { kind: 'text' }> | undefined;
  for (const f of files) {
    if (f.kind === 'text') {
      if (!text || text.bytes >= target) units.push((text = { kind: 'text', files: [], bytes: 0 }));
      text.files.push(f.path);
      text.bytes += f.size;
      continue;
    }
    text = undefined;
    units.push(...(f.kind === 'jsonl' ? jsonlUnits(f, target) : await parquetUnits(f, field, target)));
  }
  return units;
}

/** What an example unit's key adds to a text one: everything that decides its ids and mask. */
interface ExampleKey {
  format: ExampleFormat;
  template?: string;
  trainOn?: TrainOn;
  bos?: string;
  eos?: string;
  strict: boolean;
  skipBad: boolean;
}

function unitKey(u: Unit, files: Map<string, InputFile>, tok: Tokenizer, dtype: TokenDtype, field: string, example?: ExampleKey): string {
  const stamp = (p: string) => {
    const f = files.get(p)!;
    return [p, f.size, f.mtimeMs];
  };
  const inputs = u.kind === 'text' ? u.files.map(stamp) : [stamp(u.file)];
  const range = u.kind === 'jsonl' ? [u.start, u.end, u.firstLine] : u.kind === 'parquet' ? [u.rowStart, u.rowEnd] : [];
  const v = example ? FORMAT_VERSION : TEXT_FORMAT_VERSION;
  return createHash('sha256').update(JSON.stringify({ v, tok: tok.identity, dtype, field: u.kind === 'text' ? '' : field, kind: u.kind, inputs, range, ...(example ? { example } : {}) })).digest('hex');
}

/** A shard of an earlier run that can be kept: its done file names the same key and its files are whole. */
function reusable(stem: string, key: string, width: number): ShardRecord | undefined {
  const done = `${stem}.done.json`;
  if (!existsSync(done)) return undefined;
  try {
    const r = JSON.parse(readFileSync(done, 'utf8')) as ShardRecord;
    if (r.key !== key) return undefined;
    if (statSync(`${stem}.bin`).size !== r.tokens * width || statSync(`${stem}.idx`).size !== (r.documents + 1) * 8) return undefined;
    if (r.mask !== undefined && statSync(`${stem}.mask`).size !== maskBytes(r.tokens)) return undefined;
    return r;
  } catch {
    return undefined;
  }
}

class ProgressLine {
  private bar: { start(total: number, v: number): void; update(v: number): void; stop(): void } | undefined;
  private done = 0;
  private lastTenth = 0;
  constructor(private readonly total: number, enabled: boolean, private readonly print: (l: string) => void) {
    if (!enabled) this.print = () => {};
  }
  async init(enabled: boolean): Promise<void> {
    if (!enabled || !process.stderr.isTTY) return;
    const cp = (await import('cli-progress')).default;
    this.bar = new cp.SingleBar({
      format: 'prepare [{bar}] {percentage}% | {value}/{total} MB | {speed} MB/s | eta {eta_formatted}',
      stream: process.stderr, hideCursor: true,
    }, cp.Presets.shades_classic);
    this.bar.start(Math.max(1, Math.round(this.total / 1e6)), 0);
  }
  add(bytes: number, seconds: number): void {
    this.done += bytes;
    const mb = this.done / 1e6;
    if (this.bar) {
      (this.bar as unknown as { update(v: number, p: object): void }).update(Math.round(mb), { speed: (mb / Math.max(seconds, 1e-3)).toFixed(1) });
      return;
    }
    const tenth = Math.floor((10 * this.done) / Math.max(1, this.total));
    if (tenth > this.lastTenth && tenth < 10) {
      this.lastTenth = tenth;
      this.print(`prepare: ${tenth * 10}% (${mb.toFixed(1)} MB, ${(mb / Math.max(seconds, 1e-3)).toFixed(1)} MB/s)`);
    }
  }
  stop(): void {
    this.bar?.stop();
  }
}

/** A shard's files, removed when the run that made them fails. */
const SHARD_FILES = ['.bin', '.idx', '.mask', '.done.json'];

/** An example format's settings, checked before anything is written: the tokenizer can render, the template loads, bos/eos are single ids. */
function exampleSetup(o: PrepareOptions, format: ExampleFormat, tok: Tokenizer): { ctx: ExampleContext; key: ExampleKey; template?: TemplateRecord } {
  const fail = (m: string): PrepareError => new PrepareError(`prepare: ${m}`);
  let st;
  try {
    st = specialsTokenizer(tok);
    st.encodeWithOffsets('a');
  } catch (e) {
    throw fail(`--format ${format} needs a tokenizer with added special tokens and byte offsets: ${(e as Error).message}`);
  }
  const dir = tokenizerDirOf(tok.spec);
  const trainOn = o.trainOn ?? 'assistant';
  const asked = o.chatTemplate ?? '';
  let t: ChatTemplate | undefined;
  if (format !== 'completion') {
    const spec = asked !== '' ? asked : dir !== undefined ? 'model' : '';
    if (spec === '' && format === 'chat') {
      throw fail('--format chat needs a chat template: pass --chat-template chatml or --chat-template FILE.jinja, or give --tokenizer the model\'s Hugging Face directory (its tokenizer_config.json holds the template)');
    }
    if (spec !== '') {
      try {
        t = loadChatTemplate(spec === 'model' || spec === 'chatml' ? spec : resolve(spec), dir !== undefined ? { tokenizerDir: dir } : {});
      } catch (e) {
        // Preference data with string prompts needs no template: a directory without one is fine until a line needs it.
        if (!(format === 'preference' && asked === '')) throw fail(`--chat-template ${spec}: ${(e as Error).message}`);
      }
    }
  }
  let bos: string | undefined;
  let eos: string | undefined;
  if (format === 'completion' && dir !== undefined) {
    const sp = tokenizerSpecials(dir);
    if (sp.addBos) bos = sp.bos;
    eos = sp.eos;
  }
  for (const [what, v] of [['bos token', bos], ['eos token', eos], ['template\'s eos token', format === 'preference' ? t?.eos : undefined]] as const) {
    if (!v) continue;
    try {
      singleId(st, v, what);
    } catch (e) {
      throw fail((e as Error).message);
    }
  }
  const strict = o.strict ?? false;
  const ctx: ExampleContext = {
    format, trainOn, strict,
    ...(t ? { template: t.source } : {}), ...(dir !== undefined ? { tokenizerDir: dir } : {}), ...(bos ? { bos } : {}), ...(eos ? { eos } : {}),
  };
  const key: ExampleKey = { format, ...(t ? { template: t.identity } : {}), ...(format === 'chat' ? { trainOn } : {}), ...(bos ? { bos } : {}), ...(eos ? { eos } : {}), strict, skipBad: o.skipBad ?? false };
  // Preference data trains the final assistant turn (or the response) whatever trainOn says.
  const template: TemplateRecord | undefined = t ? { source: t.source, identity: t.identity, trainOn: format === 'chat' ? trainOn : 'last' } : undefined;
  return { ctx, key, ...(template ? { template } : {}) };
}

/** Runs `flotilla prepare`. Throws PrepareError for inputs a user can fix. */
export async function prepare(o: PrepareOptions): Promise<PrepareResult> {
  const t0 = performance.now();
  const print = o.print ?? ((l: string) => process.stderr.write(`${l}\n`));
  const field = o.field ?? 'text';
  const out = resolve(o.out);
  const tok = await loadTokenizer(o.tokenizer).catch((e: Error) => {
    throw new PrepareError(`prepare: ${e.message}`);
  });
  const dtype: TokenDtype = tok.vocabSize <= 65536 ? 'uint16' : 'uint32';
  const width = dtype === 'uint16' ? 2 : 4;
  const format = o.format ?? 'text';
  const example = format === 'text' ? undefined : exampleSetup(o, format, tok);
  const files = listInputs(o.sources);
  if (example) {
    const other = files.find((f) => f.kind !== 'jsonl');
    if (other) throw new PrepareError(`prepare: --format ${format} reads .jsonl files (one JSON example a line); ${other.path} is not one`);
  }
  const byPath = new Map(files.map((f) => [f.path, f]));
  const units = await planUnits(files, field, Math.max(1, Math.round((o.shardMb ?? 64) * 1e6)));
  const jobs: UnitJob[] = units.map((unit, index) => ({ index, unit, key: unitKey(unit, byPath, tok, dtype, field, example?.key), stem: join(out, shardName(index)) }));
  const datasetKey = createHash('sha256').update(jobs.map((j) => j.key).join('\n')).update(o.skipBad ? 'skip-bad' : '').digest('hex');

  // An --out holding another dataset is refused; the same one is done already.
  const outExisted = existsSync(out);
  if (outExisted) {
    if (!statSync(out).isDirectory()) throw new PrepareError(`prepare: --out ${out} exists and is not a directory; choose another --out`);
    if (existsSync(join(out, MANIFEST))) {
      let old: Manifest;
      try {
        old = readManifest(out);
      } catch (e) {
        throw new PrepareError(`prepare: --out ${out}: ${(e as Error).message}`);
      }
      if (old.key === datasetKey) {
        print(`prepare: ${out} is up to date (${old.shards.length} shard(s), ${old.tokens.toLocaleString('en-US')} tokens); nothing to do`);
        return { manifest: old, made: 0, reused: old.shards.length, bytes: 0, seconds: (performance.now() - t0) / 1000 };
      }
      throw new PrepareError(
        `prepare: --out ${out} already holds a prepared dataset made from other inputs or with another tokenizer (${old.tokenizer.spec}); ` +
          'choose another --out, or delete it to prepare again',
      );
    }
  }
  mkdirSync(out, { recursive: true });

  const records: (ShardRecord | undefined)[] = jobs.map((j) => {
    removeTemps(j.stem);
    return reusable(j.stem, j.key, width);
  });
  const todo = jobs.filter((_, i) => records[i] === undefined);
  const totalBytes = todo.reduce((a, j) => a + j.unit.bytes, 0);
  const nWorkers = Math.min(o.workers ?? availableParallelism(), todo.length);
  const reused = jobs.length - todo.length;
  print(
    `prepare: ${files.length} file(s), ${(files.reduce((a, f) => a + f.size, 0) / 1e6).toFixed(1)} MB -> ${jobs.length} shard(s) in ${out}` +
      (reused > 0 ? ` (${reused} already done)` : '') + `; tokenizer ${tok.name} (vocabulary ${tok.vocabSize}, ${dtype}), ${Math.max(nWorkers, 1)} worker(s)`,
  );
  const progress = new ProgressLine(totalBytes, o.progress ?? true, print);
  await progress.init(o.progress ?? true);
  const ctx: UnitContext = { tokenizer: tok.spec, dtype, field, skipBad: o.skipBad ?? false, ...(o.badLineHint !== undefined ? { badLineHint: o.badLineHint } : {}), ...(example ? { example: example.ctx } : {}) };
  const made: number[] = [];
  try {
    if (nWorkers <= 0) {
      for (const j of todo) {
        records[j.index] = await processUnit(j, ctx, (b) => progress.add(b, (performance.now() - t0) / 1000));
        made.push(j.index);
      }
    } else {
      await runPool(nWorkers, todo, ctx, (bytes) => progress.add(bytes, (performance.now() - t0) / 1000), (index, rec) => {
        records[index] = rec;
        made.push(index);
      });
    }
  } catch (e) {
    progress.stop();
    // This run's own shards go, and the directory if this run made it: an error changes nothing.
    for (const i of made) for (const ext of SHARD_FILES) rmSync(`${jobs[i]!.stem}${ext}`, { force: true });
    for (const j of jobs) removeTemps(j.stem);
    if (!outExisted) rmSync(out, { recursive: true, force: true });
    const err = e as Error;
    throw err.name === 'BadInputError' ? new PrepareError(`prepare: ${err.message}`) : err;
  }
  progress.stop();

  const shards = records as ShardRecord[];
  // A source that yields no document at all (e.g. a jsonl file of blank lines) is an empty source.
  const docsPerFile = new Map<string, number>();
  for (const s of shards) for (const f of s.inputs) docsPerFile.set(f, (docsPerFile.get(f) ?? 0) + s.documents);
  for (const f of files) {
    if (f.kind !== 'text' && (docsPerFile.get(f.path) ?? 0) === 0) {
      for (const i of made) for (const ext of SHARD_FILES) rmSync(`${jobs[i]!.stem}${ext}`, { force: true });
      if (!outExisted) rmSync(out, { recursive: true, force: true });
      const why = example ? ', or every line was skipped (no assistant turn, or bad with --skip-bad)' : o.skipBad ? ', or every line was skipped as bad' : '';
      throw new PrepareError(`prepare: source ${f.path} has no documents (an empty source${why}); remove it from the sources`);
    }
  }
  const skippedWhy: Record<string, number> = {};
  for (const sh of shards) for (const [k, n] of Object.entries(sh.skippedWhy ?? {})) skippedWhy[k] = (skippedWhy[k] ?? 0) + n;
  const documents = shards.reduce((a, sh) => a + sh.documents, 0);
  const manifest: Manifest = {
    format: FORMAT, version: example ? FORMAT_VERSION : TEXT_FORMAT_VERSION,
    tokenizer: { spec: tok.spec, name: tok.name, vocabSize: tok.vocabSize, eot: tok.eot, identity: tok.identity },
    dtype,
    tokens: shards.reduce((a, s) => a + s.tokens, 0),
    documents,
    skipped: shards.reduce((a, s) => a + s.skipped, 0),
    key: datasetKey, field: example ? '' : field, sources: o.sources.map((s) => resolve(s)), shards,
    created: new Date().toISOString(),
    ...(example ? {
      kind: example.ctx.format,
      ...(example.template ? { template: example.template } : {}),
      examples: example.ctx.format === 'preference' ? documents / 2 : documents,
      skippedWhy,
    } : {}),
  };
  writeDurable(join(out, MANIFEST), `${JSON.stringify(manifest, null, 1)}\n`);
  fsyncDir(out);
  const seconds = (performance.now() - t0) / 1000;
  print(
    `prepare: ${manifest.tokens.toLocaleString('en-US')} tokens in ${manifest.documents.toLocaleString('en-US')} document(s), ${shards.length} shard(s)` +
      (example ? ` (${manifest.examples!.toLocaleString('en-US')} ${example.ctx.format === 'preference' ? 'pair(s)' : 'example(s)'})` : '') +
      (manifest.skipped > 0 ? `, ${manifest.skipped} bad line(s)/row(s) skipped` : '') +
      ((skippedWhy[SKIP_NO_ASSISTANT] ?? 0) > 0 ? `, ${skippedWhy[SKIP_NO_ASSISTANT]} conversation(s) without an assistant turn skipped (--strict makes that an error)` : '') +
      `; ${(totalBytes / 1e6 / seconds).toFixed(2)} MB/s; manifest ${join(out, MANIFEST)}`,
  );
  return { manifest, made: made.length, reused, bytes: totalBytes, seconds };
}

/** Runs jobs on `n` worker threads, each taking the next job when it finishes one; stops at the first error. */
function runPool(n: number, jobs: UnitJob[], ctx: UnitContext, onBytes: (b: number) => void, onDone: (index: number, rec: ShardRecord) => void): Promise<void> {
  return new Promise((resolvePool, rejectPool) => {
    const workers: Worker[] = [];
    const finished = new Set<Worker>(); // terminated by us: their exit is expected
    let next = 0;
    let running = 0;
    let failed = false;
    const stopAll = (): void => {
      for (const w of workers) void w.terminate();
    };
    const fail = (e: Error): void => {
      if (failed) return;
      failed = true;
      stopAll();
      rejectPool(e);
    };
    const feed = (w: Worker): void => {
      if (failed) return;
      if (next >= jobs.length) {
        finished.add(w);
        void w.terminate();
        if (running === 0) resolvePool();
        return;
      }
      running++;
      w.postMessage(jobs[next++]!);
    };
    for (let i = 0; i < n; i++) {
      const started = startWorker(siblingUrl('prepare_worker'), { workerData: ctx });
      const w = started.worker;
      workers.push(w);
      // A worker that cannot start, or that dies mid-shard, fails the command instead of leaving it waiting.
      w.on('exit', (code) => {
        if (!finished.has(w)) fail(new Error(`prepare: ${started.problem() ?? `a worker thread exited with code ${code} before finishing its shards`}`));
      });
      w.on('error', (e) => {
        const why = started.problem();
        fail(why !== undefined ? new Error(`prepare: ${why}`) : e);
      });
      w.on('message', (m: { type: string; bytes?: number; index?: number; record?: ShardRecord; message?: string; bad?: boolean }) => {
        if (m.type === 'progress') onBytes(m.bytes!);
        else if (m.type === 'done') {
          running--;
          onBytes(m.bytes!);
          onDone(m.index!, m.record!);
          feed(w);
        } else if (m.type === 'error') {
          running--;
          if (failed) return;
          failed = true;
          stopAll();
          const e = new Error(m.message);
          if (m.bad) e.name = 'BadInputError';
          // Let terminated workers settle so their temp files are not written after the cleanup.
          void Promise.all(workers.map((x) => x.terminate())).then(() => rejectPool(e));
        }
      });
      feed(w);
    }
  });
}
