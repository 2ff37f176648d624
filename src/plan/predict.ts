// From a layout to bytes and milliseconds: fold the axes' descriptions into each pipeline stage's
// RankBudget ([Note: plan terms]), then price them with what this machine measured (calibrate.ts).
//
// Memory (per rank, at its peak): the larger of the start-up's high-water mark and the baseline + parameters + gradients + optimizer state + ZeRO-3
// gathers in flight + bf16 copies + communication buffers + activations of one micro-batch (its
// blocks' and, on the rank with the head, the rest's; measured under the layout's precision and
// checkpointing) x the micro-batches the schedule keeps alive.
// Time (per step): the slowest stage's forward and backward per micro-batch, over the schedule's
// simulated timeline for a pipeline (its bubbles included) or micro-batches x (forward + backward)
// without one; plus the collectives' times from the table (hidden behind backward only when this
// host has a core left over for them: on a host whose cores all compute, a collective takes a core
// from the step); plus the optimizer and gradient-norm pass over the parameters this rank updates;
// plus the loop's own cost per step. A collective issued in pieces (buckets, ZeRO-3 units) pays each
// piece's latency, and each ZeRO-3 unit call also its measured bookkeeping (calibrate.ts, baseline).
// The compute times were measured with as many processes
// running at once as the host runs ranks, so ranks that outnumber the cores are in them (a
// pipeline's bubbles give cores back: [Note: shared cores]).
//
// [Note: in-step collectives] A collective that the rank's compute waits on where it is issued
// (tensor and sequence parallelism's sums and gathers, context parallelism's ring, ZeRO-2's buckets)
// costs more in a step than the table's time for idle ranks: the ranks reach it at different moments
// and the slower one's lead is waited out, each time. The table cannot see that, so it is measured:
// calibrateInStep trains a 3-block model of the config's width under each such layout the candidates
// use (tp, tp + sp, cp on 2 ranks of the world, ZeRO-2) and, just before, under plain data
// parallelism (the reference, 'dp'). inStepCosts prices the same runs with this model; what a probe
// exceeds its price by, less what the reference exceeds its own by, over the probe's in-step calls,
// is what each such call costs beyond the table (0 when it comes out below). Tensor parallelism
// predicted without it was 16-39% short. The reference takes out what is not the collectives': the
// probe model's own mispricing (its compute, the loop) and the machine's speed in those minutes,
// which a probe alone charged to its calls (the 25M GPT on 2 ranks: the reference measured 233 ms
// over its price, spread over its 2 buckets a 117 ms "cost" per call that priced plain dp at 1.9x).
import { cpus } from 'node:os';
import { buildSchedule, simulate } from '../parallel/pipeline/schedule.js';
import { configuredBucketSizeMb } from '../parallel/layout.js';
import type { FlotillaConfig } from '../config/schema.js';
import { PLAN_AXES } from './axes.js';
import { commMs, type Baseline, type CommTable, type InStepRun } from './calibrate.js';
import type { ComputePoint, PartTiming } from './calibrate_compute.js';
import type { CalibrationPoint } from './calibrate_model.js';
import { MEMORY_TERMS, type InStepProbe, type MemoryTerm, type ModelFacts, type PlanContext, type PlanLayout, type RankBudget } from '../distributed/plan_terms.js';
import { wholeModel } from './terms.js';

export interface World {
  nproc: number;
  nnodes: number;
}

export interface Prediction {
  /** Peak resident bytes of each pipeline stage's ranks, by term, and their sum (or the start-up's mark when higher). */
  stages: { stage: number; terms: Record<MemoryTerm, number>; peakBytes: number }[];
  peakBytes: number;
  stepMs: number;
  time: { computeMs: number; commMs: number; optimizerMs: number; loopMs: number };
  /** Collectives over groups that span hosts: priced with this host's table, which does not measure them. */
  unmeasured: string[];
}

export function contextFor(cfg: FlotillaConfig, layout: PlanLayout, facts: ModelFacts, w: World, stageRank: number): PlanContext {
  const p = cfg.parallel;
  return {
    layout, world: w.nproc * w.nnodes, ranksPerHost: w.nproc, stageRank, model: facts, globalBatch: cfg.data.globalBatch, seqLen: cfg.data.seqLen,
    bucketBytes: configuredBucketSizeMb(p.bucketSizeMb, layout.zero) * 2 ** 20, reduceDtype: p.reduceDtype, overlap: p.overlap, accumulate: p.accumulate, reshardAfterForward: p.reshardAfterForward, lossParallel: p.lossParallel,
  };
}

