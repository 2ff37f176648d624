// Pipeline evaluation and hybrid sharding inside a pipeline, on real ranks over loopback, against
// single-process training and evaluation of the whole model (float64):
// - PipelineParallel.evaluate (forward only, the same sends and receives) equals the whole model's
//   validation loss on the same weights and batches within 1e-9, on every rank, for 1F1B, interleaved
//   (2 virtual stages, tied embeddings) and zero bubble on pp=2, for pp=2 x dp=2 with ZeRO-3, and for
//   pp=1 with 2 virtual stages;
//   evaluations run between steps (ZeRO-1/2 parameter gathers in flight, ZeRO-3 units freed) and
//   training after them still equals one process;
// - HSDP inside a pipeline (pp=2 x dpReplicate=2 x dpShard=1, the trainer's mesh) with ZeRO-1/2/3:
//   losses, gradient norms (replicas counted once) and parameters equal one process.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { maxRelDiff } from './helpers/close.js';
import { launchPipelineRuns, readPipelineRun } from './helpers/pipeline_runs.js';
import type { Run } from './fixtures/pipeline_rank.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-ppeval-'));

interface Out { rank: number; losses: number[]; norms: number[]; evals: number[]; params: Record<string, number[]> }

function run(name: string, pp: number, dp: number, schedule: Run['schedule'], v: number, tie: boolean, zero: Run['zero'] = 0, dpReplicate = 1): Run {
  return { name, pp, dp, schedule, v, tie, steps: 3, micro: 4, b: 2, nLayer: 4, zero, dpReplicate };
}




/** Every rank's evaluations, losses, norms and parameters against the single-process run. */
function compare(name: string, nproc: number, refName: string): void {
  const ref = readPipelineRun<Out>(dir, refName, 1)[0]!;
  assert.equal(ref.evals.length, 4, `${refName}: two evaluations of two batches each`);
  const covered = new Set<string>();
  for (const o of readPipelineRun<Out>(dir, name, nproc)) {
    const de = maxRelDiff(o.evals, ref.evals);
    assert.ok(de <= 1e-9, `${name}: rank ${o.rank} validation losses ${o.evals} differ from single-process ${ref.evals} by ${de}`);
    const dl = maxRelDiff(o.losses, ref.losses);
    assert.ok(dl <= 1e-9, `${name}: rank ${o.rank} losses ${o.losses} differ from single-process ${ref.losses} by ${dl}`);
    const dn = maxRelDiff(o.norms, ref.norms);
    assert.ok(dn <= 1e-9, `${name}: rank ${o.rank} gradient norms ${o.norms} differ from single-process ${ref.norms} by ${dn}`);
    for (const [k, v] of Object.entries(o.params)) {
      assert.ok(k in ref.params, `${name}: rank ${o.rank} holds ${k}, which the whole model does not have`);
      const d = maxRelDiff(v, ref.params[k]!);
      assert.ok(d <= 1e-9, `${name}: rank ${o.rank} parameter ${k} differs from single-process by ${d}`);
      covered.add(k);
    }
  }
  assert.deepEqual(Object.keys(ref.params).filter((k) => !covered.has(k)), [], `${name}: parameters no rank holds`);
}

// The references, and pp = 1 with 2 virtual stages (the stages hand over locally) in the same world of one.
const refs = launchPipelineRuns('eval', dir, 1, [
  run('ref', 0, 1, 'gpipe', 1, false), run('ref_tied', 0, 1, 'gpipe', 1, true),
  run('ref_dp2', 0, 2, 'gpipe', 1, false), run('ref_dp2_tied', 0, 2, 'gpipe', 1, true),
  run('e_pp1_tied_interleaved', 1, 1, 'interleaved', 2, true),
]);

test('pipeline evaluation equals the whole model\'s (1F1B, interleaved with tied embeddings, zero bubble, pp=1 with 2 stages; pp=2 x dp=2 with ZeRO-3), between training steps that still equal one process', async () => {
  const runs2 = [run('e_1f1b', 2, 1, '1f1b', 1, false), run('e_tied_interleaved', 2, 1, 'interleaved', 2, true), run('e_zb', 2, 1, 'zb', 1, false)];
  const runs4 = [run('e_z3_1f1b', 2, 2, '1f1b', 1, false, 3), run('e_z3_tied_interleaved', 2, 2, 'interleaved', 2, true, 3)];
  await Promise.all([refs, launchPipelineRuns('eval', dir, 2, runs2), launchPipelineRuns('eval', dir, 4, runs4)]);
  for (const r of runs2) compare(r.name, 2, r.tie ? 'ref_tied' : 'ref');
  for (const r of runs4) compare(r.name, 4, r.tie ? 'ref_dp2_tied' : 'ref_dp2');
  compare('e_pp1_tied_interleaved', 1, 'ref_tied');
});

test('HSDP inside a pipeline (pp=2 x dpReplicate=2 x dpShard=1) with ZeRO-1, 2 and 3: losses, norms, parameters and evaluation equal one process', async () => {
  const runs = [
    run('h_z1_1f1b', 2, 2, '1f1b', 1, false, 1, 2), run('h_z2_zb', 2, 2, 'zb', 1, false, 2, 2),
    run('h_z3_tied_interleaved', 2, 2, 'interleaved', 2, true, 3, 2),
  ];
  await Promise.all([refs, launchPipelineRuns('eval', dir, 4, runs)]);
  for (const r of runs) compare(r.name, 4, r.tie ? 'ref_dp2_tied' : 'ref_dp2');
});
