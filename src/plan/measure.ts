// `flotilla plan --measure`: trains a layout for a few steps through `flotilla train --nproc N`,
// as a user would, and measures it from outside: every rank's peak resident memory (VmHWM, read
// from /proc/<pid>/status of each rank process while it runs) and the median step time of the
// steady steps (from the run's metrics.jsonl; [Note: steady steps]). Linux only.
//
// [Note: steady steps] The first two steps and the last are left out of the median. The first also
// learns gradient readiness and warms the allocator; the second still grows the tensor cache (the
// demo model on 4 ranks: 212 ms against 132-171 for the steps after it); the last also evaluates
// (a run's final step always does). A median of all but the first over 5 steps took the upper middle
// of those four, the second step's: the in-step probes and the baseline's loop term, measured over 5
// steps, came out slower than the same steps in the layouts measured over 8 (the demo model's
// cp probe on 3 blocks at 185 ms, the 4-block model under cp minutes later at 153).
//
// [Note: launches] A process on a shared or virtual machine can run the same step 1.2-1.9x slower
// for its whole life (docs/BENCHMARKS.md, the Llama's two speeds), and a synchronous step waits for
// its slowest rank: one launch measures which speeds its ranks drew. `launches: K` trains K fresh
// runs one after another and keeps the one of median step time (memory as that run measured it);
// the planner's calibrations take the median over fresh launches the same way (`rounds`).
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, extname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { readMetrics } from '../train/metrics.js';
import { procStatusBytes } from '../io/proc_status.js';
import { commandFor } from '../launch/launcher.js';
import { processTree } from '../launch/heartbeat.js';
import { median, medianBy } from './stats.js';

const OWN_EXT = extname(fileURLToPath(import.meta.url));
/** The CLI's entry point beside this module (main.ts under tsx, main.js compiled). */
export const CLI_MAIN = fileURLToPath(new URL(`../cli/main${OWN_EXT}`, import.meta.url));
/** A module of this folder, as the running code has it (.ts under tsx, .js compiled). */
export const planScript = (name: string): string => fileURLToPath(new URL(`./${name}${OWN_EXT}`, import.meta.url));

export interface Measured {
  /** VmHWM per rank, MiB. */
  peakMiB: number[];
  /** Median step time over the steady steps ([Note: steady steps]), ms. */
  stepMs: number;
  steps: number[];
  /** Each launch's median step time, in the order they ran ([Note: launches]; this run's among them). */
  launchMs: number[];
  /** The end of what the run printed (with `progress`, rank 0's [memory] line among it). */
  output: string;
}

const MiB = 2 ** 20;

/** The rank of a process started by the launcher or mpirun (from its environment), or undefined. */
function rankOf(pid: number): number | undefined {
  try {
    const env = readFileSync(`/proc/${pid}/environ`, 'utf8').split('\0');
    const v = env.find((x) => x.startsWith('RANK=')) ?? env.find((x) => x.startsWith('OMPI_COMM_WORLD_RANK='));
    return v === undefined ? undefined : Number(v.slice(v.indexOf('=') + 1));
  } catch {
    return undefined;
  }
}

function hwm(pid: number): number | undefined {
  const bytes = procStatusBytes(pid)?.VmHWM;
  return bytes === undefined ? undefined : bytes / MiB;
}

/** Steps a measurement trains: five steady ones between the two that warm up and the last ([Note: steady steps]). */
export const MEASURE_STEPS = 8;

export interface MeasureOptions { steps?: number; env?: NodeJS.ProcessEnv; timeoutMs?: number; progress?: boolean; launches?: number }

/**
 * Runs `flotilla train CONFIG --nproc N OVERRIDES` for `steps` steps (evaluation, checkpoints,
 * samples and the report off; the run directory temporary) and measures it; with `launches` K, K
 * fresh runs and the median one ([Note: launches]).
 */
export async function measureLayout(config: string, overrides: readonly string[], nproc: number, opts: MeasureOptions = {}): Promise<Measured> {
  const runs: Omit<Measured, 'launchMs'>[] = [];
  for (let k = 0; k < Math.max(1, opts.launches ?? 1); k++) runs.push(await measureOnce(config, overrides, nproc, opts));
  return { ...medianBy(runs, (r) => r.stepMs), launchMs: runs.map((r) => r.stepMs) };
}

async function measureOnce(config: string, overrides: readonly string[], nproc: number, opts: MeasureOptions): Promise<Omit<Measured, 'launchMs'>> {
  const steps = opts.steps ?? MEASURE_STEPS;
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-plan-measure-'));
  try {
    const args = [
      'train', config, '--nproc', String(nproc), ...overrides,
      `--train.steps=${steps}`, '--train.evalEvery=0', '--train.evalBatches=1', `--log.progress=${opts.progress ? 'plain' : 'off'}`, '--log.sampleTokens=0', '--checkpoint.every=0',
      `--train.runDir=${join(dir, 'run')}`, '--optim.warmupSteps=0',
    ];
    const [cmd, argv] = commandFor(CLI_MAIN, args); // .ts under tsx, .js under node
    const child = spawn(cmd, argv, { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, FLOTILLA_REPORT: '0', ...opts.env } });
    let output = '';
    child.stdout.on('data', (d: Buffer) => { output = (output + d.toString()).slice(-8000); });
    child.stderr.on('data', (d: Buffer) => { output = (output + d.toString()).slice(-8000); });
    const peak = new Array<number>(nproc).fill(NaN);
    const sample = (): void => {
      if (nproc === 1) { // `flotilla train` without --nproc (or --nproc 1) trains in the process itself
        const h = hwm(child.pid!);
        if (h !== undefined) peak[0] = Number.isNaN(peak[0]!) ? h : Math.max(peak[0]!, h);
        return;
      }
      for (const k of processTree(child.pid!).slice(1)) {
        const r = rankOf(k);
        const h = hwm(k);
        if (r !== undefined && r < nproc && h !== undefined) peak[r] = Number.isNaN(peak[r]!) ? h : Math.max(peak[r]!, h);
      }
    };
    const timer = setInterval(sample, 50);
    const timeout = setTimeout(() => child.kill('SIGTERM'), opts.timeoutMs ?? 30 * 60_000);
    const code = await new Promise<number | null>((res) => child.on('exit', (c) => res(c)));
    clearInterval(timer);
    clearTimeout(timeout);
    if (code !== 0) throw new Error(`measuring ${overrides.join(' ')}: flotilla train exited with status ${code}:\n${output.slice(-3000)}`);
    if (peak.some((p) => Number.isNaN(p))) throw new Error(`measuring ${overrides.join(' ')}: a rank process was never seen (ranks are found by their RANK variable)`);
    // A step's time is the loop's wall clock between two steps' ends (the step, its bookkeeping).
    const rows = readMetrics(join(dir, 'run', 'metrics.jsonl'));
    const times = rows.slice(1).map((r, i) => 1000 * (r.elapsedS - rows[i]!.elapsedS));
    if (times.length === 0) throw new Error('measuring: at least 2 steps are needed (the first is left out)');
    const steady = times.length >= 3 ? times.slice(1, -1) : times; // [Note: steady steps]
    return { peakMiB: peak, stepMs: median(steady), steps: times, output };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
