// What the planner measures on this machine, once, and keeps under the project's cache directory
// ($FLOTILLA_CACHE_DIR/plan, else $XDG_CACHE_HOME/flotilla/plan, else ~/.cache/flotilla/plan;
// FLOTILLA_CACHE_DIR=off measures every time):
//   - compute: the config's own model, forward and backward at each shape the layouts need
//     (calibrate_model.ts: as many processes at once as the host runs ranks, each with a rank's
//     threads, so they share the cores as the ranks will), per block and for the rest; on a CPU
//     without native bfloat16, bf16 shapes are priced from a short probe ([Note: bf16 without
//     native support]);
//   - communication: each collective's time by group size and bytes on this host, under the
//     backend the config uses, with every rank busy (calibrate_comm.ts on ranks the launcher starts);
//   - baseline: what a rank holds before any model state (Node, libtorch, the data, the collective
//     runtime) and the loop's own cost per step, from a real `flotilla train` of a 1-block model
//     of width 32 on the same ranks and data (measure.ts), and what ZeRO-3 adds per unit and call
//     (the same model trained under ZeRO-3).
// Each says what it measures as it goes ([Note: measuring progress] in progress.ts).
// Each timing is taken over `rounds` fresh launches and the median kept ([Note: launches] in
// measure.ts); the cache keeps what was measured whatever the rounds (they set its precision, not
// what it depends on).
// Every entry is keyed by what it depends on (the model's and data's config, threads, ranks,
// backend, the machine's CPU, the addon's build and the code that measures), so a change of any is a
// new measurement.
import { createHash } from 'node:crypto';
import { spawn } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { cpus, tmpdir } from 'node:os';
import { join } from 'node:path';
import type { FlotillaConfig } from '../config/schema.js';
import type { CalibrationPoint, DepthTiming, ModelCalibrationIn, ModelCalibrationOut } from './calibrate_model.js';
import { measureLayout, planScript } from './measure.js';
import { median } from './stats.js';
import { commandFor, launch } from '../launch/launcher.js';
import { bf16Support } from '../tensor/cpu_features.js';
import { mpiInstalled, MPI_INSTALL_HINT } from '../distributed/mpi_install.js';
import { DEFAULT_MASTER_ADDR } from '../distributed/env.js';
import { Progress, PROGRESS_TAG, formatDuration } from './progress.js';
import { type Collective, type PlanLayout, type ProbeRunName } from './terms.js';
import { layoutRefusals, overridesOf } from './enumerate.js';
import { cacheDir } from '../io/cache_dir.js';
import { loadConfig } from '../config/index.js';
import { modelFacts } from './facts.js';

/** The planner's cache directory, or undefined when FLOTILLA_CACHE_DIR=off. */
export function planCacheDir(env: NodeJS.ProcessEnv = process.env): string | undefined {
  return cacheDir('plan', env);
}

const digest = (x: unknown): string => createHash('sha256').update(JSON.stringify(x)).digest('hex').slice(0, 16);
// The addon's build is part of the machine: its kernels and allocator set what every step costs.
const ADDON = fileURLToPath(new URL('../../native/build/Release/flotilla.node', import.meta.url));
function addonStamp(): string {
  try {
    const s = statSync(ADDON);
    return `${s.size}:${s.mtimeMs}`;
  } catch {
    return '?';
  }
}
const machine = (): string => `${cpus()[0]?.model ?? '?'} x${cpus().length} addon ${addonStamp()}`;
function codeOf(name: string): string {
  try {
    return digest(readFileSync(planScript(name), 'utf8'));
  } catch {
    return '?';
  }
}

