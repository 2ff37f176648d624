// Example data a run's config names ([data] format = chat | completion | preference): the checks
// that run before any rank starts, and a .jsonl source prepared into the cache.
//
// [Note: example sources] The loader reads examples only from prepared directories (version 2,
// src/data/prepared.ts). When data.source, an entry of data.sources or data.valSource is a .jsonl
// file, `flotilla train` prepares it before starting any rank (prepareExampleSources, from the
// launching process) into CACHE/prepared/<key>, CACHE being FLOTILLA_CACHE_DIR or
// ~/.cache/flotilla (src/io/cache_dir.ts). The key hashes the file (path, size, mtime), the
// tokenizer's identity, the format, the template's identity and, for chat, data.trainOn: the same
// inputs name the same directory, so an interrupted prepare resumes from its finished shards, a
// finished one is reused as it is, and a changed file, template or trainOn prepares a new one.
// Then every rank (trainHere, src/cli/train_run.ts) rewrites those paths in its config to the
// prepared directories (resolveExampleSources) before anything reads them, so the rest of the run
// sees a prepared directory and its manifest. Ranks started by another launcher (mpirun, `flotilla
// run`) find the directory an earlier `flotilla train` made, or are told how to make it.
import { createHash } from 'node:crypto';
import { existsSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { cacheDir } from '../io/cache_dir.js';
import { MOBY_DICK } from './corpus.js';
import { FORMAT_VERSION, MANIFEST, datasetProblem, readManifest, type DatasetExpectation, type DatasetKind } from './prepared.js';
import { tokenizerIdentity } from './tokenizer.js';
import { loadChatTemplate, tokenizerDirOf, type ChatTemplate, type TrainOn } from './chat/index.js';

/** The `[data]` fields read here. */
export interface ExampleDataSpec {
  source: string;
  sources: { path: string; weight: number }[];
  valSource: string;
  tokenizer: string;
  format: DatasetKind;
  chatTemplate: string;
  trainOn: TrainOn;
}

/** Whether a source path is a .jsonl file of examples to prepare (under an example format). */
export function isExampleJsonl(d: ExampleDataSpec, path: string): boolean {
  return d.format !== 'text' && path.toLowerCase().endsWith('.jsonl') && !(existsSync(path) && statSync(path).isDirectory());
}

/**
 * The run's chat template: data.chatTemplate, or "model" when it is "" and data.tokenizer is a
 * Hugging Face directory (or a tokenizer.json with tokenizer_config.json beside it). Undefined for completion data, and for preference data without one.
 * Throws naming data.chatTemplate (or data.tokenizer) and the fix.
 */
export function runTemplate(d: ExampleDataSpec): ChatTemplate | undefined {
  if (d.format === 'text' || d.format === 'completion') return undefined;
  const dir = tokenizerDirOf(d.tokenizer);
  const spec = d.chatTemplate !== '' ? d.chatTemplate : dir !== undefined ? 'model' : '';
  if (spec === '') {
    if (d.format === 'preference') return undefined;
    throw new Error(
      `data.format = "chat" needs a chat template, and data.chatTemplate = "" takes the model's only when data.tokenizer is a Hugging Face directory (or its tokenizer.json; it is ${JSON.stringify(d.tokenizer)}); ` +
        'set data.chatTemplate = "chatml" or the path of a .jinja file, or data.tokenizer = the model\'s directory (tokenizer.json + tokenizer_config.json)',
    );
  }
  try {
    return loadChatTemplate(spec, dir !== undefined ? { tokenizerDir: dir } : {});
  } catch (e) {
    // Preference data with plain-text prompts needs no template: a directory without one is fine.
    if (d.format === 'preference' && d.chatTemplate === '') return undefined;
    throw new Error(`data.chatTemplate = ${JSON.stringify(d.chatTemplate || spec)}: ${(e as Error).message}`);
  }
}

/** What the run expects of a prepared directory (datasetProblem), its template loaded. */
export function runExpectation(d: ExampleDataSpec, template = runTemplate(d)): DatasetExpectation {
  return { format: d.format, trainOn: d.trainOn, ...(template ? { template: { source: template.source, identity: template.identity } } : {}) };
}

function sourcePaths(d: ExampleDataSpec): { what: string; path: string }[] {
  const train = d.sources.length > 0 ? d.sources.map((e) => ({ what: 'data.sources', path: e.path })) : [{ what: 'data.source', path: d.source }];
  return d.valSource !== '' ? [...train, { what: 'data.valSource', path: d.valSource }] : train;
}

/**
 * Problems of the example fields against the sources, without tokenizing: the template (chat), and
 * each source a .jsonl to prepare or a prepared directory of the same kind, template and trainOn.
 * Under format = "text", a prepared example directory is refused. Missing paths (but a .jsonl) and
 * directories without a manifest are checkDataConfig's (src/data/sources.ts), which leaves these to this.
 */
export function exampleDataProblems(d: ExampleDataSpec): string[] {
  const p: string[] = [];
  let template: ChatTemplate | undefined;
  try {
    template = runTemplate(d);
  } catch (e) {
    return [(e as Error).message];
  }
  const want = runExpectation(d, template);
  for (const { what, path } of sourcePaths(d)) {
    if (path === MOBY_DICK || !existsSync(path)) {
      if (isExampleJsonl(d, path) && path !== MOBY_DICK) p.push(`${what}: ${resolve(path)} does not exist; name a .jsonl file of examples (one JSON object a line) or a directory made by \`flotilla prepare ... --format ${d.format}\``);
      if (d.format !== 'text' && path === MOBY_DICK) p.push(`${what} = "${MOBY_DICK}" is text, and data.format = ${JSON.stringify(d.format)}; name a .jsonl of examples or a directory made by \`flotilla prepare --format ${d.format}\``);
      continue;
    }
    const dir = statSync(path).isDirectory();
    if (dir && existsSync(join(path, MANIFEST))) {
      try {
        const problem = datasetProblem(readManifest(path), path, want);
        if (problem !== undefined) p.push(`${what}: ${problem}`);
      } catch { /* a broken manifest is checkDataConfig's to report */ }
    } else if (!dir && d.format !== 'text' && !isExampleJsonl(d, path)) { // a directory without a manifest is checkDataConfig's
      p.push(`${what} = ${path}: data.format = ${JSON.stringify(d.format)} reads a .jsonl file of examples (one JSON object a line) or a directory made by \`flotilla prepare --format ${d.format}\``);
    }
  }
  return p;
}

/** The cache directory a .jsonl source is prepared into ([Note: example sources]); undefined when FLOTILLA_CACHE_DIR=off. */
export function exampleCacheDir(d: ExampleDataSpec, path: string, template = runTemplate(d), env: NodeJS.ProcessEnv = process.env): string | undefined {
  const root = cacheDir('prepared', env);
  if (root === undefined) return undefined;
  const abs = resolve(path);
  const st = statSync(abs);
  const key = createHash('sha256').update(JSON.stringify({
    v: FORMAT_VERSION, path: abs, size: st.size, mtimeMs: st.mtimeMs, tokenizer: tokenizerIdentity(d.tokenizer).identity,
    format: d.format, template: template?.identity ?? null, trainOn: d.format === 'chat' ? d.trainOn : null,
  })).digest('hex');
  return join(root, key.slice(0, 32));
}

function noCache(what: string, path: string, format: string): Error {
  return new Error(`${what} = ${path} is a .jsonl to prepare into the cache, but FLOTILLA_CACHE_DIR=off keeps no cache; prepare it with \`flotilla prepare ${path} --format ${format} --tokenizer ... --out DIR\` and name DIR instead`);
}

/**
 * Prepares every .jsonl source of an example config into its cache directory (a finished one is
 * reused, an interrupted one resumed). Runs in the launching process, before any rank starts.
 * Bad lines are PrepareErrors naming FILE:LINE; nothing a run reads is left behind by a failure.
 */
export async function prepareExampleSources(d: ExampleDataSpec, o: { print?: (line: string) => void; progress?: boolean; workers?: number } = {}): Promise<void> {
  const todo = sourcePaths(d).filter((s) => isExampleJsonl(d, s.path));
  if (todo.length === 0) return;
  const template = runTemplate(d);
  const { prepare } = await import('./prepare.js');
  const done = new Set<string>();
  for (const { what, path } of todo) {
    const out = exampleCacheDir(d, path, template);
    if (out === undefined) throw noCache(what, path, d.format);
    if (done.has(out)) continue;
    done.add(out);
    await prepare({
      sources: [path], tokenizer: d.tokenizer, out, format: d.format as Exclude<DatasetKind, 'text'>,
      chatTemplate: template?.source ?? '', trainOn: d.trainOn,
      // A run prepares every line or none: skipping bad ones is `flotilla prepare`'s choice, made once.
      badLineHint: `; fix the line, or prepare the file with \`flotilla prepare ${path} --format ${d.format} --tokenizer ${d.tokenizer}${template && d.format !== 'completion' ? ` --chat-template ${template.source}` : ''}${d.format === 'chat' ? ` --train-on ${d.trainOn}` : ''} --skip-bad --out DIR\` (bad lines counted and skipped) and set ${what} to DIR`,
      progress: o.progress ?? false, ...(o.print ? { print: o.print } : {}), ...(o.workers !== undefined ? { workers: o.workers } : {}),
    });
  }
}

/** The prepared directory a source path is read from: itself, or for a .jsonl the cache directory it was prepared into. */
export function resolveExampleSource(d: ExampleDataSpec, path: string, what = 'data.source', template?: ChatTemplate): string {
  if (!isExampleJsonl(d, path)) return path;
  const out = exampleCacheDir(d, path, template ?? runTemplate(d));
  if (out === undefined) throw noCache(what, path, d.format);
  if (!existsSync(join(out, MANIFEST))) {
    throw new Error(`${what} = ${path} has not been prepared yet (no ${join(out, MANIFEST)}): start the run with \`flotilla train\` (it prepares a .jsonl before starting the ranks), or prepare it with \`flotilla prepare ${path} --format ${d.format} --out DIR\` and name DIR`);
  }
  return out;
}

/** Rewrites, in place, every .jsonl source of an example config to its prepared directory ([Note: example sources]). */
export function resolveExampleSources(d: ExampleDataSpec): void {
  if (d.format === 'text') return;
  if (!sourcePaths(d).some((s) => isExampleJsonl(d, s.path))) return;
  const template = runTemplate(d);
  d.source = resolveExampleSource(d, d.source, 'data.source', template);
  d.sources = d.sources.map((e) => ({ path: resolveExampleSource(d, e.path, 'data.sources', template), weight: e.weight }));
  if (d.valSource !== '') d.valSource = resolveExampleSource(d, d.valSource, 'data.valSource', template);
}
