// `flotilla report` on what a person may point it at: a killed run whose metrics.jsonl ends in a
// cut line (a report of the complete steps, with a note), a directory that is not a run, a missing
// path (one message, exit 2, nothing written), checkpoints and a sample when the run has them. In
// every case nothing in a run directory changes except report.html.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { configToToml, defaultConfig } from '../src/config/index.js';

const ROOT = resolve(import.meta.dirname, '..');
const BIN = join(ROOT, 'bin', 'flotilla.js');
const dir = mkdtempSync(join(tmpdir(), 'flotilla-report-input-'));

function report(args: string[]): { code: number | null; out: string; err: string } {
  const r = spawnSync(process.execPath, [BIN, 'report', ...args], { cwd: dir, encoding: 'utf8', timeout: 120_000 });
  return { code: r.status, out: r.stdout, err: r.stderr };
}

function row(step: number, extra: Record<string, number> = {}): string {
  return JSON.stringify({ step, loss: 5 - step * 0.1, lr: 1e-3, tokensPerSec: 1000 + step, gradNorm: 1 + step / 10, elapsedS: step * 0.5, ...extra });
}

/** A run directory as the trainer leaves it: the resolved config with its header, and metrics. */
function makeRun(name: string, metrics: string, worldSize = 2): string {
  const d = join(dir, 'runs', name);
  mkdirSync(d, { recursive: true });
  const cfg = defaultConfig();
  cfg.train.name = name;
  writeFileSync(join(d, 'config.toml'), configToToml(cfg, { header: `Resolved config of run "${name}" (from test), world size ${worldSize}.` }));
  writeFileSync(join(d, 'metrics.jsonl'), metrics);
  return d;
}

/** Every file under a directory with its contents, to prove what changed. */
function contents(d: string): Map<string, string> {
  const out = new Map<string, string>();
  const walk = (p: string): void => {
    for (const e of readdirSync(p)) {
      const f = join(p, e);
      if (statSync(f).isDirectory()) walk(f);
      else out.set(f, readFileSync(f, 'latin1'));
    }
  };
  walk(d);
  return out;
}

/** The points of the loss chart's train line for one run (the M/L commands of its path). */
function linePoints(html: string): number[] {
  const fig = /<figure[^>]*id="chart-loss"[^>]*>([\s\S]*?)<\/figure>/.exec(html);
  assert.ok(fig, 'no loss chart');
  return [...fig[1]!.matchAll(/<g clip-path="url\(#[^"]+\)">\s*<path d="([^"]*)"/g)].map((m) => (m[1]!.match(/[ML]/g) ?? []).length);
}

test('a killed run: the cut last line of metrics.jsonl is left out and said so; only report.html is written', () => {
  const lines = [1, 2, 3, 4, 5].map((s) => row(s, s === 3 || s === 5 ? { valLoss: 4.9 - s * 0.1 } : {}));
  const cut = row(6).slice(0, 25); // what a kill in the middle of a write leaves
  const run = makeRun('killed', `${lines.join('\n')}\n${cut}`);
  const before = contents(run);
  const r = report([run]);
  assert.equal(r.code, 0, r.out + r.err);
  assert.match(r.out, /report: \S*runs\/killed\/report\.html/);
  const after = contents(run);
  for (const [f, v] of before) assert.equal(after.get(f), v, `${f} changed`);
  assert.deepEqual([...after.keys()].filter((f) => !before.has(f)), [join(run, 'report.html')]);
  const html = after.get(join(run, 'report.html'))!;
  assert.match(html, /The last line of metrics\.jsonl \(line 6\) is cut short[^<]*5 complete step/);
  assert.deepEqual(linePoints(html), [5, 2], 'train line: the 5 complete steps; val line: 2 evaluations');
  assert.match(html, /data parallel 2/, 'layout from the config and the world size');
  assert.match(html, /none in this run directory/, 'no checkpoints');
});