function cached<T>(name: string, key: unknown, make: () => Promise<T>): Promise<T> {
  const dir = planCacheDir();
  const file = dir === undefined ? undefined : join(dir, `${name}-${digest(key)}.json`);
  if (file !== undefined) {
    try {
      return Promise.resolve(JSON.parse(readFileSync(file, 'utf8')) as T);
    } catch { /* not measured yet */ }
  }
  return make().then((v) => {
    if (file !== undefined) {
      try {
        mkdirSync(dir!, { recursive: true });
        const tmp = `${file}.${process.pid}.tmp`;
        writeFileSync(tmp, JSON.stringify(v));
        renameSync(tmp, file);
      } catch { /* a cache that cannot be written only costs a measurement next time */ }
    }
    return v;
  });
}

// ---- compute

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
  const modelKey = { model: cfg.model, moe: cfg.moe, threads: cfg.train.threads, seed: cfg.train.seed, machine: machine(), code: [codeOf('calibrate_model'), codeOf('calibrate')], depths: depthsOf(cfg), ranksPerHost };
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
        log(`[plan] bf16-mixed took ${(totalMs(probe) / totalMs(probeFp32)).toFixed(1)}x float32's forward and backward at ${describePoint(fp32Twin(probe)).replace(' fp32', '')}; its ${choice.priced.length} shape(s) are priced at that ratio, part by part`);
      }
    } finally {
      rmSync(tmp, { recursive: true, force: true });
    }
    if (file !== undefined) {
      try {
        mkdirSync(dir!, { recursive: true });
        writeFileSync(`${file}.${process.pid}.tmp`, JSON.stringify(have));
        renameSync(`${file}.${process.pid}.tmp`, file);
      } catch { /* see cached() */ }
    }
  }
  return { points: points.map((p) => have.points[keyOf(p)]!), optimizerNsPerParam: have.optimizerNsPerParam };
}

// ---- communication

export interface CommTable {
  backend: string;
  worldSize: number;
  /** `${op}:${groupSize}` -> [bytes, ms] rows, ascending. */
  table: Record<string, [number, number][]>;
}

/** The time of one collective (ms), interpolated in bytes between measured sizes (a latency floor below the smallest; linear beyond the largest). */
export function commMs(t: CommTable, op: Collective, group: number, bytes: number): number {
  // A group larger than this host's ranks spans hosts, which the table does not measure: it is
  // priced as the largest group measured here (a lower bound; the planner marks such layouts).
  const sizes = Object.keys(t.table).filter((k) => k.startsWith(`${op}:`)).map((k) => Number(k.slice(op.length + 1))).filter((g) => g <= group);
  if (sizes.length === 0) return 0; // one rank per host: nothing measured, nothing assumed
  const rows = t.table[`${op}:${Math.max(...sizes)}`]!;
  // Noise under load can make a smaller message look slower: time never decreases with size.
  const ms = rows.map(([, m]) => m);
  for (let i = ms.length - 2; i >= 0; i--) ms[i] = Math.min(ms[i]!, ms[i + 1]!);
  if (bytes <= rows[0]![0]) return ms[0]!;
  for (let i = 1; i < rows.length; i++) {
    if (bytes <= rows[i]![0]) {
      const [b0, b1] = [rows[i - 1]![0], rows[i]![0]];
      return ms[i - 1]! + ((ms[i]! - ms[i - 1]!) * (bytes - b0)) / (b1 - b0);
    }
  }
  const n = rows.length;
  const slope = n > 1 ? (ms[n - 1]! - ms[n - 2]!) / (rows[n - 1]![0] - rows[n - 2]![0]) : ms[0]! / rows[0]![0];
  return ms[n - 1]! + slope * (bytes - rows[n - 1]![0]);
}

export const COMM_SIZES = [16 * 1024, 256 * 1024, 2 * 2 ** 20, 16 * 2 ** 20];

/** The backend the collectives are measured under: the config's, 'auto' as the launcher reads it on one host. */
function commBackend(b: string): 'gloo' | 'mpi' {
  if (b === 'gloo') return 'gloo';
  if (b === 'mpi' && !mpiInstalled()) throw new Error(`[parallel] backend = "mpi": Open MPI is not available here (${MPI_INSTALL_HINT}); install it, or set backend = "gloo" or "auto"`);
  return mpiInstalled() ? 'mpi' : 'gloo';
}

