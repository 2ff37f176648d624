// The installable package, as a user gets it: `npm pack` of this checkout (which builds dist/),
// `npm install <tarball>` into a fresh project, then plain node imports it from .mjs, `tsc --strict`
// type-checks a .ts file against its declarations, and `npx flotilla` trains the demo config (its BPE
// tokenizer beside it) a few steps and samples from the run. Nothing in the new project runs through
// tsx or reads the checkout's sources. Once the package is installed, the checks' processes (node on
// an .mjs file, tsc, npx flotilla --help and train) run side by side, each on files of its own, and
// each subtest awaits its own.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { spawnAsync, started } from './helpers/pool.js';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, realpathSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, join, resolve } from 'node:path';

const ROOT = resolve(import.meta.dirname, '..');
const work = mkdtempSync(join(tmpdir(), 'flotilla-package-'));

// The project is a stranger to this checkout: no loader, no test hooks inherited.
const ENV = { ...process.env, NODE_OPTIONS: '', FLOTILLA_TEST_CHILD: '1', npm_config_update_notifier: 'false' };

function run(cmd: string, args: string[], cwd: string, timeoutMs = 300_000): { code: number | null; out: string } {
  const r = spawnSync(cmd, args, { cwd, encoding: 'utf8', timeout: timeoutMs, maxBuffer: 64 * 2 ** 20, env: ENV });
  return { code: r.status, out: `${r.stdout ?? ''}${r.stderr ?? ''}${r.error ? `\n${r.error.message}` : ''}` };
}

/** run() without blocking: the checks after the install start together. */
function runAsync(cmd: string, args: string[], cwd: string, timeoutMs = 300_000): Promise<{ code: number | null; out: string }> {
  return started(spawnAsync(cmd, args, { cwd, timeout: timeoutMs, env: ENV }).then((r) => ({ code: r.status, out: `${r.stdout}${r.stderr}` })));
}

/** The version of one of this checkout's installed packages, so the new project gets it from npm's cache. */
function installedVersion(name: string): string {
  return (JSON.parse(readFileSync(join(ROOT, 'node_modules', name, 'package.json'), 'utf8')) as { version: string }).version;
}

