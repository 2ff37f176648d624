// `npm test` after the set-up: the whole suite, three test files at once on the 2-core test machine
// (launches of ranks two at a time across files, test/helpers/pool.ts), in the order
// scripts/test-files.mjs gives (the longest first). (Three was once given up for two after worlds of two
// files hung at rendezvous together; the cause was a free port handed to both before either rank 0
// listened, and test worlds now meet in a FileStore of their own, test/helpers/world.ts.)
// While dist/ is current (scripts/ensure.sh has just built it) each test file runs as the JavaScript
// test/helpers/compiled.ts makes of it, its imports of src/ naming dist/: the file's process then
// needs no TypeScript loader (about 0.75 s of CPU a file). A file that cannot run compiled, or every file with FLOTILLA_TEST_TSX=1, runs through
// tsx. Arguments: test files to run instead of all of them, and options for `node --test` (e.g.
// --test-reporter=tap).
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, join, relative, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { runnableScript } from '../test/helpers/compiled.js';

const ROOT = join(import.meta.dirname, '..');
const args = process.argv.slice(2);
const options = args.filter((a) => a.startsWith('-'));
let named = args.filter((a) => !a.startsWith('-'));
if (named.length === 0) {
  const order = spawnSync(process.execPath, [join(ROOT, 'scripts', 'test-files.mjs')], { encoding: 'utf8' });
  if (order.status !== 0) throw new Error(`scripts/test-files.mjs failed:\n${order.stderr}`);
  named = order.stdout.trim().split('\n');
}
const files = named.map((f) => runnableScript(relative(ROOT, resolve(f))));
const loader = files.some((f) => f.endsWith('.ts')) ? ['--import', 'tsx'] : [];
const concurrency = options.some((o) => o.startsWith('--test-concurrency')) ? [] : ['--test-concurrency=3'];
// node --test starts its files sorted by path, whatever order they are given in: each file is
// started through a one-line module named by its place in the order (001-pipeline_train.test.mjs)
// that imports it.
// FLOTILLA_TEST_TIMELINE=FILE appends, per test file, "start"/"end" lines with a time in ms and the
// file's process id, to see which files ran beside which and (with process accounting) which
// processes each file started (the order above is chosen from that and from CPU time). The start
// line is written by a module of its own imported first: imports are evaluated in order, so it runs
// before the test file's own top-level code (which may wait for launch slots).
const orderDir = mkdtempSync(join(tmpdir(), 'flotilla-test-order-'));
function timeline(name: string): string {
  const out = process.env.FLOTILLA_TEST_TIMELINE;
  if (!out) return '';
  const line = (what: string): string =>
    `appendFileSync(${JSON.stringify(out)}, \`\${Date.now()} ${what} ${name} \${process.pid}\\n\`);`;
  const module = `timeline-${name}`;
  writeFileSync(join(orderDir, module), `import { appendFileSync } from 'node:fs';\n${line('start')}\nprocess.on('exit', () => { ${line('end')} });\n`);
  return `import ${JSON.stringify(`./${module}`)};\n`;
}
const ordered = files.map((f, i) => {
  const name = `${String(i + 1).padStart(3, '0')}-${basename(f).replace(/-[0-9a-f]{16}\.mjs$/, '.mjs').replace(/\.ts$/, '.mts')}`;
  writeFileSync(join(orderDir, name), `${timeline(name)}import ${JSON.stringify(pathToFileURL(resolve(ROOT, f)).href)};\n`);
  return join(orderDir, name);
});
// The run's own cache of tokenized text (src/data/token_cache.ts): shared by its files, so the demo
// corpus is tokenized once a run, and new each run, so no earlier run's ids are read.
const cacheDir = mkdtempSync(join(tmpdir(), 'flotilla-test-cache-'));
// The MFU's peak probes (src/train/peak_flops.ts) go into that cache once, here, at one thread (the
// runs' default): a probe made while the suite loads the cores is not cached, so every training run
// of the suite would probe again (about 0.5 s in float32 and 0.8 s more in bfloat16, on rank 0 while
// its world waits). test/train_flops.test.ts tests the probe and its cache rule with caches of its own.
const peakProbe = `import { setNumThreads } from ${JSON.stringify(pathToFileURL(join(ROOT, 'src', 'tensor', 'index.ts')).href)};
import { peakTflops } from ${JSON.stringify(pathToFileURL(join(ROOT, 'src', 'train', 'peak_flops.ts')).href)};
setNumThreads(1);
for (const dtype of ['float32', 'bfloat16']) peakTflops(0, dtype, process.env, () => 0);`;
const probed = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '--eval', peakProbe], {
  cwd: ROOT, encoding: 'utf8', env: { ...process.env, FLOTILLA_CACHE_DIR: cacheDir },
});
if (probed.status !== 0) throw new Error(`the MFU peak probe failed:\n${probed.stderr}`);
// The run's temporary directory (TMPDIR for every test process and what they start): the files'
// run directories, checkpoints and worlds' stores, a few hundred MiB a run, are removed with it when
// the run passes, and kept for a look when it fails.
const runTmp = mkdtempSync(join(tmpdir(), 'flotilla-test-run-'));
const r = spawnSync(process.execPath, [...loader, '--test', ...concurrency, ...options, ...ordered], {
  cwd: ROOT, stdio: 'inherit', env: { ...process.env, FLOTILLA_CACHE_DIR: cacheDir, TMPDIR: runTmp },
});
rmSync(cacheDir, { recursive: true, force: true });
rmSync(orderDir, { recursive: true, force: true });
if (r.status === 0) rmSync(runTmp, { recursive: true, force: true });
else process.stderr.write(`the test files' temporary files are kept in ${runTmp}\n`);
process.exit(r.status ?? 1);
