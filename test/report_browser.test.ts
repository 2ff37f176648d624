// The run report as a person sees it: a real 2-rank `flotilla train` writes RUN/report.html at its
// end, `flotilla report A B` overlays two runs, and headless Chromium (Debian's `chromium`, which
// scripts/setup.sh installs) opens each page from disk. The screenshot must show the loss chart
// drawn (non-background pixels inside its plot area, in each run's colour) and the DOM must hold
// one drawn line per series. The page must load nothing from the network.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { PNG } from 'pngjs';
import { RUN_COLORS } from '../src/report/charts.js';
import { flotilla as run } from './helpers/cli.js';
import { started } from './helpers/pool.js';
import { tinyGptToml } from './fixtures/tiny_gpt.js';

const ROOT = resolve(import.meta.dirname, '..');
const dir = mkdtempSync(join(tmpdir(), 'flotilla-report-'));

const config = join(dir, 'tiny.toml');
writeFileSync(config, tinyGptToml({ train: { steps: 6, evalEvery: 3, evalBatches: 1 }, log: { every: 1, progress: 'plain' } }, 'a tiny GPT: a few steps with two evaluations'));

/** flotilla from the test's directory, stdout and stderr together. */
async function flotilla(args: string[]): Promise<{ code: number | null; out: string }> {
  const r = await run(args, { cwd: dir, env: { FLOTILLA_REPORT: '1' } }); // this file tests the report
  return { code: r.code, out: r.out + r.err };
}

/** Debian's chromium; the test fails (not skips) without it: set-up installs it. */
function chromiumPath(): string {
  for (const name of [process.env.CHROMIUM, 'chromium', 'chromium-browser'].filter((n): n is string => !!n)) {
    const r = spawnSync('sh', ['-c', `command -v ${name}`], { encoding: 'utf8' });
    if (r.status === 0 && r.stdout.trim() !== '') return r.stdout.trim();
  }
  assert.fail('headless Chromium is missing: bash scripts/setup.sh installs it (apt-get install chromium)');
}

/** Runs headless Chromium on a page with the network features that would wait on connections off. */
function chromium(args: string[], page: string): string {
  const profile = mkdtempSync(join(dir, 'chromium-profile-'));
  const r = spawnSync(chromiumPath(), [
    '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync', '--hide-scrollbars', `--user-data-dir=${profile}`, ...args, pathToFileURL(page).href,
  ], { encoding: 'utf8', timeout: 120_000, maxBuffer: 64 * 2 ** 20 });
  assert.equal(r.status, 0, `chromium failed (${r.status}, ${r.error?.message ?? ''}):\n${r.stderr}`);
  return r.stdout;
}

const WIDTH = 1000;
const HEIGHT = 1300; // the summary table and the first chart (loss) fit

interface Shot { png: PNG; plot: { x0: number; y0: number; x1: number; y1: number } }

/** A screenshot, and the loss chart's plot area in it: the box its horizontal grid lines span. */
function screenshot(page: string, name: string): Shot {
  const file = join(dir, `${name}.png`);
  chromium([`--screenshot=${file}`, `--window-size=${WIDTH},${HEIGHT}`], page);
  const png = PNG.sync.read(readFileSync(file));
  // ECharts' split lines are #dbdee4; the first run of rows holding them, from the top, is the
  // first chart's plot area (the next chart starts well below it).
  const isGrid = (i: number): boolean => Math.abs(png.data[i]! - 0xdb) <= 3 && Math.abs(png.data[i + 1]! - 0xde) <= 3 && Math.abs(png.data[i + 2]! - 0xe4) <= 3;
  let x0 = Infinity, x1 = -1, y0 = -1, y1 = -1;
  for (let y = 0; y < png.height; y++) {
    let n = 0;
    let lo = Infinity, hi = -1;
    for (let x = 0; x < png.width; x++) {
      if (isGrid((y * png.width + x) * 4)) {
        n++;
        lo = Math.min(lo, x);
        hi = Math.max(hi, x);
      }
    }
    if (n < 200) continue; // a grid line crosses the plot; text and borders do not
    if (y0 < 0) y0 = y;
    else if (y - y1 > 120) break; // the next chart
    y1 = y;
    x0 = Math.min(x0, lo);
    x1 = Math.max(x1, hi);
  }
  assert.ok(y0 >= 0 && y1 - y0 > 100 && x1 - x0 > 300, `${name}: no chart plot area found in the screenshot (${file})`);
  return { png, plot: { x0, y0, x1, y1 } };
}

/** Pixels in the plot area (inset past the axes) that are neither background nor grid, and per colour. */
function plotPixels(s: Shot, colors: readonly string[]): { drawn: number; perColor: number[] } {
  const rgb = colors.map((c) => [1, 3, 5].map((k) => parseInt(c.slice(k, k + 2), 16)));
  const perColor = colors.map(() => 0);
  let drawn = 0;
  const { png, plot } = s;
  for (let y = plot.y0 + 3; y <= plot.y1 - 3; y++) {
    for (let x = plot.x0 + 3; x <= plot.x1 - 3; x++) {
      const i = (y * png.width + x) * 4;
      const [r, g, b] = [png.data[i]!, png.data[i + 1]!, png.data[i + 2]!];
      const background = r > 245 && g > 245 && b > 245;
      const grid = Math.abs(r - 0xdb) <= 6 && Math.abs(g - 0xde) <= 6 && Math.abs(b - 0xe4) <= 6;
      if (background || grid) continue;
      drawn++;
      rgb.forEach(([cr, cg, cb], k) => {
        if (Math.abs(r - cr!) + Math.abs(g - cg!) + Math.abs(b - cb!) <= 30) perColor[k]!++;
      });
    }
  }
  return { drawn, perColor };
}

