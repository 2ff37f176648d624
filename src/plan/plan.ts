// `flotilla plan`: enumerate the layouts (enumerate.ts), measure what the model needs on this
// machine (calibrate.ts, cached), predict every layout's peak memory and step time (predict.ts),
// rank them by step time, and optionally train the first K to show predicted beside measured.
import { totalmem } from 'node:os';
import type { FlotillaConfig } from '../config/schema.js';
import { enumerateLayouts, overridesOf, FIELD_SECTION, LAYOUT_FIELDS, type Candidate } from './enumerate.js';
import { modelFacts } from './facts.js';
import { probeFlags, calibrateBaseline, calibrateInStep, calibrateComm } from './calibrate.js';
import { calibrateCompute, type ComputePoint, type PartTiming } from './calibrate_compute.js';
import { loadConfig } from '../config/index.js';
import { budgetOf, computeScaleOf, contextFor, inStepCosts, machineCores, pointOf, predict, type Measurements, type Prediction, type World } from './predict.js';
import { MEASURE_STEPS, measureLayout, type Measured } from './measure.js';
import type { CalibrationPoint } from './calibrate_model.js';
import { IN_STEP_PROBES, type PlanLayout } from '../distributed/plan_terms.js';
import type { PlanField } from './terms.js';

const MiB = 2 ** 20;
export const DEFAULT_ROUNDS = 3;

export interface PlanOptions {
  /** The config file and the flags given with it (they also pin those fields). */
  config: string;
  overrides: readonly string[];
  nproc: number;
  nnodes: number;
  /** Memory per rank, GiB (default: this machine's memory over its ranks). */
  memoryGiB?: number;
  /** Fresh launches per measurement, the median kept ([Note: launches] in measure.ts; default 3). */
  rounds?: number;
  /** Layouts to price instead of every one (bench/plan.ts). */
  candidates?: Candidate[];
  log?: (line: string) => void;
}

export interface PlanRow {
  layout: PlanLayout;
  overrides: string[];
  peakMemoryMiB: number;
  stepMs: number;
  fits: boolean;
  /** The peak rank's memory by term (MiB), per pipeline stage when they differ. */
  memoryMiB: Record<string, number>;
  stageMemoryMiB: number[];
  time: Prediction['time'];
  /** Step time priced with this host's collectives for groups that span hosts (a lower bound). */
  unmeasured: string[];
  measured?: { peakMemoryMiB: number; rankMemoryMiB: number[]; stepMs: number; steps?: number[]; launchMs?: number[] };
}

export interface PlanResult {
  rows: PlanRow[];
  memoryLimitMiB: number;
  world: World;
  numParams: number;
}

/** The layout fields the command line pins ("--parallel.zero=3" keeps zero at 3). */
export function pinnedFields(overrides: readonly string[]): Set<PlanField> {
  const out = new Set<PlanField>();
  for (const o of overrides) {
    const m = /^--(\w+)\.(\w+)=/.exec(o);
    if (m && (LAYOUT_FIELDS as string[]).includes(m[2]!) && FIELD_SECTION[m[2] as keyof PlanLayout] === m[1]) out.add(m[2] as PlanField);
    else if (m && m[1] === 'parallel') out.add(m[2] as PlanField);
  }
  return out;
}

/** Calibration shapes: per (tokens, precision, checkpointing), the fewest and the most samples (linear between). */
function calibrationPoints(needed: CalibrationPoint[]): CalibrationPoint[] {
  const groups = new Map<string, CalibrationPoint[]>();
  for (const p of needed) {
    const k = `${p.tokens}:${p.precision}:${p.activationCheckpoint}`;
    groups.set(k, [...(groups.get(k) ?? []), p]);
  }
  const out: CalibrationPoint[] = [];
  for (const ps of groups.values()) {
    const samples = [...new Set(ps.map((p) => p.samples))].sort((a, b) => a - b);
    for (const s of new Set([samples[0]!, samples[samples.length - 1]!])) out.push({ ...ps[0]!, samples: s });
  }
  return out;
}

