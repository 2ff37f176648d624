// Peak resident memory of real training ranks, measured from outside: starts a world of
// bench/zero_rss_rank.ts (the trainer under config overrides), samples every rank's VmRSS from
// /proc/<pid>/status while it runs, and reads its VmHWM (the kernel's high-water mark of resident
// memory) once the run is over and before the rank exits. Used by test/memory_zero_rss.test.ts and
// bench/zero_rss.ts. Linux only.
import { procStatusBytes } from '../../src/io/proc_status.js';
import type { ChildProcess } from 'node:child_process';
import { runWorld } from './world.js';

export interface RankRss {
  rank: number;
  /** VmHWM at the end of the run, MiB. */
  peakMiB: number;
  /** [ms since the rank started, VmRSS MiB] samples. */
  samples: [number, number][];
  /** Markers the rank printed: phase or step name, ms since it started, and what followed on the line. */
  marks: [string, number, string?][];
  /** The wrapper's memory report after the last step (bytes), and the model's size. */
  memory: { paramBytes: number; gradBytes: number; optimizerBytes: number; peakBytes: number } | null;
  numParams: number;
  /** Rank 0's `[memory]` line, if printed. */
  memoryLine?: string;
}

const MiB = 2 ** 20;

/** A field of /proc/<pid>/status in MiB; undefined once the process has exited. */
function statusField(pid: number, field: string): number | undefined {
  const bytes = procStatusBytes(pid)?.[field];
  return bytes === undefined ? undefined : bytes / MiB;
}

/** Trains on `nproc` ranks with `overrides` (--section.field=value) and returns each rank's memory. */
export async function measureRss(overrides: string[], opts: { nproc?: number; sampleMs?: number; timeoutMs?: number; env?: Record<string, string> } = {}): Promise<RankRss[]> {
  const nproc = opts.nproc ?? 2;
  const out: RankRss[] = Array.from({ length: nproc }, (_, rank) => ({ rank, peakMiB: NaN, samples: [], marks: [], memory: null, numParams: 0 }));
  const timers: NodeJS.Timeout[] = [];
  const onSpawn = (rank: number, child: ChildProcess): void => {
    const r = out[rank]!;
    const start = Date.now();
    timers.push(setInterval(() => {
      const rss = statusField(child.pid!, 'VmRSS');
      if (rss !== undefined) r.samples.push([Date.now() - start, rss]);
    }, opts.sampleMs ?? 20));
    let buf = '';
    child.stdout!.on('data', (d: Buffer) => {
      buf += d.toString();
      let nl: number;
      while ((nl = buf.indexOf('\n')) >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        if (line.startsWith('[memory]')) r.memoryLine = line;
        const m = /^\[rss\] (\S+) (\d+)(?: (.*))?$/.exec(line);
        if (!m) continue;
        r.marks.push([m[1]!, Number(m[2]) - start, m[3]]);
        if (m[1] === 'ready') {
          const info = JSON.parse(m[3]!) as { memory: RankRss['memory']; numParams: number };
          r.memory = info.memory;
          r.numParams = info.numParams;
          r.peakMiB = statusField(child.pid!, 'VmHWM')!;
          child.kill('SIGUSR2');
        }
      }
    });
  };
  try {
    const res = await runWorld({
      nproc, script: 'bench/zero_rss_rank.ts', args: overrides, onSpawn, timeoutMs: opts.timeoutMs ?? 300_000,
      env: { FLOTILLA_BACKEND: 'gloo', ...opts.env },
    });
    if (res.codes.some((c) => c !== 0) || out.some((r) => Number.isNaN(r.peakMiB))) {
      throw new Error(`measureRss: ranks exited ${res.codes.join(', ')}:\n${res.outputs.map((o, i) => `--- rank ${i}\n${o.slice(-3000)}`).join('\n')}`);
    }
  } finally {
    for (const t of timers) clearInterval(t);
  }
  return out;
}

/** The largest VmRSS sample between two markers (ms). */
function maxBetween(r: RankRss, from: number, to: number): number {
  return Math.max(0, ...r.samples.filter(([t]) => t >= from && t < to).map(([, v]) => v));
}

/** The largest VmRSS (MiB) up to each of the trainer's phases and each of `steps` steps, as text. */
export function rssTimeline(r: RankRss, steps: number): string {
  const at = (name: string) => r.marks.find(([n]) => n === name)?.[1];
  const bounds: [string, number][] = [['start', 0]];
  for (const name of ['phase:model', 'phase:parallelize', 'phase:optimizer', 'phase:train', ...Array.from({ length: steps }, (_, i) => `step:${i + 1}`), 'ready']) {
    const t = at(name);
    if (t !== undefined) bounds.push([name, t]);
  }
  const parts: string[] = [];
  for (let i = 1; i < bounds.length; i++) parts.push(`${bounds[i]![0].replace(/^(phase|step):/, '$1 ')} ${maxBetween(r, bounds[i - 1]![1], bounds[i]![1]).toFixed(0)}`);
  return parts.join(', ');
}

/** Wall and CPU seconds of each step after the first, from the rank's step markers (bench/zero_rss_rank.ts). */
export function stepSeconds(r: RankRss): { wall: number[]; cpu: number[] } {
  const steps = r.marks.filter(([n]) => n.startsWith('step:'));
  const cpuOf = (extra?: string) => Number(/\bcpu (\d+)/.exec(extra ?? '')?.[1]);
  const out = { wall: [] as number[], cpu: [] as number[] };
  for (let i = 1; i < steps.length; i++) {
    out.wall.push((steps[i]![1] - steps[i - 1]![1]) / 1e3);
    out.cpu.push((cpuOf(steps[i]![2]) - cpuOf(steps[i - 1]![2])) / 1e3);
  }
  return out;
}

/** Bytes AdamW training holds per parameter in float32 (4 parameters + 4 gradients + 8 state), by ZeRO stage, over n shards. */
export function theoryBytesPerParam(zero: number, n: number): number {
  return [16, 4 + 4 + 8 / n, 4 + 4 / n + 8 / n, 16 / n][zero]!;
}

export { MiB };
