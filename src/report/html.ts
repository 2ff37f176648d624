// The report page: one self-contained HTML file (inline SVG charts and CSS, no script, nothing
// fetched when it is opened).
import { CHART_HEIGHT, CHART_WIDTH, metricCharts, renderChart } from './charts.js';
import type { RunData } from './run.js';

export function escapeHtml(s: string): string {
  return s.replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' })[c]!);
}

function fmt(v: number | undefined, digits = 4): string {
  if (v === undefined || !Number.isFinite(v)) return '–';
  return Math.abs(v) >= 1000 ? Math.round(v).toLocaleString('en-US') : v.toPrecision(digits);
}

function bytes(n: number): string {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${i === 0 ? n : n.toFixed(1)} ${units[i]}`;
}

export interface RunExtras {
  /** The layout in words (e.g. "data parallel 2, accumulate reduceLast"), when it could be worked out. */
  layout?: string;
  /** Trainable and frozen parameters in words (a LoRA run's adapters and base). */
  params?: string;
}

function summaryRow(r: RunData, extras: RunExtras): string {
  const m = r.metrics;
  const last = m[m.length - 1];
  const vals = m.filter((x) => x.valLoss !== undefined);
  const lastVal = vals[vals.length - 1]?.valLoss;
  const tps = m.length > 0 ? m.reduce((a, x) => a + x.tokensPerSec, 0) / m.length : undefined;
  const cells = [
    escapeHtml(r.name), String(last?.step ?? 0), fmt(m[0]?.loss), fmt(last?.loss), fmt(lastVal), fmt(tps),
    last ? `${last.elapsedS.toFixed(1)} s` : '–', r.worldSize !== undefined ? String(r.worldSize) : '–', escapeHtml(extras.layout ?? '–'),
  ];
  return `<tr>${cells.map((c) => `<td>${c}</td>`).join('')}</tr>`;
}

function runDetails(r: RunData, extras: RunExtras, open: boolean): string {
  const parts: string[] = [];
  parts.push(`<p class="dir">${escapeHtml(r.dir)}</p>`);
  if (extras.layout !== undefined || r.worldSize !== undefined) {
    parts.push(`<h3>Layout</h3><p>${r.worldSize !== undefined ? `${r.worldSize} rank(s): ` : ''}${escapeHtml(extras.layout ?? 'see [parallel] in the config below')}</p>`);
  }
  if (extras.params !== undefined) parts.push(`<h3>Parameters</h3><p>${escapeHtml(extras.params)}</p>`);
  if (r.checkpoints.length > 0) {
    const rows = r.checkpoints.map((c) => `<tr><td>${c.step}</td><td>${escapeHtml(c.dir)}</td><td>${bytes(c.bytes)}</td><td>${c.files}</td></tr>`).join('');
    parts.push(`<h3>Checkpoints</h3><table class="ckpt"><thead><tr><th>step</th><th>directory</th><th>size</th><th>files</th></tr></thead><tbody>${rows}</tbody></table>`);
  } else {
    parts.push('<h3>Checkpoints</h3><p class="none">none in this run directory</p>');
  }
  if (r.sample !== undefined) parts.push(`<h3>Sample</h3><pre class="sample">${escapeHtml(r.sample)}</pre>`);
  parts.push(r.configText !== undefined
    ? `<h3>Resolved config</h3><pre class="config">${escapeHtml(r.configText)}</pre>`
    : '<h3>Resolved config</h3><p class="none">no config.toml in this run directory</p>');
  return `<details class="run"${open ? ' open' : ''}><summary>${escapeHtml(r.name)}</summary>${parts.join('\n')}</details>`;
}

const CSS = `
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: ${CHART_WIDTH + 40}px; color: #222; background: #fff; }
h1 { font-size: 22px; margin-bottom: 4px; }
.sub { color: #666; margin-top: 0; }
.notes { background: #fff6e0; border: 1px solid #e6c36a; padding: 8px 14px; border-radius: 4px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0 16px; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: left; }
th { background: #f4f5f7; }
figure.chart { margin: 18px 0; width: ${CHART_WIDTH}px; height: ${CHART_HEIGHT}px; }
pre { background: #f7f7f9; border: 1px solid #e3e3e8; padding: 10px; font-size: 12px; overflow-x: auto; white-space: pre-wrap; }
.dir { color: #666; font-size: 12px; font-family: monospace; }
.none { color: #888; }
details.run { border-top: 1px solid #ddd; padding: 8px 0; }
details.run > summary { font-weight: 600; font-size: 16px; cursor: pointer; }
`;

/** The whole page for one run or several overlaid. */
export function renderReport(runs: readonly RunData[], extras: readonly RunExtras[], generatedAt: Date): string {
  const title = runs.length === 1 ? `flotilla run ${runs[0]!.name}` : `flotilla runs ${runs.map((r) => r.name).join(', ')}`;
  const notes = runs.flatMap((r) => r.notes.map((n) => (runs.length > 1 ? `${r.name}: ${n}` : n)));
  const charts = metricCharts(runs);
  const chartHtml = charts.length > 0
    ? charts.map((c) => `<figure class="chart" id="chart-${c.id}" data-series="${c.spec.series.length}">${renderChart(c.spec)}</figure>`).join('\n')
    : '<p class="none">No steps recorded yet: nothing to chart.</p>';
  return `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>${escapeHtml(title)}</title>
<style>${CSS}</style>
</head>
<body>
<h1>${escapeHtml(title)}</h1>
<p class="sub">Report written ${escapeHtml(generatedAt.toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC'))} by <code>flotilla report</code>.</p>
${notes.length > 0 ? `<div class="notes">${notes.map((n) => `<p>${escapeHtml(n)}</p>`).join('')}</div>` : ''}
<table class="summary"><thead><tr><th>run</th><th>steps</th><th>first loss</th><th>last loss</th><th>last val loss</th><th>mean tokens/s</th><th>time</th><th>ranks</th><th>layout</th></tr></thead>
<tbody>${runs.map((r, i) => summaryRow(r, extras[i] ?? {})).join('')}</tbody></table>
${chartHtml}
<h2>Runs</h2>
${runs.map((r, i) => runDetails(r, extras[i] ?? {}, runs.length === 1)).join('\n')}
</body>
</html>
`;
}
