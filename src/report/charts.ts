// The report's charts: Apache ECharts rendered in this process to SVG strings (its server-side
// renderer), so the page needs no script and no network to show them.
import { createRequire } from 'node:module';
import type * as EChartsModule from 'echarts';
import type { StepMetrics } from '../train/metrics.js';

// The package's single-file CommonJS build: its ESM entry is hundreds of small modules, which took
// over a second to load at the end of every run (0.25 s this way). Required at the first chart, not
// when this module loads: rank 0 of `flotilla train` loads the report code at the start of a run (so
// that an exiting process can still write the report synchronously), and ECharts' 3.7 MB of
// JavaScript held about 60 MiB of rank 0's memory through the whole run (V8's heap grew from 14 to
// 60 MiB), which no other rank has. require() is synchronous, so the exit path still works.
let echartsModule: typeof EChartsModule | undefined;
function echarts(): typeof EChartsModule {
  return (echartsModule ??= createRequire(import.meta.url)('echarts') as typeof EChartsModule);
}

export interface ChartSeries {
  name: string;
  color: string;
  points: [number, number][];
  /** Draw every point as a dot (sparse series such as validation loss). */
  dots?: boolean;
  dashed?: boolean;
}

export interface ChartSpec {
  title: string;
  yName: string;
  series: ChartSeries[];
  logY?: boolean;
}

export const CHART_WIDTH = 860;
export const CHART_HEIGHT = 340;
/** More points than a chart this wide can show are thinned to about this many, keeping the last. */
const MAX_POINTS = 2000;

function thin(points: [number, number][]): [number, number][] {
  if (points.length <= MAX_POINTS) return points;
  const stride = Math.ceil(points.length / MAX_POINTS);
  const out = points.filter((_, i) => i % stride === 0);
  if (out[out.length - 1] !== points[points.length - 1]) out.push(points[points.length - 1]!);
  return out;
}

/** One chart as a standalone <svg> element. */
export function renderChart(spec: ChartSpec): string {
  const chart = echarts().init(null, null, { renderer: 'svg', ssr: true, width: CHART_WIDTH, height: CHART_HEIGHT });
  try {
    chart.setOption({
      animation: false,
      title: { text: spec.title, left: 'center', textStyle: { fontSize: 15 } },
      legend: { bottom: 0, type: 'plain' },
      grid: { left: 70, right: 30, top: 45, bottom: 70 },
      xAxis: { type: 'value', name: 'step', nameLocation: 'middle', nameGap: 28, minInterval: 1, scale: true },
      yAxis: { type: spec.logY ? 'log' : 'value', name: spec.yName, scale: true, splitLine: { show: true } },
      series: spec.series.map((s) => ({
        name: s.name,
        type: 'line',
        data: thin(s.points),
        showSymbol: s.dots === true,
        symbolSize: 5,
        color: s.color,
        lineStyle: { width: 2, color: s.color, ...(s.dashed ? { type: 'dashed' } : {}) },
        connectNulls: true,
      })),
    });
    return chart.renderToSVGString();
  } finally {
    chart.dispose();
  }
}

/** One colour per run (its train and validation series share it); Tableau's 10, distinct from the axes' greys. */
export const RUN_COLORS = ['#4e79a7', '#f28e2b', '#e15759', '#76b7b2', '#59a14f', '#edc948', '#b07aa1', '#ff9da7', '#9c755f', '#bab0ac'];

export interface NamedMetrics {
  name: string;
  metrics: StepMetrics[];
}

/** The colour 40% of the way to black. */
function darker(hex: string): string {
  const c = [1, 3, 5].map((k) => Math.round(parseInt(hex.slice(k, k + 2), 16) * 0.6));
  return `#${c.map((v) => v.toString(16).padStart(2, '0')).join('')}`;
}

