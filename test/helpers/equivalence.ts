// Layout equivalence against one process, as the layout suites check it: a fixture trains named runs
// in a world and writes, per rank, its losses, gradient norms and the whole parameters it holds
// (readPipelineRun); every rank's are compared with the one-process run's, and every parameter of
// the model must be held by some rank. No side effects at import.
import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { maxRelDiff, relDiff, scaledDiff } from './close.js';
import { runWorld, describeWorld } from './world.js';
import { readPipelineRun } from './pipeline_runs.js';
import { pool, started } from './pool.js';

/** Relative difference; equal values (a step both sides skipped: loss and norm 0) differ by 0. */
const rel = (a: number, b: number): number => (a === b ? 0 : relDiff(a, b));

/** What a layout fixture writes for each rank of a run. */
export interface RankResult {
  rank: number;
  losses: number[];
  /** Gradient norms before clipping, one per step. */
  norms: number[];
  params: Record<string, number[]>;
}

export interface Tolerance {
  /** Relative, per step. */
  loss: number;
  norm: number;
  /** Per parameter: the largest relative difference (maxRelDiff), or with `scaled` the largest difference over the reference's largest element. */
  param: number;
  scaled?: boolean;
}

/**
 * A suite's runs under one temporary directory: `launch` queues a world of `nproc` ranks of the
 * fixture training `runs` on `queue` (default: a pool of its own; pool.ts);
 * `compare` checks every rank of run `name` against the one-process run `refName` and returns the
 * ranks' results for a suite's own further checks.
 */
export function equivalenceSuite<Run, Out extends RankResult>(prefix: string, script: string, opts: { timeoutMs?: number; queue?: ReturnType<typeof pool> } = {}) {
  const dir = mkdtempSync(join(tmpdir(), `flotilla-${prefix}-`));
  const queue = opts.queue ?? pool();
  return {
    dir,
    launch(nproc: number, runs: Run[]): Promise<void> {
      return started(queue(async () => {
        const r = await runWorld({ nproc, script, args: [JSON.stringify({ out: dir, runs })], timeoutMs: opts.timeoutMs ?? 400_000 });
        assert.deepEqual(r.codes, new Array(nproc).fill(0), describeWorld(r));
      }));
    },
    read(name: string, nproc: number): Out[] {
      return readPipelineRun<Out>(dir, name, nproc);
    },
    compare(name: string, nproc: number, refName: string, tol: Tolerance, who: (o: Out) => string = (o) => `${name}: rank ${o.rank}`): { ref: Out; outs: Out[] } {
      const ref = readPipelineRun<Out>(dir, refName, 1)[0]!;
      const outs = readPipelineRun<Out>(dir, name, nproc);
      assert.ok(ref.losses.length > 0, `${refName}: the one-process run took no step`);
      const covered = new Set<string>();
      for (const o of outs) {
        const w = who(o);
        assert.equal(o.losses.length, ref.losses.length, `${w}: ${o.losses.length} steps against one process's ${ref.losses.length}`);
        // Norms first: a wrong step-0 norm is the cause of every later difference.
        o.norms.forEach((v, i) => assert.ok(rel(v, ref.norms[i]!) <= tol.norm, `${w}: gradient norm at step ${i} ${v} vs one process ${ref.norms[i]} (relative ${rel(v, ref.norms[i]!)})`));
        o.losses.forEach((v, i) => assert.ok(rel(v, ref.losses[i]!) <= tol.loss, `${w}: loss at step ${i} ${v} vs one process ${ref.losses[i]} (relative ${rel(v, ref.losses[i]!)})`));
        for (const [k, v] of Object.entries(o.params)) {
          assert.ok(k in ref.params, `${w} holds ${k}, which the whole model does not have`);
          assert.equal(v.length, ref.params[k]!.length, `${w}: ${k} is not whole (${v.length} of ${ref.params[k]!.length} elements)`);
          const d = tol.scaled ? scaledDiff(v, ref.params[k]!) : maxRelDiff(v, ref.params[k]!);
          assert.ok(d <= tol.param, `${w}: parameter ${k} differs from one process by ${d}`);
          covered.add(k);
        }
      }
      assert.deepEqual(Object.keys(ref.params).filter((k) => !covered.has(k)), [], `${name}: parameters no rank holds`);
      return { ref, outs };
    },
  };
}