/** The calibrated points of p's tokens, precision and checkpointing, by samples. */
function sameShape(points: ComputePoint[], p: CalibrationPoint): ComputePoint[] {
  return points.filter((q) => q.tokens === p.tokens && q.precision === p.precision && q.activationCheckpoint === p.activationCheckpoint).sort((a, b) => a.samples - b.samples);
}

/** Whether interpolate can price p: its samples were calibrated, or two sample counts of its shape were. */
function covers(points: ComputePoint[], p: CalibrationPoint): boolean {
  const same = sameShape(points, p);
  return same.some((q) => q.samples === p.samples) || new Set(same.map((q) => q.samples)).size > 1;
}

function interpolate(points: ComputePoint[]): (p: CalibrationPoint) => ComputePoint {
  return (p) => {
    const same = sameShape(points, p);
    const exact = same.find((q) => q.samples === p.samples);
    if (exact) return exact;
    const lo = same[0]!, hi = same[same.length - 1]!;
    const f = (p.samples - lo.samples) / (hi.samples - lo.samples);
    const mix = (a: PartTiming, b: PartTiming): PartTiming => ({ fwdMs: a.fwdMs + f * (b.fwdMs - a.fwdMs), bwdMs: a.bwdMs + f * (b.bwdMs - a.bwdMs), actBytes: a.actBytes + f * (b.actBytes - a.actBytes) });
    return { ...p, block: mix(lo.block, hi.block), rest: mix(lo.rest, hi.rest) };
  };
}

/** Predicts every layout (or the given ones) and ranks them by step time. */
export async function plan(cfg: FlotillaConfig, o: PlanOptions): Promise<PlanResult> {
  const log = o.log ?? (() => {});
  const world: World = { nproc: o.nproc, nnodes: o.nnodes };
  const size = o.nproc * o.nnodes;
  const candidates = o.candidates ?? enumerateLayouts(cfg, size, pinnedFields(o.overrides));
  if (candidates.length === 0) return { rows: [], memoryLimitMiB: 0, world, numParams: 0 };
  const facts = modelFacts(cfg);
  const needed = candidates.map((c) => pointOf(cfg, c.layout));
  const rounds = o.rounds ?? DEFAULT_ROUNDS;
  const compute = await calibrateCompute(cfg, calibrationPoints(needed), o.nproc, rounds, log);
  const comm = await calibrateComm(cfg, o.nproc, log);
  const baseline = await calibrateBaseline(o.config, cfg, o.overrides, o.nproc, rounds, log);
  const m: Measurements = { compute: interpolate(compute.points), optimizerNsPerParam: compute.optimizerNsPerParam, comm, baseline, cores: machineCores() };
  // The probes the candidates need: the in-step collectives their axes describe (stage 0 has them all).
  const tagged = new Set(candidates.flatMap((c) => budgetOf(contextFor(cfg, c.layout, facts, world, 0)).comm.map((op) => op.inStep)));
  // Each probe is measured against the same model under plain data parallelism ('dp', measured first),
  // which also gives the trainer's pace ([Note: trainer's pace] in predict.ts).
  const probes = IN_STEP_PROBES.filter((p) => tagged.has(p));
  const inStep = await calibrateInStep(o.config, cfg, o.overrides, o.nproc, ['dp', ...probes], rounds, log);
  if (inStep.length > 0) {
    const one = loadConfig(o.config, [...o.overrides, ...probeFlags(cfg)]);
    const oneFacts = modelFacts(one);
    const calibrated = (p: CalibrationPoint): boolean => covers(compute.points, p);
    const ref = inStep.find((r) => r.probe === 'dp');
    if (ref && calibrated(pointOf(one, ref.layout))) {
      m.computeScale = computeScaleOf(ref, one, oneFacts, world, m);
      log(`[plan] the model's compute in a training run: ${m.computeScale.toFixed(2)}x its calibrated time`);
    }
    m.inStepCallMs = inStepCosts(inStep, one, oneFacts, world, m, calibrated);
    const said = Object.entries(m.inStepCallMs).map(([k, v]) => `${k} ${v.toFixed(2)} ms`);
    if (said.length > 0) log(`[plan] collectives inside the step cost beyond the table, per call: ${said.join(', ')}`);
  }
  const limit = (o.memoryGiB !== undefined ? o.memoryGiB * 1024 : totalmem() / MiB / o.nproc);
  const rows = candidates.map((c): PlanRow => {
    const p = predict(cfg, c.layout, facts, world, m);
    const peak = p.stages.reduce((a, s) => (s.peakBytes > a.peakBytes ? s : a));
    return {
      layout: c.layout, overrides: c.overrides, peakMemoryMiB: p.peakBytes / MiB, stepMs: p.stepMs, fits: p.peakBytes / MiB <= limit,
      memoryMiB: Object.fromEntries(Object.entries(peak.terms).map(([k, v]) => [k, v / MiB])), stageMemoryMiB: p.stages.map((s) => s.peakBytes / MiB), time: p.time, unmeasured: p.unmeasured,
    };
  });
  rows.sort((a, b) => a.stepMs - b.stepMs);
  return { rows, memoryLimitMiB: limit, world, numParams: facts.numParams };
}

