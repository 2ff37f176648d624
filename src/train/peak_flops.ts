// One rank's peak TFLOP/s, the MFU's denominator: [log] peakTflops when given, else measured once by
// a short matmul probe and cached in the user's cache directory (src/io/cache_dir.ts: the `mfu`
// folder, peak-<key>.json), keyed by the CPU model, this rank's threads, the ranks sharing the host
// (every rank probes at once, as they train at once) and the dtype.
import { mkdirSync, readFileSync, renameSync, writeFileSync } from 'node:fs';
import { cpus } from 'node:os';
import { join } from 'node:path';
import { cacheDir } from '../io/cache_dir.js';
import { getNumThreads, randn, tidy, type DType } from '../tensor/index.js';

/** Square GEMMs of this size: large enough to reach the BLAS's rate, small enough for about a second. */
const N = 768;
const PROBE_SECONDS = 0.8;

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

/** [log] peakTflops, or the cached probe for this machine and dtype, or a new probe (cached). */
export function peakTflops(given: number, dtype: DType, ranksOnHost: number, env: NodeJS.ProcessEnv = process.env): Peak {
  if (given > 0) return { tflops: given, source: '[log] peakTflops' };
  const dir = cacheDir('mfu', env);
  const key = `${cpus()[0]?.model ?? 'cpu'} x${getNumThreads()} threads x${ranksOnHost} ranks ${dtype}`;
  const file = dir && join(dir, `peak-${key.replace(/[^\w.-]+/g, '_')}.json`);
  if (file) {
    try {
      const c = JSON.parse(readFileSync(file, 'utf8')) as { key: string; tflops: number };
      if (c.key === key && c.tflops > 0) return { tflops: c.tflops, source: file };
    } catch { /* not measured yet */ }
  }
  const tflops = probePeakTflops(dtype);
  if (file) {
    try {
      mkdirSync(dir!, { recursive: true });
      writeFileSync(`${file}.${process.pid}.tmp`, `${JSON.stringify({ key, tflops })}\n`);
      renameSync(`${file}.${process.pid}.tmp`, file);
    } catch { /* an unwritable cache only costs a probe next time */ }
  }
  return { tflops, source: `measured (${N}x${N} ${dtype} GEMMs), cached in ${file ?? '(FLOTILLA_CACHE_DIR=off)'}` };
}