function series(runs: readonly NamedMetrics[], pick: (m: StepMetrics) => number | undefined, suffix = ''): ChartSeries[] {
  return runs
    .map((r, i) => ({
      name: `${r.name}${suffix}`,
      color: RUN_COLORS[i % RUN_COLORS.length]!,
      points: r.metrics.flatMap((m): [number, number][] => {
        const v = pick(m);
        return v !== undefined && Number.isFinite(v) ? [[m.step, v]] : [];
      }),
    }))
    .filter((s) => s.points.length > 0);
}

/** The series whose values are not all the same (none when every run's are constant). */
function varying<S extends { points: [number, number][] }>(all: S[]): S[] {
  return all.some((s) => s.points.some(([, v]) => v !== s.points[0]![1])) ? all : [];
}

/** max / mean of the tokens per expert, the largest over a step's MoE blocks (undefined without experts). */
export function expertImbalance(m: StepMetrics): number | undefined {
  let worst: number | undefined;
  for (const counts of Object.values(m.expertTokens ?? {})) {
    const mean = counts.reduce((a, b) => a + b, 0) / counts.length;
    if (mean > 0) worst = Math.max(worst ?? 0, Math.max(...counts) / mean);
  }
  return worst;
}

/** The report's charts for one run or several overlaid (each series named by its run). */
export function metricCharts(runs: readonly NamedMetrics[]): { id: string; spec: ChartSpec }[] {
  // Validation in a darker shade of its run's colour, dashed with dots: it stands out on the train line.
  const val = series(runs, (m) => m.valLoss, ' val').map((s) => ({ ...s, color: darker(s.color), dots: true, dashed: true }));
  const specs: { id: string; spec: ChartSpec }[] = [
    { id: 'loss', spec: { title: 'Training and validation loss', yName: 'loss', series: [...series(runs, (m) => m.loss, ' train'), ...val] } },
    { id: 'lr', spec: { title: 'Learning rate', yName: 'lr', series: series(runs, (m) => m.lr) } },
    { id: 'grad-norm', spec: { title: 'Gradient norm (before clipping)', yName: 'norm', series: series(runs, (m) => m.gradNorm) } },
    { id: 'tokens-per-sec', spec: { title: 'Throughput', yName: 'tokens/s', series: series(runs, (m) => m.tokensPerSec) } },
    // Model FLOPs utilisation: each rank's model TFLOP/s over its peak (src/train/flops.ts).
    { id: 'mfu', spec: { title: 'Model FLOPs utilisation (per rank)', yName: 'MFU %', series: series(runs, (m) => (m.mfu === undefined ? undefined : 100 * m.mfu)) } },
    // Masked data (chat, completion, packed): trained tokens vary from step to step; a text run's never do, and gets no chart.
    { id: 'trained-tokens', spec: { title: 'Trained tokens per step', yName: 'tokens', series: varying(series(runs, (m) => m.trainedTokens)) } },
    // DPO: the chosen responses' reward over the rejected ones' (beta x log-ratio to the reference), and how often it is positive.
    { id: 'dpo-margin', spec: { title: 'DPO reward margin (chosen - rejected)', yName: 'margin', series: series(runs, (m) => m.rewardsMargin) } },
    { id: 'dpo-accuracy', spec: { title: 'DPO pairwise accuracy (chosen reward > rejected)', yName: 'share of pairs', series: series(runs, (m) => m.rewardsAccuracy) } },
    // Mixture of experts: the busiest expert's load over the mean (1 = balanced), the worst MoE block each step.
    { id: 'expert-load', spec: { title: 'Expert load: max / mean tokens per expert (worst MoE block)', yName: 'max / mean', series: series(runs, expertImbalance) } },
    { id: 'aux-loss', spec: { title: 'MoE auxiliary loss (sum over blocks)', yName: 'aux loss', series: series(runs, (m) => m.auxLoss) } },
    { id: 'dropped-tokens', spec: { title: 'MoE assignments dropped by capacity', yName: 'assignments', series: series(runs, (m) => m.droppedTokens) } },
  ];
  return specs.filter((c) => c.spec.series.length > 0);
}