/** Trains the first K layouts that fit for a few steps each, `rounds` times, and records the median run. */
export async function measureTop(r: PlanResult, o: PlanOptions, k: number, steps = MEASURE_STEPS): Promise<void> {
  const log = o.log ?? (() => {});
  if (o.nnodes > 1) throw new Error('--measure trains on this host only: drop --nnodes (or plan without --measure)');
  const launches = o.rounds ?? DEFAULT_ROUNDS;
  for (const row of r.rows.filter((x) => x.fits).slice(0, k)) {
    log(`[plan] measuring ${describePlanLayout(row.layout)} (${steps} steps, ${launches} launch(es))`);
    const m: Measured = await measureLayout(o.config, [...o.overrides, ...row.overrides], o.nproc, { steps, launches });
    row.measured = { peakMemoryMiB: Math.max(...m.peakMiB), rankMemoryMiB: m.peakMiB, stepMs: m.stepMs, steps: m.steps, launchMs: m.launchMs };
  }
}

/** A layout in a few words: what differs from plain data parallelism. */
export function describePlanLayout(l: PlanLayout): string {
  const parts: string[] = [];
  if (l.pp > 1) parts.push(`pp${l.pp} ${l.ppSchedule}${l.ppVirtualStages > 1 ? ` v${l.ppVirtualStages}` : ''}`);
  if (l.tp > 1) parts.push(`tp${l.tp}${l.sequenceParallel ? '+sp' : ''}`);
  if (l.cp > 1) parts.push(`cp${l.cp}`);
  if (l.ep > 1) parts.push(`ep${l.ep}`);
  parts.push(l.zero === 0 ? `dp${l.dp}` : `zero${l.zero} dp${l.dp}${l.dpReplicate > 1 ? ` (${l.dpReplicate}x${l.dpShard} HSDP)` : ''}`);
  parts.push(`mb${l.microBatches}`);
  if (l.activationCheckpoint !== 'none') parts.push(`ckpt ${l.activationCheckpoint}`);
  if (l.precision !== 'fp32') parts.push('bf16');
  return parts.join(' ');
}

/** The flags of a layout that change the config (enough, applied to that config, to select it). */
export function changedOverrides(cfg: FlotillaConfig, l: PlanLayout): string[] {
  const base = overridesOf(cfg, l);
  return base.filter((f) => {
    const m = /^--(\w+)\.(\w+)=(.*)$/.exec(f)!;
    const cur = (cfg as unknown as Record<string, Record<string, unknown>>)[m[1]!]![m[2]!];
    return String(cur) !== m[3];
  });
}