test('a line that is not JSON in the middle is left out and named; checkpoints and the sample are shown', () => {
  const run = makeRun('odd', `${row(1)}\nnot json\n${row(2)}\n${row(3)}\n`, 1);
  const ck = join(run, 'checkpoints', 'step-000002');
  mkdirSync(ck, { recursive: true });
  writeFileSync(join(ck, 'meta.json'), JSON.stringify({ step: 2 }));
  writeFileSync(join(ck, 'model.safetensors'), Buffer.alloc(3000));
  mkdirSync(join(run, 'checkpoints', 'tmp-partial')); // not a step-NNNNNN directory: not listed
  writeFileSync(join(run, 'sample.txt'), 'Call me <Ishmael> & friends.');
  const r = report([run]);
  assert.equal(r.code, 0, r.err);
  const html = readFileSync(join(run, 'report.html'), 'utf8');
  assert.match(html, /Line 2 of metrics\.jsonl is not a step&#39;s metrics/);
  assert.deepEqual(linePoints(html), [3]);
  assert.match(html, /<td>2<\/td><td>checkpoints\/step-000002<\/td><td>2\.9 KiB<\/td><td>2<\/td>/);
  assert.doesNotMatch(html, /tmp-partial/);
  assert.match(html, /Call me &lt;Ishmael&gt; &amp; friends\./, 'the sample, escaped');
  assert.match(html, /single replica/);
});

test('not a run: a missing path, a file, a directory without config or metrics, no argument (exit 2, nothing written)', () => {
  const empty = join(dir, 'not-a-run');
  mkdirSync(empty);
  writeFileSync(join(empty, 'notes.txt'), 'hello');
  const good = makeRun('good', `${row(1)}\n`);
  const cases: [string[], RegExp][] = [
    [[join(dir, 'nope')], /does not exist: pass a run directory/],
    [[join(empty, 'notes.txt')], /is not a directory/],
    [[empty], /is not a run directory \(it has no config\.toml and no metrics\.jsonl\)/],
    [[good, empty], /is not a run directory/], // one bad directory: nothing written, not even the good run's report
    [[], /give the run directory/],
    [[good, '--bogus'], /unknown option --bogus/],
  ];
  for (const [args, message] of cases) {
    const r = report(args);
    assert.equal(r.code, 2, `${args.join(' ')}: ${r.out}${r.err}`);
    assert.match(r.err, message, args.join(' '));
    assert.equal(r.err.trim().split('\n').length, 1, `one line: ${r.err}`);
  }
  assert.deepEqual(readdirSync(empty), ['notes.txt']);
  assert.ok(!existsSync(join(good, 'report.html')), 'the good run got a report although the command failed');
});

test('a run directory with a config and no metrics yet (stopped before its first step)', () => {
  const run = makeRun('early', '');
  rmSync(join(run, 'metrics.jsonl'));
  const r = report([run, '--out', join(dir, 'early.html')]);
  assert.equal(r.code, 0, r.err);
  const html = readFileSync(join(dir, 'early.html'), 'utf8');
  assert.match(html, /There is no metrics\.jsonl/);
  assert.match(html, /No steps recorded yet/);
  assert.ok(!existsSync(join(run, 'report.html')), '--out writes only there');
});

test.after(() => rmSync(dir, { recursive: true, force: true }));

test('the report code loads without ECharts; the first chart loads it (rank 0 holds the report code through a run)', async () => {
  const { createRequire } = await import('node:module');
  const loaded = (): boolean => Object.keys(createRequire(import.meta.url).cache).some((f) => /[\\/]node_modules[\\/]echarts[\\/]/.test(f));
  const { writeReport } = await import('../src/report/index.js');
  assert.equal(loaded(), false, 'importing the report code loaded ECharts (about 60 MiB of a training rank 0)');
  const d = makeRun('lazy-charts', [row(1), row(2), row(3)].join('\n') + '\n');
  const html = readFileSync(writeReport([d]), 'utf8');
  assert.match(html, /id="chart-loss"/);
  assert.equal(loaded(), true, 'the report drew its charts without ECharts?');
});
