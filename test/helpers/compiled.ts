// Test scripts that start without a TypeScript loader. A rank script (test/fixtures/*.ts,
// test/helpers/ranks/*.ts) and the test modules it imports are transpiled to JavaScript whose imports
// of src/ name the compiled dist/ instead, so that every rank starts as `node script.mjs`: tsx costs a
// rank about a second of CPU (its loader thread and esbuild service), as much again as loading the
// addon. Only while dist/ is current, by the rule bin/flotilla.js follows (dist/.built no older than
// any file under src/; scripts/ensure.sh, the first step of `npm test`, rebuilds it): after an edit
// under src/ without a rebuild, runnableScript returns the .ts script and ranks run the sources
// through tsx, so a test never runs stale code. FLOTILLA_TEST_TSX=1 always runs the sources.
//
// The JavaScript is cached under node_modules/.cache/flotilla-test-scripts, one file per module named
// by a hash of its content (which holds its imports' names, hence their content): an edited test
// module gets a new file, and files of one version never change. No side effects at import.
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, renameSync, statSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { basename, dirname, join, relative, resolve, sep } from 'node:path';
import { pathToFileURL } from 'node:url';

const ROOT = resolve(import.meta.dirname, '..', '..');
const SRC = join(ROOT, 'src');
const DIST = join(ROOT, 'dist');
const CACHE = join(ROOT, 'node_modules', '.cache', 'flotilla-test-scripts');

/** The newest modification time of any file under dir (0 for an empty or missing dir). */
function newest(dir: string): number {
  let t = 0;
  for (const e of readdirSync(dir, { withFileTypes: true })) {
    const p = join(dir, e.name);
    t = Math.max(t, e.isDirectory() ? newest(p) : statSync(p).mtimeMs);
  }
  return t;
}

/** Whether dist/ was built from the current src/ (bin/flotilla.js's rule). */
export function distIsCurrent(): boolean {
  try {
    return statSync(join(DIST, '.built')).mtimeMs >= newest(SRC);
  } catch {
    return false;
  }
}

/**
 * The script to start: a compiled .mjs of a .ts script while dist/ is current (and every module it
 * imports from src/ has its compiled file), else the script itself.
 */
export function runnableScript(script: string): string {
  if (!/\.[mc]?ts$/.test(script) || process.env.FLOTILLA_TEST_TSX === '1' || !distIsCurrent()) return script;
  try {
    return compile(resolve(ROOT, script), []) ?? script;
  } catch {
    return script; // anything unexpected: the sources through tsx, as before
  }
}

let ts: typeof import('typescript') | undefined;
/** TypeScript's own transpiler (types removed, nothing checked), loaded on the first cache miss. */
function transpile(source: string, file: string): string {
  ts ??= createRequire(import.meta.url)('typescript') as typeof import('typescript');
  return ts.transpileModule(source, {
    fileName: file,
    compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022, sourceMap: false, removeComments: true },
  }).outputText;
}

/** Names the transpiler's settings above: changing them makes new files. */
const TRANSPILE = 'esnext-es2022-nocomments';

const hash = (s: string): string => createHash('sha256').update(s).digest('hex').slice(0, 16);

/** Writes content to CACHE/name unless it is there (written whole: a reader never sees part of it). */
function cached(name: string, content: string): string {
  const path = join(CACHE, name);
  if (!existsSync(path)) {
    mkdirSync(dirname(path), { recursive: true });
    const tmp = `${path}.${process.pid}.tmp`;
    writeFileSync(tmp, content);
    renameSync(tmp, path);
  }
  return path;
}

const inside = (dir: string, p: string): boolean => p.startsWith(dir + sep);

/**
 * The compiled file of one test module, its imports compiled first; undefined when it cannot run
 * from dist/ (an import cycle among test modules, or a source file dist/ does not have).
 */
function compile(file: string, stack: string[]): string | undefined {
  if (stack.includes(file)) return undefined;
  const source = readFileSync(file, 'utf8');
  // Transpiled once per content (the transpiler's output does not depend on where the file is).
  const jsName = `${basename(file).replace(/\.[mc]?ts$/, '')}-${hash(`${TRANSPILE}\n${source}`)}.js`;
  const jsPath = join(CACHE, 'transpiled', jsName);
  const js = existsSync(jsPath) ? readFileSync(jsPath, 'utf8') : readFileSync(cached(join('transpiled', jsName), transpile(source, file)), 'utf8');
  let failed = false;
  const here = dirname(file);
  const out = js
    .replace(/(\bfrom\s*|\bimport\s*\(\s*|\bimport\s+)(['"])(\.\.?\/[^'"]+)\2/g, (all, lead: string, q: string, spec: string) => {
      const target = resolve(here, spec);
      let url: string | undefined;
      if (inside(SRC, target)) {
        const built = join(DIST, relative(SRC, target)).replace(/\.[mc]?ts$/, '.js');
        if (existsSync(built)) url = pathToFileURL(built).href;
      } else {
        const tsFile = target.replace(/\.([mc]?)js$/, '.$1ts');
        const compiled = /\.[mc]?ts$/.test(tsFile) && existsSync(tsFile) ? compile(tsFile, [...stack, file]) : existsSync(target) ? target : undefined;
        if (compiled) url = pathToFileURL(compiled).href;
      }
      if (url === undefined) {
        failed = true;
        return all;
      }
      return `${lead}${q}${url}${q}`;
    })
    // Paths taken from the module's own location stay those of its source.
    .replace(/\bimport\.meta\.dirname\b/g, JSON.stringify(here))
    .replace(/\bimport\.meta\.filename\b/g, JSON.stringify(file))
    .replace(/\bimport\.meta\.url\b/g, JSON.stringify(pathToFileURL(file).href));
  if (failed) return undefined;
  return cached(`${basename(file).replace(/\.[mc]?ts$/, '')}-${hash(out)}.mjs`, out);
}