/** The ranked table `flotilla plan` prints. */
export function formatPlan(cfg: FlotillaConfig, r: PlanResult, top: number, config = 'CONFIG'): string {
  const lines: string[] = [];
  const { nproc, nnodes } = r.world;
  lines.push(`${r.rows.length} layout(s) of a ${(r.numParams / 1e6).toFixed(2)}M-parameter ${cfg.model.arch} on ${nproc * nnodes} rank(s)${nnodes > 1 ? ` (${nnodes} hosts x ${nproc})` : ''}, ranked by predicted step time; memory per rank ${r.memoryLimitMiB.toFixed(0)} MiB`);
  const measured = r.rows.some((x) => x.measured);
  const head = ['#', 'step ms', 'peak MiB', 'fits', ...(measured ? ['measured ms', 'measured MiB'] : []), 'layout', 'flags (beyond the config)'];
  const body = r.rows.slice(0, top).map((x, i) => [
    String(i + 1), `${x.unmeasured.length > 0 ? '>=' : ''}${x.stepMs.toFixed(0)}`, x.peakMemoryMiB.toFixed(0), x.fits ? 'yes' : 'NO',
    ...(measured ? [x.measured ? `${x.measured.stepMs.toFixed(0)} (${pct(x.stepMs, x.measured.stepMs)})` : '', x.measured ? `${x.measured.peakMemoryMiB.toFixed(0)} (${pct(x.peakMemoryMiB, x.measured.peakMemoryMiB)})` : ''] : []),
    describePlanLayout(x.layout), changedOverrides(cfg, x.layout).join(' ') || '(the config as it is)',
  ]);
  const widths = head.map((h, c) => Math.max(h.length, ...body.map((row) => row[c]!.length)));
  const fmt = (row: string[]) => row.map((v, c) => (c === row.length - 1 ? v : v.padEnd(widths[c]!))).join('  ');
  lines.push(fmt(head), ...body.map(fmt));
  if (r.rows.length > top) lines.push(`... ${r.rows.length - top} more (--top K shows more, --json all)`);
  const best = r.rows.find((x) => x.fits);
  lines.push(best ? `best: ${describePlanLayout(best.layout)}: flotilla train ${config} --nproc ${nproc}${nnodes > 1 ? ` --nnodes ${nnodes} (on every host, with its --node-rank)` : ""} ${changedOverrides(cfg, best.layout).join(' ')}`.trimEnd() : 'no layout fits in the memory given; raise --memory or add ranks');
  if (r.rows.some((x) => x.unmeasured.length > 0)) {
    lines.push('>= : groups across hosts are priced with this host\'s collective times (cross-host links are not measured by flotilla plan on one host), so those step times are lower bounds.');
  }
  return lines.join('\n');
}

const pct = (pred: number, meas: number): string => `${pred >= meas ? '+' : ''}${(((pred - meas) / meas) * 100).toFixed(0)}%`;

/** `--json`: one object per layout. */
export function planJson(r: PlanResult): object[] {
  return r.rows.map((x) => ({
    layout: x.layout, overrides: x.overrides, peakMemoryMiB: round(x.peakMemoryMiB), stepMs: round(x.stepMs), fits: x.fits,
    memoryMiB: Object.fromEntries(Object.entries(x.memoryMiB).map(([k, v]) => [k, round(v)])), stageMemoryMiB: x.stageMemoryMiB.map(round),
    time: Object.fromEntries(Object.entries(x.time).map(([k, v]) => [k, round(v)])), ...(x.unmeasured.length > 0 ? { unmeasured: x.unmeasured } : {}),
    ...(x.measured ? { measured: { peakMemoryMiB: round(x.measured.peakMemoryMiB), rankMemoryMiB: x.measured.rankMemoryMiB.map(round), stepMs: round(x.measured.stepMs), ...(x.measured.steps ? { steps: x.measured.steps.map(round) } : {}), ...(x.measured.launchMs ? { launchMs: x.measured.launchMs.map(round) } : {}) } } : {}),
  }));
}

const round = (x: number): number => Math.round(x * 10) / 10;