/** The collectives' table for this host's ranks under the config's backend (measured, cached). */
export function calibrateComm(cfg: FlotillaConfig, nproc: number, log: (l: string) => void): Promise<CommTable> {
  if (nproc < 2) return Promise.resolve({ backend: 'local', worldSize: 1, table: {} });
  const key = { backend: cfg.parallel.backend, nproc, threads: cfg.train.threads, machine: machine(), code: codeOf('calibrate_comm'), sizes: COMM_SIZES };
  return cached('comm', key, async () => {
    log(`[plan] measuring collectives on ${nproc} ranks (${cfg.parallel.backend} backend; once, cached)`);
    const tmp = mkdtempSync(join(tmpdir(), 'flotilla-plan-comm-'));
    try {
      let output = '';
      const sink = { write: (s: string) => { output = (output + s).slice(-4000); return true; } };
      const t0 = performance.now();
      const code = await launch({
        nproc, nnodes: 1, nodeRank: 0, masterAddr: DEFAULT_MASTER_ADDR, masterPort: undefined, maxRestarts: 0, backend: commBackend(cfg.parallel.backend),
        script: planScript('calibrate_comm'), scriptArgs: [join(tmp, 'out.json'), JSON.stringify({ sizes: COMM_SIZES, reps: 5, threads: cfg.train.threads })],
      }, { stdout: sink, stderr: sink, handleSignals: false });
      log(`[plan] collectives measured in ${formatDuration(performance.now() - t0)}`);
      if (code !== 0) throw new Error(`measuring the collectives failed (status ${code}):\n${output}`);
      return JSON.parse(readFileSync(join(tmp, 'out.json'), 'utf8')) as CommTable;
    } finally {
      rmSync(tmp, { recursive: true, force: true });
    }
  });
}

// ---- baseline

export interface Baseline {
  /** Resident bytes of a rank in the loop that no layout term covers (Node, libtorch, the data, the collectives' runtime). */
  bytes: number;
  /** The high-water mark of starting up (reading and tokenizing the data, loading the libraries): a floor of every peak. */
  startupBytes: number;
  /** The loop's own time per step (ms), with a model too small to matter. */
  stepMs: number;
  /**
   * What ZeRO-3 costs per wrapping unit and call (a gather, or a gradient reduce-scatter) beyond
   * the collective's own time: the tiny model's step under ZeRO-3 less its step under data
   * parallelism, over its calls (ms; 0 on one rank).
   */
  zero3CallMs: number;
  /** And what it costs per MiB of the unit's parameters (ms), from the probe model (probeFlags). */
  zero3MsPerMiB: number;
}

/** The probe model (probeFlags) under an in-step probe's layout, and its median step (ms). */
export interface InStepRun {
  probe: ProbeRunName;
  layout: PlanLayout;
  stepMs: number;
}

/**
 * The in-step probes the candidates need ([Note: in-step collectives] in predict.ts): the probe
 * model (probeFlags) under tp, tp + sp, cp or ZeRO-2 on these ranks, and under plain data
 * parallelism ('dp', the reference the others are measured against), where the project's
 * checks accept it; each cached on its own. predict.ts prices the same runs and charges what it
 * misses to their in-step calls.
 */