/** One stage's budget: every axis applied in mesh order. */
export function budgetOf(ctx: PlanContext): RankBudget {
  const b = wholeModel(ctx);
  for (const axis of PLAN_AXES) axis.apply(b, ctx);
  return b;
}

/** The calibration shape a layout's ranks compute at. */
export function pointOf(cfg: FlotillaConfig, l: PlanLayout): CalibrationPoint {
  return { samples: cfg.data.globalBatch / (l.dp * l.microBatches), tokens: cfg.data.seqLen / l.cp, precision: l.precision, activationCheckpoint: l.activationCheckpoint };
}

export interface Measurements {
  compute: (p: CalibrationPoint) => ComputePoint;
  optimizerNsPerParam: number;
  comm: CommTable;
  baseline: Baseline;
  cores: number;
  /** What each in-step collective call costs beyond the table, per probe ([Note: in-step collectives]; inStepCosts). */
  inStepCallMs?: Partial<Record<InStepProbe, number>>;
  /** The compute's pace in a training run over its calibrated pace ([Note: trainer's pace]; computeScaleOf); 1 when not measured. */
  computeScale?: number;
}

export function predict(cfg: FlotillaConfig, layout: PlanLayout, facts: ModelFacts, w: World, m: Measurements): Prediction {
  const cal = m.compute(pointOf(cfg, layout));
  const spare = m.cores > w.nproc * cfg.train.threads; // a core free for collectives to overlap on
  const stages = [];
  const unmeasured = new Set<string>();
  let slowest = { fwd: 0, bwd: 0 }, comm = 0, optimizer = 0;
  for (let s = 0; s < layout.pp; s++) {
    const b = budgetOf(contextFor(cfg, layout, facts, w, s));
    const share = (t: PartTiming, k: keyof PartTiming, act = false): number =>
      b.blocks * t[k] * (act ? b.activationShare : b.blockShare);
    const rest = (k: keyof PartTiming, act = false): number => (b.head ? cal.rest[k] * (act ? b.activationShare : b.blockShare) : 0);
    const fwd = (share(cal.block, 'fwdMs') + rest('fwdMs'));
    const bwd = (share(cal.block, 'bwdMs') + rest('bwdMs'));
    if (fwd + bwd > slowest.fwd + slowest.bwd) slowest = { fwd, bwd };
    const terms = { ...b.memory };
    terms.baseline = m.baseline.bytes;
    // The calibrated activations of the live micro-batches, and what axes keep besides (b.memory.activations).
    terms.activations += (share(cal.block, 'actBytes', true) + b.blocks * b.blockActivationBytes + rest('actBytes', true)) * b.liveMicroBatches;
    // Starting up (the data, the libraries) may reach higher than the loop ever does.
    const peakBytes = Math.max(m.baseline.startupBytes, MEMORY_TERMS.reduce((a, t) => a + terms[t], 0));
    stages.push({ stage: s, terms, peakBytes });
    let c = 0;
    let hideable = 0;
    for (const op of b.comm) {
      if (op.crossHost) unmeasured.add(`${op.op} over ${op.group} ranks across hosts (${op.what})`);
      const calls = op.calls ?? 1;
      const zero3Own = op.zero3Unit ? calls * m.baseline.zero3CallMs + (m.baseline.zero3MsPerMiB * op.bytes) / 2 ** 20 : 0;
      const t = (calls * commMs(m.comm, op.op, op.group, op.bytes / calls) + zero3Own) * op.times;
      c += t + (op.inStep ? calls * op.times * (m.inStepCallMs?.[op.inStep] ?? 0) : 0); // the waiting is never hidden
      if (op.overlaps === 'backward' && spare) hideable += t;
    }
    c -= Math.min(hideable, bwd * layout.microBatches);
    comm = Math.max(comm, c);
    optimizer = Math.max(optimizer, (m.optimizerNsPerParam * b.optimizerHeld) / 1e6);
  }
  let computeMs: number;
  if (layout.pp > 1) {
    // [Note: shared cores] The compute was calibrated with every rank of the host computing at once;
    // where ranks outnumber the cores each ran `crowd` times slower than alone. A pipeline's ranks
    // are not all busy at once (its bubbles), and a rank alone on a core runs at its own speed: the
    // timeline is simulated at that speed, and the step is the longer of it and the host's whole
    // work spread over its cores.
    const crowd = Math.max(1, (w.nproc * cfg.train.threads) / m.cores);
    const alone = { fwd: slowest.fwd / crowd, bwd: slowest.bwd / crowd };
    // The schedule's own timeline with this stage's costs, in slots of an eighth of a forward.
    const slot = Math.max(alone.fwd / 8, 1e-3);
    const F = Math.max(1, Math.round(alone.fwd / slot)), B = Math.max(2, Math.round(alone.bwd / slot));
    const v = layout.ppSchedule === 'interleaved' ? layout.ppVirtualStages : 1;
    const sched = buildSchedule(layout.ppSchedule, { pp: layout.pp, micro: layout.microBatches, ...(v > 1 ? { virtualStages: v } : {}) });
    // Interleaving runs each of a rank's v stages as its own unit: a stage is 1 / v of the rank's work.
    const f = Math.max(1, Math.round(F / v)), bb = Math.max(2, Math.round(B / v));
    const sim = simulate(sched, { F: f, B: bb, I: Math.max(1, Math.round(bb / 2)), W: Math.max(1, bb - Math.round(bb / 2)) });
    const busy = sim.idle.reduce((a, idle) => a + sim.makespan - idle, 0) / layout.pp; // a rank's compute slots, on average
    computeMs = Math.max(sim.makespan, busy * crowd) * slot;
  } else {
    computeMs = layout.microBatches * (slowest.fwd + slowest.bwd);
  }
  const peakBytes = Math.max(...stages.map((s) => s.peakBytes));
  computeMs *= m.computeScale ?? 1; // [Note: trainer's pace]
  const loopMs = m.baseline.stepMs;
  return { stages, peakBytes, stepMs: computeMs + comm + optimizer + loopMs, time: { computeMs, commMs: comm, optimizerMs: optimizer, loopMs }, unmeasured: [...unmeasured] };
}

