// Where the launcher lives: src/launch (and `flotilla run`'s options in src/cli/run.ts), apart from the
// runtime. Process groups and collectives import nothing of it, and no import circle runs through the
// launcher or the runtime. Read from the sources' import lines; nothing is loaded.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, readdirSync, readFileSync, statSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import { REPO_ROOT } from './helpers/world.js';

const SRC = join(REPO_ROOT, 'src');

/** Every .ts file under src, as a path relative to the repository, with the src files it imports (type-only and dynamic imports too). */
function importGraph(): Map<string, string[]> {
  const graph = new Map<string, string[]>();
  const walk = (dir: string): void => {
    for (const e of readdirSync(dir)) {
      const p = join(dir, e);
      if (statSync(p).isDirectory()) walk(p);
      else if (p.endsWith('.ts')) {
        const deps: string[] = [];
        for (const m of readFileSync(p, 'utf8').matchAll(/(?:\bfrom|\bimport)\s*\(?\s*'(\.{1,2}\/[^']+)'/g)) {
          const target = resolve(dirname(p), m[1]!.replace(/\.js$/, '.ts'));
          if (existsSync(target)) deps.push(relative(REPO_ROOT, target));
        }
        graph.set(relative(REPO_ROOT, p), deps);
      }
    }
  };
  walk(SRC);
  return graph;
}

const isLauncher = (f: string): boolean => f.startsWith('src/launch/') || f === 'src/cli/run.ts';
const isRuntime = (f: string): boolean => f.startsWith('src/distributed/');

test('the runtime (src/distributed) imports nothing of the launcher or the CLI', () => {
  const graph = importGraph();
  assert.ok(graph.has('src/launch/supervisor.ts') && graph.has('src/cli/run.ts'), 'the launcher files are where this test expects them');
  const wrong = [...graph].flatMap(([f, deps]) => (isRuntime(f) ? deps.filter((d) => isLauncher(d) || d.startsWith('src/cli/')).map((d) => `${f} -> ${d}`) : []));
  assert.deepEqual(wrong, []);
});

test('both launchers hand their ranks to the one supervisor', () => {
  const graph = importGraph();
  for (const f of ['src/launch/direct.ts', 'src/launch/mpirun.ts', 'src/launch/launcher.ts']) {
    assert.ok(graph.get(f)!.includes('src/launch/supervisor.ts'), `${f} does not use supervisor.ts`);
  }
});

test('no import circle runs through the launcher or the runtime', () => {
  const graph = importGraph();
  const state = new Map<string, 'open' | 'done'>();
  const stack: string[] = [];
  const circles: string[] = [];
  const visit = (f: string): void => {
    state.set(f, 'open');
    stack.push(f);
    for (const d of graph.get(f) ?? []) {
      if (state.get(d) === 'open') {
        const circle = [...stack.slice(stack.indexOf(d)), d];
        if (circle.some((x) => isLauncher(x) || isRuntime(x))) circles.push(circle.join(' -> '));
      } else if (state.get(d) === undefined) visit(d);
    }
    stack.pop();
    state.set(f, 'done');
  };
  for (const f of graph.keys()) if (state.get(f) === undefined) visit(f);
  assert.deepEqual(circles, []);
});
