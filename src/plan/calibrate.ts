// What the planner measures on this machine, once, and keeps under the project's cache directory
// ($FLOTILLA_CACHE_DIR/plan, else $XDG_CACHE_HOME/flotilla/plan, else ~/.cache/flotilla/plan;
// FLOTILLA_CACHE_DIR=off measures every time):
//   - compute (calibrate_compute.ts): the config's own model, forward and backward at each shape
//     the layouts need (calibrate_model.ts: as many processes at once as the host runs ranks, each
//     with a rank's threads, so they share the cores as the ranks will), per block and for the
//     rest; on a CPU without native bfloat16, bf16 shapes are priced from a short probe ([Note:
//     bf16 without native support]);
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
// new measurement (calibration_cache.ts).
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { FlotillaConfig } from '../config/schema.js';
import { measureLayout, planScript } from './measure.js';
import { launch } from '../launch/launcher.js';
import { mpiInstalled, MPI_INSTALL_HINT } from '../distributed/mpi_install.js';
import { DEFAULT_MASTER_ADDR } from '../distributed/env.js';
import { formatDuration } from './progress.js';
import type { Collective, PlanLayout } from '../distributed/plan_terms.js';
import type { ProbeRunName } from './terms.js';
import { layoutRefusals, overridesOf } from './enumerate.js';
import { loadConfig } from '../config/index.js';
import { modelFacts } from './facts.js';
import { cached, codeOf, machine } from './calibration_cache.js';

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
    try {
      const stepMs = await probeStepMs(config, cfg, overrides, nproc, probe, rounds, `in-step probe ${n + 1} of ${runnable.length}, ${rounds} launch(es)`, log);
      out.push({ probe, layout: probeLayout(probe, one, nproc), stepMs });
    } catch (e) { // not cached: measured again next time
      log(`[plan] ${probe}: not measured (${(e as Error).message.split('\n')[0]}); its collectives are priced from the table alone`);
    }
  }
  return out;
}

/**
 * The median step (ms) of the probe model (probeFlags) under one in-step probe's layout, measured
 * once and cached on its own: the baseline's ZeRO-3 price reads the 'dp' one too, so it is trained
 * once for both. `of` says where in the calibration it runs.
 */
function probeStepMs(config: string, cfg: FlotillaConfig, overrides: readonly string[], nproc: number, probe: ProbeRunName, rounds: number, of: string, log: (l: string) => void): Promise<number> {
  const flags = probeFlags(cfg);
  const one = loadConfig(config, [...overrides, ...flags]);
  const layout = probeLayout(probe, one, nproc);
  const key = { probe, layout, data: cfg.data, model: cfg.model, backend: cfg.parallel.backend, nproc, threads: cfg.train.threads, machine: machine(), code: [codeOf('measure'), codeOf('calibrate')] };
  return cached(`instep-${probe}`, key, async () => {
    log(probe === 'dp'
      ? `[plan] measuring the in-step probes' reference, a ${one.model.nLayer}-block model under data parallelism, on ${nproc} rank(s) (${of}; once, cached)`
      : `[plan] measuring ${probe} collectives inside the step with a ${one.model.nLayer}-block model on ${nproc} rank(s) (${of}; once, cached)`);
    const t0 = performance.now();
    const ms = (await measureLayout(config, [...overrides, ...flags, ...overridesOf(one, layout)], nproc, { launches: rounds })).stepMs; // MEASURE_STEPS steps
    log(`[plan] ${probe} probe measured in ${formatDuration(performance.now() - t0)}`);
    return ms;
  });
}

/** A 1-block model of width 32 on data parallelism alone: the baseline's model. */
const TINY_FLAGS = ['--model.nLayer=1', '--model.nEmbd=32', '--model.nHead=1', '--moe.experts=0', '--parallel.dp=-1', '--parallel.zero=0', '--parallel.dpShard=-1', '--parallel.dpReplicate=1', '--parallel.pp=1', '--parallel.tp=1', '--parallel.cp=1', '--parallel.ep=1',
  '--parallel.sequenceParallel=false', '--parallel.lossParallel=false', '--parallel.auto=false', '--data.microBatches=1', '--train.activationCheckpoint=none', '--train.precision=fp32', '--parallel.accumulate=auto',
  // Probe models are other sizes than the config's: they start from random weights, so a base to
  // fine-tune (train.initFrom, a LoRA run's frozen base) is not theirs to load. A LoRA run's own
  // bytes come from the model's facts ([Note: LoRA plan]); its step is priced as full training's.
  '--train.initFrom=', '--lora.rank=0', '--lora.adapter='];
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
    log(`[plan] measuring a rank's baseline with a 1-block model on ${nproc} rank(s), ${rounds} launch(es) (once, cached)`);
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
      // The probe model under data parallelism is the in-step probes' reference: one measurement for both.
      const dpWideMs = await probeStepMs(config, cfg, overrides, nproc, 'dp', rounds, `also ZeRO-3's reference, ${rounds} launch(es)`, log);
      const z3Wide = await measureLayout(config, [...overrides, ...flags, ...z3], nproc, run);
      const wide = loadConfig(config, [...overrides, ...flags]);
      const wideCalls = (wide.model.nLayer + 1) * perUnit;
      zero3MsPerMiB = Math.max(0, (z3Wide.stepMs - dpWideMs - wideCalls * zero3CallMs) / ((perUnit * 4 * modelFacts(wide).numParams) / 2 ** 20));
    }
    log(`[plan] baseline measured in ${formatDuration(performance.now() - t0)}`);
    return { bytes, startupBytes, stepMs: m.stepMs, zero3CallMs, zero3MsPerMiB };
  });
}