export const machineCores = (): number => cpus().length;

/**
 * [Note: trainer's pace] The compute is calibrated in processes that do nothing else
 * (calibrate_model.ts, as many at once as the host runs ranks). In a training run the same forward
 * and backward take longer: the ranks meet at each gradient bucket and wait out the slower one, and
 * on a host with no spare core the collectives' own work, the loader and the trainer's bookkeeping
 * take their time from it. The in-step probes' reference (the probe model under plain data
 * parallelism, measured through `flotilla train`) shows by how much: its measured step less the
 * price of everything but its compute, over its priced compute, scales every layout's compute on
 * these ranks. Without it the 25M GPT on 2 ranks was priced 6-30% under every layout's measurement
 * in one run (its dp2 at 1024 ms against 1154 measured; two processes of the same per-rank step at
 * once, without collectives, ran 1040, as calibrated).
 * Kept within [0.5, 2]: a reference run outside that measured something else.
 */
export function computeScaleOf(ref: InStepRun, one: FlotillaConfig, oneFacts: ModelFacts, w: World, m: Measurements): number {
  const p = predict(one, ref.layout, oneFacts, w, { ...m, inStepCallMs: {}, computeScale: 1 });
  if (!(p.time.computeMs > 0)) return 1;
  return Math.min(2, Math.max(0.5, (ref.stepMs - (p.stepMs - p.time.computeMs)) / p.time.computeMs));
}

/**
 * What each in-step collective call costs beyond the table ([Note: in-step collectives]): the probe
 * runs of calibrate.ts (the probe model `one` of the config's width, its facts `oneFacts`), priced
 * with `m` as it is, their shortfall beyond the reference run's ('dp'), over their in-step calls. A
 * run whose compute shape was not calibrated (`calibrated` false) is left out (without the
 * reference, a probe's own shortfall is charged).
 */
export function inStepCosts(runs: readonly InStepRun[], one: FlotillaConfig, oneFacts: ModelFacts, w: World, m: Measurements, calibrated: (p: CalibrationPoint) => boolean): Partial<Record<InStepProbe, number>> {
  const shortfall = (run: InStepRun): number | undefined =>
    (calibrated(pointOf(one, run.layout)) ? run.stepMs - predict(one, run.layout, oneFacts, w, { ...m, inStepCallMs: {} }).stepMs : undefined);
  const ref = runs.find((r) => r.probe === 'dp');
  const refShortfall = (ref && shortfall(ref)) ?? 0;
  const out: Partial<Record<InStepProbe, number>> = {};
  for (const run of runs) {
    if (run.probe === 'dp') continue;
    const own = shortfall(run);
    if (own === undefined) continue;
    const b = budgetOf(contextFor(one, run.layout, oneFacts, w, 0));
    const calls = b.comm.filter((op) => op.inStep === run.probe).reduce((a, op) => a + (op.calls ?? 1) * op.times, 0);
    if (calls > 0) out[run.probe] = Math.max(0, (own - refShortfall) / calls);
  }
  return out;
}