export async function calibrateInStep(config: string, cfg: FlotillaConfig, overrides: readonly string[], nproc: number, probes: readonly ProbeRunName[], rounds: number, log: (l: string) => void): Promise<InStepRun[]> {
  const out: InStepRun[] = [];
  if (nproc < 2) return out;
  const flags = probeFlags(cfg);
  const one = loadConfig(config, [...overrides, ...flags]);
  const runnable = probes.filter((probe) => !((probe === 'tp' || probe === 'sp' || probe === 'cp') && nproc % 2 !== 0) && layoutRefusals(one, probeLayout(probe, one, nproc), nproc).length === 0);
  for (const [n, probe] of runnable.entries()) {
    const layout = probeLayout(probe, one, nproc);
    const of = `in-step probe ${n + 1} of ${runnable.length}, ${rounds} launch(es)`;
    const key = { probe, layout, data: cfg.data, model: cfg.model, backend: cfg.parallel.backend, nproc, threads: cfg.train.threads, machine: machine(), code: [codeOf('measure'), codeOf('calibrate')] };
    try {
      const stepMs = await cached(`instep-${probe}`, key, async () => {
        log(probe === 'dp'
          ? `[plan] measuring the in-step probes' reference, a ${one.model.nLayer}-block model under data parallelism, on ${nproc} rank(s) (${of}; once, cached)`
          : `[plan] measuring ${probe} collectives inside the step with a ${one.model.nLayer}-block model on ${nproc} rank(s) (${of}; once, cached)`);
        const t0 = performance.now();
        const ms = (await measureLayout(config, [...overrides, ...flags, ...overridesOf(one, layout)], nproc, { launches: rounds })).stepMs; // MEASURE_STEPS steps
        log(`[plan] ${probe} probe measured in ${formatDuration(performance.now() - t0)}`);
        return ms;
      });
      out.push({ probe, layout, stepMs });
    } catch (e) { // not cached: measured again next time
      log(`[plan] ${probe}: not measured (${(e as Error).message.split('\n')[0]}); its collectives are priced from the table alone`);
    }
  }
  return out;
}

/** A 1-block model of width 32 on data parallelism alone: the baseline's model. */
const TINY_FLAGS = ['--model.nLayer=1', '--model.nEmbd=32', '--model.nHead=1', '--moe.experts=0', '--parallel.dp=-1', '--parallel.zero=0', '--parallel.dpShard=-1', '--parallel.dpReplicate=1', '--parallel.pp=1', '--parallel.tp=1', '--parallel.cp=1', '--parallel.ep=1',
  '--parallel.sequenceParallel=false', '--parallel.lossParallel=false', '--parallel.auto=false', '--data.microBatches=1', '--train.activationCheckpoint=none', '--train.precision=fp32', '--parallel.accumulate=auto'];
/**
 * The probes' model: the config's width and heads, 3 blocks (fewer when the model has fewer), on
 * data parallelism alone. What a probe measures beyond its price is charged per call or per byte;
 * one block would charge a step's fixed costs to one block's calls and bytes (a 1-block probe priced
 * ZeRO-3 on the 25M GPT at 2x what it measured), and three spread them as a deeper model does.
 */
export function probeFlags(cfg: FlotillaConfig): string[] {
  return [...TINY_FLAGS.filter((o) => !/^--model\.(nLayer|nEmbd|nHead)=/.test(o)), `--model.nLayer=${Math.min(3, cfg.model.nLayer)}`];
}

/** The layout of an in-step probe on n ranks ([Note: in-step collectives] in predict.ts): two ranks of the probed axis, the rest data parallel. */
export function probeLayout(probe: ProbeRunName, cfg: FlotillaConfig, n: number): PlanLayout {
  const base: PlanLayout = {
    dp: n, zero: 0, dpShard: -1, dpReplicate: 1, pp: 1, ppSchedule: cfg.parallel.ppSchedule, ppVirtualStages: 1, tp: 1, sequenceParallel: false, cp: 1, ep: 1,
    microBatches: 1, activationCheckpoint: 'none', precision: 'fp32',
  };
  switch (probe) {
    case 'dp': return base;
    case 'tp': return { ...base, dp: n / 2, tp: 2 };
    case 'sp': return { ...base, dp: n / 2, tp: 2, sequenceParallel: true };
    case 'cp': return { ...base, dp: n / 2, cp: 2 };
    case 'zero2': return { ...base, zero: 2, dpShard: n };
  }
}

