// The compute calibration (calibrate.ts's opening note): the config's model, forward and backward at
// each shape the layouts need, per block and for the rest, measured by calibrate_model.ts in as many
// processes at once as the host runs ranks; bf16 shapes priced from a short probe on a CPU without
// native bfloat16 ([Note: bf16 without native support]); cached per shape.
import { spawn } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { FlotillaConfig } from '../config/schema.js';
import type { CalibrationPoint, DepthTiming, ModelCalibrationIn, ModelCalibrationOut } from './calibrate_model.js';
import { planScript } from './measure.js';
import { median } from './stats.js';
import { commandFor } from '../launch/launcher.js';
import { bf16Support } from '../tensor/cpu_features.js';
import { Progress, PROGRESS_TAG, formatDuration } from './progress.js';
import { codeOf, digest, machine, planCacheDir } from './calibration_cache.js';

export interface PartTiming { fwdMs: number; bwdMs: number; actBytes: number }
export interface ComputePoint extends CalibrationPoint { block: PartTiming; rest: PartTiming }

function depthsOf(cfg: FlotillaConfig): [number, number] {
  const e = cfg.moe.experts > 0 ? cfg.moe.every : 1;
  // Depths far apart, so that one block's time stands out of the noise (3 blocks when the model has them).
  const n = Math.floor(cfg.model.nLayer / e);
  return n >= 3 ? [e, 3 * e] : n === 2 ? [e, 2 * e] : [cfg.model.nLayer, cfg.model.nLayer];
}

function split(cfg: FlotillaConfig, d: [DepthTiming, DepthTiming]): { block: PartTiming; rest: PartTiming } {
  const [a, b] = depthsOf(cfg);
  // Bytes: the difference of the two depths is (b - a) blocks.
  const blockAct = a === b ? d[0].actBytes / a : Math.max(0, (d[1].actBytes - d[0].actBytes) / (b - a));
  const restAct = Math.max(0, d[1].actBytes - b * blockAct);
  // Time, at the deeper model: the blocks' forward from their hooks; backward split as forward is.
  const t = d[1];
  const share = t.fwdMs > 0 ? Math.min(1, t.blocksFwdMs / t.fwdMs) : 1;
  return {
    block: { fwdMs: t.blocksFwdMs / b, bwdMs: (t.bwdMs * share) / b, actBytes: blockAct },
    rest: { fwdMs: Math.max(0, t.fwdMs - t.blocksFwdMs), bwdMs: t.bwdMs * (1 - share), actBytes: restAct },
  };
}

const keyOf = (p: CalibrationPoint) => `${p.samples}x${p.tokens}:${p.precision}:${p.activationCheckpoint}`;
const describePoint = (p: CalibrationPoint) => `${p.samples}x${p.tokens} ${p.precision}${p.activationCheckpoint === 'none' ? '' : `, checkpointing ${p.activationCheckpoint}`}`;
const fp32Twin = (p: CalibrationPoint): CalibrationPoint => ({ ...p, precision: 'fp32' });

/**
 * [Note: bf16 without native support] Where the CPU has no bfloat16 instructions (avx512_bf16,
 * amx_bf16; src/tensor/cpu_features.ts), libtorch converts around every bf16 op: a bf16-mixed
 * forward and backward ran about 15x float32's on an AVX2 EPYC, and measuring every bf16 shape at
 * full length kept `flotilla plan` silent for more than 18 minutes. There the bf16 shapes are
 * priced, not measured: one short probe (the smallest bf16 shape, one round, one timed repetition)
 * against its float32 twin gives each part's ratio (block and rest, forward and backward,
 * activation bytes), and each bf16 shape is its float32 twin (measured as usual) times those ratios.
 */
export interface Bf16Pricing {
  /** Shapes measured in full: the float32 ones, and the float32 twins of the priced ones. */
  measure: CalibrationPoint[];
  /** The bf16 shape the short probe measures (undefined: nothing to price). */
  probe?: CalibrationPoint;
  /** bf16 shapes priced from the probe. */
  priced: CalibrationPoint[];
}

export function bf16Pricing(points: readonly CalibrationPoint[], nativeBf16: boolean): Bf16Pricing {
  const bf16 = points.filter((p) => p.precision === 'bf16-mixed');
  if (nativeBf16 || bf16.length === 0) return { measure: [...points], priced: [] };
  const measure = new Map<string, CalibrationPoint>();
  for (const p of [...points.filter((q) => q.precision !== 'bf16-mixed'), ...bf16.map(fp32Twin)]) measure.set(keyOf(p), p);
  const size = (p: CalibrationPoint) => p.samples * p.tokens + (p.activationCheckpoint === 'none' ? 0 : 0.5);
  const probe = [...bf16].sort((a, b) => size(a) - size(b))[0]!;
  return { measure: [...measure.values()], probe, priced: bf16 };
}