test('npm pack, npm install into a new project: plain node, tsc --strict and npx flotilla use it', async (t) => {
  const packDir = join(work, 'pack');
  mkdirSync(packDir);
  const pack = run('npm', ['pack', '--pack-destination', packDir], ROOT);
  assert.equal(pack.code, 0, `npm pack failed:\n${pack.out}`);
  const tarballs = readdirSync(packDir).filter((f) => f.endsWith('.tgz'));
  assert.equal(tarballs.length, 1, `npm pack made ${tarballs.join(', ') || 'no tarball'}`);
  const tarball = join(packDir, tarballs[0]!);

  const project = join(work, 'project');
  mkdirSync(project);
  writeFileSync(join(project, 'package.json'), JSON.stringify({
    name: 'uses-flotilla', version: '1.0.0', private: true, type: 'module',
    // npm runs a dependency's install script only when the project allows it (npm 11).
    allowScripts: { [`file:${tarball}`]: true, flotilla: true },
  }, null, 2));
  const install = run('npm', [
    'install', '--prefer-offline', '--no-audit', '--no-fund', '--foreground-scripts',
    tarball, `typescript@${installedVersion('typescript')}`, `@types/node@${installedVersion('@types/node')}`,
  ], project);
  assert.equal(install.code, 0, `npm install failed:\n${install.out}`);

  const pkgDir = join(project, 'node_modules', 'flotilla');
  // The processes of the last three checks, started now.
  writeFileSync(join(project, 'use.mjs'), [
    "import { GPT, tensor, AdamW } from 'flotilla';",
    'const model = new GPT({ vocabSize: 16, blockSize: 8, nLayer: 1, nHead: 2, nEmbd: 8 }, { initSeed: 1 });',
    'const t = tensor(new Float32Array([1, 2, 3]));',
    "console.log(JSON.stringify({ params: model.numParams(), sum: t.sum().item(), adamw: typeof AdamW }));",
  ].join('\n'));
  const useMjs = runAsync(process.execPath, ['use.mjs'], project);
  writeFileSync(join(project, 'use.ts'), [
    "import { GPT, train, type GPTConfig, type TrainSummary } from 'flotilla';",
    'const cfg: GPTConfig = { vocabSize: 16, blockSize: 8, nLayer: 1, nHead: 2, nEmbd: 8, dropout: 0, bias: true, tieEmbeddings: false };',
    'const n: number = new GPT(cfg, { initSeed: 1 }).numParams();',
    'const summary: Promise<TrainSummary> | undefined = n > 0 ? undefined : undefined;',
    'console.log(n, typeof train, summary);',
    // Were the declarations missing (any), this directive would itself be the error.
    '// @ts-expect-error nLayer is a number',
    "new GPT({ ...cfg, nLayer: 'one' });",
  ].join('\n'));
  writeFileSync(join(project, 'tsconfig.json'), JSON.stringify({
    compilerOptions: { strict: true, module: 'NodeNext', moduleResolution: 'NodeNext', target: 'ES2022', noEmit: true, types: ['node'] },
    files: ['use.ts'],
  }));
  const tsc = runAsync(join(project, 'node_modules', '.bin', 'tsc'), ['-p', '.'], project);
  const help = runAsync('npx', ['--no-install', 'flotilla', '--help'], project);
  const config = join(pkgDir, 'examples', 'gpt-tiny.toml');
  const trained = runAsync('npx', ['--no-install', 'flotilla', 'train', config, '--train.steps=2', '--train.evalEvery=0', '--train.evalBatches=1',
    '--train.name=installed', '--log.progress=plain', '--model.nLayer=1'], project);
  await t.test('the installed package is the compiled one, with a native addon that loads', () => {
    const pkg = JSON.parse(readFileSync(join(pkgDir, 'package.json'), 'utf8')) as { main: string; bin: Record<string, string>; exports: unknown };
    assert.equal(pkg.main, './dist/index.js');
    assert.equal(pkg.bin.flotilla, 'dist/cli/bin.js');
    assert.ok(existsSync(join(pkgDir, 'dist', 'index.d.ts')), 'no dist/index.d.ts in the installed package');
    assert.ok(!existsSync(join(pkgDir, 'src')), 'the TypeScript sources were packed');
    assert.ok(existsSync(join(pkgDir, 'native', 'build', 'Release', 'flotilla.node')), 'no addon in the installed package');
    // The install script ran (allowed above) and found the packed addon fit for this machine.
    assert.match(install.out, /flotilla: (using the prebuilt native addon|native addon built)/, install.out);
    // Either way the install ends with the addon's copy of libtorch_cpu (scripts/trim-libtorch.cjs),
    // which the package does not ship: its record says what was done here.
    const trimmed = JSON.parse(readFileSync(join(pkgDir, 'native', 'build', 'Release', 'libtorch_cpu.trimmed.json'), 'utf8')) as { copy?: string };
    const ours = JSON.parse(readFileSync(join(ROOT, 'native', 'build', 'Release', 'libtorch_cpu.trimmed.json'), 'utf8')) as { copy?: string };
    assert.equal(trimmed.copy !== undefined, ours.copy !== undefined, JSON.stringify(trimmed));
    if (trimmed.copy !== undefined) assert.equal(trimmed.copy, join(realpathSync(pkgDir), 'native', 'build', 'Release', basename(ours.copy!)));
  });

  await t.test('plain node imports it from an .mjs file', async () => {
    const r = await useMjs;
    assert.equal(r.code, 0, r.out);
    const got = JSON.parse(r.out.trim().split('\n').pop()!) as { params: number; sum: number; adamw: string };
    assert.ok(got.params > 0, r.out);
    assert.equal(got.sum, 6);
    assert.equal(got.adamw, 'function');
  });

  await t.test('tsc --strict resolves its types (a wrong call is a type error)', async () => {
    const r = await tsc;
    assert.equal(r.code, 0, `tsc --strict failed:\n${r.out}`);
  });

  await t.test('npx flotilla --help, a 2-step npx flotilla train of the demo that writes its report, and generate', async () => {
    const h = await help;
    assert.equal(h.code, 0, h.out);
    assert.match(h.out, /flotilla train <config\.toml>/);
    const tr = await trained;
    assert.equal(tr.code, 0, tr.out);
    // The demo's tokenizer ships beside the config and is found from the project's directory.
    assert.match(tr.out, /\[data\] moby-dick: .*node_modules\/flotilla\/examples\/moby-dick-bpe512\.json tokens \(vocabulary 512\)/, tr.out);
    const lines = readFileSync(join(project, 'runs', 'installed', 'metrics.jsonl'), 'utf8').trim().split('\n');
    assert.equal(lines.length, 2, tr.out);
    // The run's checkpoint names that tokenizer by an absolute path: sampling works from another directory.
    const sub = join(project, 'sub');
    mkdirSync(sub);
    const gen = run('npx', ['--no-install', 'flotilla', 'generate', join(project, 'runs', 'installed'), '--prompt', 'Call me Ishmael.', '--tokens', '5'], sub);
    assert.equal(gen.code, 0, gen.out);
    assert.match(gen.out, /^Call me Ishmael\./m, gen.out);
    // The run's report, from the compiled report code and the package's own charting dependency.
    assert.match(tr.out, /\[report\] runs\/installed\/report\.html/, tr.out);
    assert.match(readFileSync(join(project, 'runs', 'installed', 'report.html'), 'utf8'), /<figure class="chart" id="chart-loss"/);
  });
});

test.after(() => rmSync(work, { recursive: true, force: true }));