/**
 * The baseline of a rank for this config's data and ranks, measured with a 1-block model of width
 * 32 (cached): its high-water mark is the start-up's, and rank 0's resident size after the second
 * step ([memory] line of the trainer) less the tiny model's state and the allocator's kept blocks
 * is what the loop keeps besides the layout's terms.
 */
export function calibrateBaseline(config: string, cfg: FlotillaConfig, overrides: readonly string[], nproc: number, rounds: number, log: (l: string) => void): Promise<Baseline> {
  // The model and resharding too: ZeRO-3's cost per MiB is measured at the config's width.
  const key = { data: cfg.data, model: cfg.model, reshard: cfg.parallel.reshardAfterForward, backend: cfg.parallel.backend, nproc, threads: cfg.train.threads, machine: machine(), code: [codeOf('measure'), codeOf('calibrate')] };
  return cached('baseline', key, async () => {
    log(`[plan] measuring a rank's baseline with a 1-block model on ${nproc} rank(s), ${rounds} launch(es)${nproc > 1 ? ', then what ZeRO-3 costs in 3 more runs of as many' : ''} (once, cached)`);
    const t0 = performance.now();
    const run = { launches: rounds }; // MEASURE_STEPS steps each
    const m = await measureLayout(config, [...overrides, ...TINY_FLAGS], nproc, { ...run, progress: true });
    const tinyParams = cfg.model.vocabSize * 32 * 2 + cfg.model.blockSize * 32 + 13 * 32 * 32;
    // Rank 0's resident size after step 2, less the tiny model's state and the freed tensor memory
    // the allocator's cache keeps for the next step (the activations' blocks: a layout's own
    // activations term counts those).
    const resident = /the process: resident (\d+) MiB/.exec(m.output);
    const kept = /(\d+) MiB of it is freed tensor memory the cache keeps/.exec(m.output);
    const startupBytes = Math.max(...m.peakMiB) * 2 ** 20;
    const bytes = (resident ? Number(resident[1]) * 2 ** 20 : startupBytes) - (kept ? Number(kept[1]) * 2 ** 20 : 0) - 16 * tinyParams;
    // ZeRO-3's own cost per unit call: the same model under ZeRO-3 (2 units, the block and the
    // root, each gathered for the forward, again for the backward when resharded, and its
    // gradients reduce-scattered), against data parallelism, gives the cost of a call; the probe
    // model (probeFlags: its blocks and the root, one unit each) under both gives what it adds per
    // byte of a unit.
    let zero3CallMs = 0, zero3MsPerMiB = 0;
    if (nproc > 1) {
      log(`[plan] measuring what ZeRO-3 costs per unit with the 1-block model of width 32 and a model of the config's width (once, cached)`);
      const z3 = ['--parallel.zero=3', '--parallel.dpShard=-1'];
      const perUnit = (cfg.parallel.reshardAfterForward ? 2 : 1) + 1; // gathers and the reduce-scatter of one unit
      const z = await measureLayout(config, [...overrides, ...TINY_FLAGS, ...z3], nproc, run);
      zero3CallMs = Math.max(0, (z.stepMs - m.stepMs) / (2 * perUnit));
      const flags = probeFlags(cfg);
      const [dpWide, z3Wide] = [await measureLayout(config, [...overrides, ...flags], nproc, run), await measureLayout(config, [...overrides, ...flags, ...z3], nproc, run)];
      const wide = loadConfig(config, [...overrides, ...flags]);
      const wideCalls = (wide.model.nLayer + 1) * perUnit;
      zero3MsPerMiB = Math.max(0, (z3Wide.stepMs - dpWide.stepMs - wideCalls * zero3CallMs) / ((perUnit * 4 * modelFacts(wide).numParams) / 2 ** 20));
    }
    log(`[plan] baseline measured in ${formatDuration(performance.now() - t0)}`);
    return { bytes, startupBytes, stepMs: m.stepMs, zero3CallMs, zero3MsPerMiB };
  });
}