/** A bf16 shape from its float32 twin and the probe's bf16 and float32 measurements (see bf16Pricing). */
export function priceFromProbe(p: CalibrationPoint, twin: ComputePoint, probeBf16: ComputePoint, probeFp32: ComputePoint): ComputePoint {
  const ratio = (a: number, b: number) => (b > 0 && Number.isFinite(a / b) ? a / b : 1);
  const part = (t: PartTiming, b: PartTiming, f: PartTiming): PartTiming => ({
    fwdMs: t.fwdMs * ratio(b.fwdMs, f.fwdMs), bwdMs: t.bwdMs * ratio(b.bwdMs, f.bwdMs), actBytes: t.actBytes * ratio(b.actBytes, f.actBytes),
  });
  return { ...p, block: part(twin.block, probeBf16.block, probeFp32.block), rest: part(twin.rest, probeBf16.rest, probeFp32.rest) };
}

const totalMs = (c: ComputePoint) => c.block.fwdMs + c.block.bwdMs + c.rest.fwdMs + c.rest.bwdMs;

/** One calibration process (calibrate_model.ts); onStep is called as it reports each (depth, point). */
function runModelProcess(inFile: string, outFile: string, onStep?: (depth: number, point: number) => void): Promise<ModelCalibrationOut> {
  const [cmd, argv] = commandFor(planScript('calibrate_model'), [inFile, outFile]);
  return new Promise((res, rej) => {
    const child = spawn(cmd, argv, { stdio: ['ignore', 'pipe', 'pipe'] });
    let err = '', pending = '';
    child.stderr.on('data', (b: Buffer) => { err = (err + b.toString()).slice(-8000); });
    child.stdout.on('data', (b: Buffer) => {
      const lines = (pending + b.toString()).split('\n');
      pending = lines.pop()!;
      for (const l of lines) {
        if (!l.startsWith(PROGRESS_TAG)) continue;
        const { depth, point } = JSON.parse(l.slice(PROGRESS_TAG.length)) as { depth: number; point: number };
        onStep?.(depth, point);
      }
    });
    child.on('error', (e) => rej(new Error(`calibrating the model failed: ${e.message}`)));
    child.on('close', (code, signal) => {
      if (code !== 0) rej(new Error(`calibrating the model failed (${signal ?? `status ${code}`}): ${err}`));
      else res(JSON.parse(readFileSync(outFile, 'utf8')) as ModelCalibrationOut);
    });
  });
}

/**
 * The points, each measured `rounds` times with `reps` timed repetitions, in as many processes at
 * once as a host runs ranks: they share the cores (and their caches and memory bandwidth) as the
 * ranks will. A round's times are the mean over its processes; the rounds are fresh processes, one
 * after another, and each time is their median ([Note: launches] in measure.ts). Bytes are the
 * first process's. progress, when given, hears of each (depth, point) of the first process.
 */
async function measurePoints(cfg: FlotillaConfig, tmp: string, tag: string, points: CalibrationPoint[], ranksPerHost: number, rounds: number, reps: number, progress?: Progress): Promise<{ points: ComputePoint[]; optimizerNsPerParam: number }> {
  const depths = depthsOf(cfg);
  const input: ModelCalibrationIn = { cfg, depths, points, reps };
  const inFile = join(tmp, `${tag}-in.json`);
  writeFileSync(inFile, JSON.stringify(input));
  const perRound: ModelCalibrationOut[][] = [];
  for (let r = 0; r < rounds; r++) {
    const onStep = (d: number, i: number) => progress?.step(`${describePoint(points[i]!)}, ${depths[d]} block(s)${rounds > 1 ? `, round ${r + 1} of ${rounds}` : ''}`);
    perRound.push(await Promise.all(Array.from({ length: ranksPerHost }, (_, k) => runModelProcess(inFile, join(tmp, `${tag}-out${k}.json`), k === 0 ? onStep : undefined))));
  }
  const time = (f: (o: ModelCalibrationOut) => number) => median(perRound.map((outs) => outs.reduce((a, o) => a + f(o), 0) / outs.length));
  const out = perRound[0]![0]!.points.map((p, i): ComputePoint => {
    const depth = p.depth.map((d, k) => ({
      ...d, fwdMs: time((o) => o.points[i]!.depth[k]!.fwdMs), bwdMs: time((o) => o.points[i]!.depth[k]!.bwdMs), blocksFwdMs: time((o) => o.points[i]!.depth[k]!.blocksFwdMs),
    })) as [DepthTiming, DepthTiming];
    return { samples: p.samples, tokens: p.tokens, precision: p.precision, activationCheckpoint: p.activationCheckpoint, ...split(cfg, depth) };
  });
  return { points: out, optimizerNsPerParam: time((o) => o.optimizerNsPerParam) };
}

