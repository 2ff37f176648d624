// [Note: elastic micro-batches] An elastic job on fewer ranks than it started with keeps the global
// batch, so each data-parallel rank's share grows, and with it the memory its activations take, which
// grows with the samples in one micro-batch. The micro-batches per step are raised so that one holds no
// more samples than at the start (FLOTILLA_ELASTIC_WORLD, set by the launcher: the world size of the
// first meeting): the smallest count, at least the config's, that divides the rank's share and keeps
// its micro-batches that small. The global batch and the sample order stay; the numbers are those of a
// plain run with that data.microBatches. When no count fits, the config's stays.
import { launcherEnv } from '../distributed/launcher_env.js';
import { resolveLayout } from '../parallel/layout.js';
import type { FlotillaConfig } from '../config/schema.js';

/** The micro-batches per step on `worldSize` ranks of an elastic job, and why when raised. */
export function elasticMicroBatches(cfg: FlotillaConfig, worldSize: number, env: Record<string, string | undefined> = process.env): { microBatches: number; why?: string } {
  const M = cfg.data.microBatches;
  const first = launcherEnv(env).firstWorld;
  if (first === undefined || first <= worldSize) return { microBatches: M };
  let dpFirst: number, dpNow: number;
  try {
    dpFirst = resolveLayout(cfg.parallel, first).dp;
    dpNow = resolveLayout(cfg.parallel, worldSize).dp;
  } catch {
    return { microBatches: M }; // a layout that does not fit is the trainer's to report
  }
  const cap = cfg.data.globalBatch / (dpFirst * M); // samples in one micro-batch at the start
  const share = cfg.data.globalBatch / dpNow; // this rank's samples per step now
  if (!Number.isInteger(share)) return { microBatches: M };
  for (let m = M; m <= share; m++) {
    if (share % m !== 0 || share / m > cap) continue;
    return m === M ? { microBatches: M } : {
      microBatches: m,
      why: `micro-batches raised ${M} -> ${m} (${share / m} sample(s) each, as on the ${first} rank(s) the job started with)`,
    };
  }
  return { microBatches: M };
}
