// Runs every benchmark in bench/ one after another: step first, then allreduce and ddp when they exist,
// then any other bench/<name>.ts. A benchmark is a bench/<name>.ts whose name has no underscore;
// <bench>_<role>.ts files (per-rank scripts, peers) and the shared helpers (report.ts, this runner) are
// not benchmarks. Each benchmark writes its own section of docs/BENCHMARKS.md.
//
//   node --import tsx bench/run.ts            every benchmark
//   node --import tsx bench/run.ts step ddp   only these
import { spawnSync } from 'node:child_process';
import { readdirSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = dirname(fileURLToPath(import.meta.url));
const FIRST = ['step', 'allreduce', 'ddp'];
const HELPERS = ['run', 'report'];

const found = readdirSync(HERE)
  .filter((f) => f.endsWith('.ts') && !f.endsWith('.d.ts'))
  .map((f) => f.slice(0, -3))
  .filter((n) => !n.includes('_') && !HELPERS.includes(n));
const ordered = [...FIRST.filter((n) => found.includes(n)), ...found.filter((n) => !FIRST.includes(n)).sort()];
const wanted = process.argv.slice(2);
const unknown = wanted.filter((w) => !found.includes(w));
if (unknown.length) {
  console.error(`bench: no benchmark named ${unknown.join(', ')}; available: ${ordered.join(', ')}`);
  process.exit(2);
}
const selected = wanted.length ? ordered.filter((n) => wanted.includes(n)) : ordered;

const results: { name: string; ok: boolean; seconds: number }[] = [];
for (const name of selected) {
  console.log(`\n=== bench/${name}.ts ===`);
  const t0 = Date.now();
  const r = spawnSync(process.execPath, ['--import', 'tsx', join(HERE, `${name}.ts`)], { stdio: 'inherit', cwd: join(HERE, '..') });
  results.push({ name, ok: r.status === 0, seconds: (Date.now() - t0) / 1e3 });
}
console.log('\n=== summary ===');
for (const r of results) console.log(`${r.ok ? 'ok    ' : 'FAILED'} ${r.name} (${r.seconds.toFixed(0)} s)`);
process.exit(results.every((r) => r.ok) ? 0 : 1);