/** The loss figure in the DOM Chromium built: its series lines (clipped paths with points) and legend entries. */
function lossSeries(dom: string): { lines: number; legend: string[] } {
  const m = /<figure[^>]*id="chart-loss"[^>]*>([\s\S]*?)<\/figure>/.exec(dom);
  assert.ok(m, 'no loss chart (figure#chart-loss) in the page');
  const svg = m[1]!;
  assert.match(svg, /^\s*<svg/, 'the loss chart is not an inline SVG');
  const lines = [...svg.matchAll(/<g clip-path="url\(#[^"]+\)">\s*<path d="M[^"]*L/g)].length;
  const legend = [...svg.matchAll(/<text[^>]*>([^<]*)<\/text>\s*<path[^>]*ecmeta_ssr_type="legend"/g)].map((x) => x[1]!);
  return { lines, legend };
}

/** Every file under a directory with its size and modification time. */
function snapshot(d: string): Map<string, string> {
  const out = new Map<string, string>();
  const walk = (p: string): void => {
    for (const e of readdirSync(p)) {
      const f = join(p, e);
      const st = statSync(f);
      if (st.isDirectory()) walk(f);
      else out.set(f, `${st.size}:${st.mtimeMs}`);
    }
  };
  walk(d);
  return out;
}

test('a 2-rank run writes its report; Chromium shows the charts; two runs overlay', async (t) => {
  chromiumPath(); // fail first, and clearly, where set-up has not installed it
  const runA = join(dir, 'runs', 'alpha');
  const runB = join(dir, 'runs', 'beta');
  // The second (one-process) run trains beside the first, in a directory of its own.
  const trainB = started(flotilla(['train', config, `--train.runDir=${runB}`, '--train.name=beta', '--optim.lr=1e-3']));
  const a = await flotilla(['train', config, '--nproc', '2', `--train.runDir=${runA}`, '--train.name=alpha']);
  assert.equal(a.code, 0, a.out);
  const reportA = join(runA, 'report.html');
  assert.match(a.out, /\[report\] \S*runs\/alpha\/report\.html/, `train did not print the report's path:\n${a.out}`);
  const htmlA = readFileSync(reportA, 'utf8');
  assert.doesNotMatch(htmlA, /<script|https?:\/\/(?!www\.w3\.org)/, 'the page must be self-contained (no script, nothing fetched)');

  await t.test('the single-run report in Chromium', () => {
    const dom = chromium(['--dump-dom'], reportA);
    const s = lossSeries(dom);
    assert.equal(s.lines, 2, 'loss chart: the train and val lines');
    assert.deepEqual(s.legend, ['alpha train', 'alpha val']);
    for (const id of ['chart-lr', 'chart-grad-norm', 'chart-tokens-per-sec']) assert.match(dom, new RegExp(`id="${id}" data-series="1"`), id);
    assert.match(dom, /data parallel 2/, 'the layout is shown');
    assert.match(dom, /\[optim\]/, 'the resolved config is shown');
    const shot = screenshot(reportA, 'alpha');
    const px = plotPixels(shot, RUN_COLORS.slice(0, 1));
    assert.ok(px.drawn > 300, `only ${px.drawn} drawn pixels in the loss plot area ${JSON.stringify(shot.plot)}`);
    assert.ok(px.perColor[0]! > 50, `only ${px.perColor[0]} pixels of alpha's colour in the loss plot`);
  });

  const b = await trainB;
  assert.equal(b.code, 0, b.out);

  await t.test('flotilla report A B overlays both runs; only report.html changes', async () => {
    const beforeA = snapshot(runA);
    const beforeB = snapshot(runB);
    const r = await flotilla(['report', runA, runB]);
    assert.equal(r.code, 0, r.out);
    assert.match(r.out, /report: \S*runs\/alpha\/report\.html/);
    const afterA = snapshot(runA);
    for (const [f, v] of beforeA) if (!f.endsWith('report.html')) assert.equal(afterA.get(f), v, `${f} changed`);
    assert.deepEqual(snapshot(runB), beforeB, 'the second run directory changed');

    const dom = chromium(['--dump-dom'], reportA);
    const s = lossSeries(dom);
    assert.equal(s.lines, 4, 'loss chart: train and val lines of both runs');
    assert.deepEqual(s.legend, ['alpha train', 'beta train', 'alpha val', 'beta val']);
    assert.match(dom, /id="chart-lr" data-series="2"/);
    const shot = screenshot(reportA, 'overlay');
    const px = plotPixels(shot, RUN_COLORS.slice(0, 2));
    assert.ok(px.drawn > 500, `only ${px.drawn} drawn pixels in the loss plot area`);
    px.perColor.forEach((n, k) => assert.ok(n > 50, `only ${n} pixels of run ${k}'s colour ${RUN_COLORS[k]} in the loss plot`));
  });
});

test.after(() => rmSync(dir, { recursive: true, force: true }));