/** What a series of compute measurements weighs, in finishing order ([Note: measuring progress]): blocks times tokens, a third more with full checkpointing. */
export function computeWeights(depths: readonly number[], points: readonly CalibrationPoint[], rounds: number): number[] {
  const w: number[] = [];
  for (let r = 0; r < rounds; r++) {
    for (const d of depths) for (const p of points) w.push(d * p.samples * p.tokens * (p.activationCheckpoint === 'full' ? 4 / 3 : 1));
  }
  return w;
}

export interface ComputeOptions {
  /** Whether this CPU computes in bfloat16 ([Note: bf16 without native support]; default: its /proc/cpuinfo flags). */
  nativeBf16?: boolean;
  /** The progress lines' clock (ms). */
  now?: () => number;
  /** The least time between two progress lines (ms; default 5000). */
  progressEveryMs?: number;
}

/** Forward, backward and activation bytes per block and for the rest, at each point (measured in `rounds` launches, the median kept; cached per point). */
export async function calibrateCompute(cfg: FlotillaConfig, points: CalibrationPoint[], ranksPerHost: number, rounds: number, log: (l: string) => void, opts: ComputeOptions = {}): Promise<{ points: ComputePoint[]; optimizerNsPerParam: number }> {
  const modelKey = { model: cfg.model, moe: cfg.moe, threads: cfg.train.threads, seed: cfg.train.seed, machine: machine(), code: [codeOf('calibrate_model'), codeOf('calibrate_compute')], depths: depthsOf(cfg), ranksPerHost };
  const dir = planCacheDir();
  const file = dir === undefined ? undefined : join(dir, `compute-${digest(modelKey)}.json`);
  let have: { points: Record<string, ComputePoint>; optimizerNsPerParam: number } = { points: {}, optimizerNsPerParam: NaN };
  if (file !== undefined) {
    try { have = JSON.parse(readFileSync(file, 'utf8')) as typeof have; } catch { /* nothing yet */ }
  }
  const missing = points.filter((p) => have.points[keyOf(p)] === undefined);
  if (missing.length > 0 || Number.isNaN(have.optimizerNsPerParam)) {
    log(`[plan] calibrating the model's forward and backward at ${missing.length} shape(s), ${ranksPerHost} process(es) at once as the ranks run, ${rounds} time(s) (once; cached${file ? ` in ${dir}` : ''})`);
    const now = opts.now ?? (() => performance.now());
    const choice = bf16Pricing(missing.length > 0 ? missing : [points[0]!], opts.nativeBf16 ?? bf16Support().native);
    // The optimizer's pass is timed after the last shape of every process: measure at least one.
    const measure = choice.measure.filter((p) => have.points[keyOf(p)] === undefined);
    if (measure.length === 0) measure.push(choice.measure[0]!);
    const tmp = mkdtempSync(join(tmpdir(), 'flotilla-plan-cal-'));
    try {
      let probe: ComputePoint | undefined;
      if (choice.probe !== undefined) {
        log(`[plan] this CPU has no native bfloat16 (neither avx512_bf16 nor amx_bf16 among its flags): the ${choice.priced.length} bf16-mixed shape(s) are priced from a short probe at ${describePoint(choice.probe)} against float32, not measured at full length`);
        const t0 = now();
        probe = (await measurePoints(cfg, tmp, 'probe', [choice.probe], ranksPerHost, 1, 1)).points[0]!;
        log(`[plan] bf16 probe measured in ${formatDuration(now() - t0)}`);
      }
      const progress = new Progress('compute', computeWeights(depthsOf(cfg), measure, rounds), log, now, opts.progressEveryMs);
      const measured = await measurePoints(cfg, tmp, 'shapes', measure, ranksPerHost, rounds, 5, progress);
      for (const p of measured.points) have.points[keyOf(p)] = p;
      have.optimizerNsPerParam = measured.optimizerNsPerParam;
      if (probe !== undefined) {
        const probeFp32 = have.points[keyOf(fp32Twin(probe))]!;
        for (const p of choice.priced) have.points[keyOf(p)] = priceFromProbe(p, have.points[keyOf(fp32Twin(p))]!, probe, probeFp32);
        log(`[plan] bf16-mixed took ${(totalMs(probe) / totalMs(probeFp32)).toFixed(1)}x float32's forward and backward at ${probe.samples}x${probe.tokens}; its ${choice.priced.length} shape(s) are priced at that ratio, part by part`);
      }
    } finally {
      rmSync(tmp, { recursive: true, force: true });
    }
    if (file !== undefined) {
      try {
        mkdirSync(dir!, { recursive: true });
        writeFileSync(`${file}.${process.pid}.tmp`, JSON.stringify(have));
        renameSync(`${file}.${process.pid}.tmp`, file);
      } catch { /* a cache that cannot be written only costs a measurement next time */ }
    }
  }
  return { points: points.map((p) => have.points[keyOf(p)]!), optimizerNsPerParam: have.optimizerNsPerParam };
}
