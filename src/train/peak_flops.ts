// One rank's peak TFLOP/s, the MFU's denominator: [log] peakTflops when given, else measured once by
// a short matmul probe at this rank's threads and cached in the user's cache directory
// (src/io/cache_dir.ts: ~/.cache/flotilla/mfu/peak-<key>.json), keyed by the CPU model, the threads
// and the dtype. Rank 0 measures (or reads its cache) while the others wait, and tells them: a rank's
// threads are its share of the host's cores (src/distributed/process_group.ts), so one rank alone on
// them measures what each reaches, and a probe costs one rank's second, not every rank's.
import { mkdirSync, readFileSync, renameSync, writeFileSync } from 'node:fs';
import { cpus, loadavg } from 'node:os';
import { join } from 'node:path';
import { cacheDir } from '../io/cache_dir.js';
import { getNumThreads, randn, tidy, type DType } from '../tensor/index.js';
import { broadcastJson } from '../checkpoint/replicas.js';
import type { ProcessGroup } from '../distributed/process_group.js';

/** Square GEMMs of this size: large enough to reach the BLAS's rate, small enough for about a second. */
const N = 768;
const PROBE_SECONDS = 0.5;

/** The best rate of n x n GEMMs over about PROBE_SECONDS (after one warm-up), in TFLOP/s. */
export function probePeakTflops(dtype: DType, seconds = PROBE_SECONDS): number {
  return tidy(() => {
    const a = randn([N, N], { dtype }), b = randn([N, N], { dtype });
    a.matmul(b).dispose(); // warm-up: the BLAS's threads and buffers
    let best = 0;
    const start = performance.now();
    for (let i = 0; i < 3 || performance.now() - start < seconds * 1000; i++) {
      const t0 = performance.now();
      a.matmul(b).dispose();
      best = Math.max(best, (2 * N ** 3) / ((performance.now() - t0) / 1000) / 1e12);
    }
    return best;
  });
}

export interface Peak {
  tflops: number;
  /** Where it came from: "[log] peakTflops", "measured" or the cache file read. */
  source: string;
}

/** Where the probe of `dtype` at this process's threads is cached (file undefined: FLOTILLA_CACHE_DIR=off), under which key. */
export function peakCacheEntry(dtype: DType, env: NodeJS.ProcessEnv = process.env): { dir: string | undefined; key: string; file: string | undefined } {
  const dir = cacheDir('mfu', env);
  const key = `${cpus()[0]?.model ?? 'cpu'} x${getNumThreads()} threads ${dtype}`;
  return { dir, key, file: dir && join(dir, `peak-${key.replace(/[^\w.-]+/g, '_')}.json`) };
}

/**
 * [log] peakTflops, or the cached probe for this machine and dtype, or a new probe; on one rank. A probe
 * is cached only when the machine had a core to spare (1-minute load average below the core count):
 * one measured while other work held the cores reads low (2.6x on a 2-core machine running test suites)
 * and would make every later run's MFU too high, so it serves this run alone.
 */
export function peakTflops(given: number, dtype: DType, env: NodeJS.ProcessEnv = process.env, load: () => number = () => loadavg()[0]!): Peak {
  if (given > 0) return { tflops: given, source: '[log] peakTflops' };
  const { dir, key, file } = peakCacheEntry(dtype, env);
  if (file) {
    try {
      const c = JSON.parse(readFileSync(file, 'utf8')) as { key: string; tflops: number };
      if (c.key === key && c.tflops > 0) return { tflops: c.tflops, source: file };
    } catch { /* not measured yet */ }
  }
  const tflops = probePeakTflops(dtype);
  const busy = load(), cores = cpus().length;
  if (busy >= cores) return { tflops, source: `measured (${N}x${N} ${dtype} GEMMs) under load average ${busy.toFixed(1)} on ${cores} cores, not cached` };
  if (file) {
    try {
      mkdirSync(dir!, { recursive: true });
      writeFileSync(`${file}.${process.pid}.tmp`, `${JSON.stringify({ key, tflops })}\n`);
      renameSync(`${file}.${process.pid}.tmp`, file);
    } catch { /* an unwritable cache only costs a probe next time */ }
  }
  return { tflops, source: `measured (${N}x${N} ${dtype} GEMMs), cached in ${file ?? '(FLOTILLA_CACHE_DIR=off)'}` };
}

/** Rank 0's peakTflops, on every rank of the world (a collective). */
export function worldPeakTflops(world: ProcessGroup, given: number, dtype: DType): Peak {
  return broadcastJson(world, world.rank === 0 ? peakTflops(given, dtype) : undefined);
}
