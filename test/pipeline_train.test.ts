// Pipeline parallel training on real ranks over loopback equals single-process training of the
// whole model on the whole batch: every schedule (GPipe, 1F1B, interleaved with 2 virtual stages,
// zero bubble) on 2 stages / 2 ranks and 4 stages / 4 ranks, pp=2 x dp=2, and tied embeddings
// across the first and last stage; pp=2 x dp=2 with ZeRO-1, 2 and 3 on the dp dimension under
// every schedule (tied embeddings included); pp=2 over HSDP with unequal sizes (dpShard 2 x
// dpReplicate 3, 12 ranks). Runs share world launches to keep the suite fast: every one-process
// reference in one world of one, the 2-rank runs in one world, the 4-rank runs of two tests in one,
// the 12-rank pair in one; the four worlds are queued when the file loads, two at a time
// (test/helpers/pool.ts), and each test awaits the worlds it reads.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { maxRelDiff } from './helpers/close.js';
import { launchPipelineRuns, readPipelineRun } from './helpers/pipeline_runs.js';
import { pool, started } from './helpers/pool.js';
import type { Run } from './fixtures/pipeline_rank.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-pp-'));
const SCHEDULES = [['gpipe', 1], ['1f1b', 1], ['interleaved', 2], ['zb', 1]] as const;

function run(name: string, pp: number, dp: number, schedule: Run['schedule'], v: number, tie: boolean, accum = 1, zero: Run['zero'] = 0, dpReplicate = 1): Run {
  return { name, pp, dp, schedule, v, tie, steps: 5, micro: 4, b: 2, nLayer: 8, accum, zero, dpReplicate };
}

interface Out { rank: number; losses: number[]; params: Record<string, number[]>; stateBytes: number }




/** Every rank's losses and parameters against the reference; every parameter held somewhere. */
function compare(name: string, nproc: number, refName: string, opts: { wholeOnOneRank?: boolean } = {}): void {
  const ref = readPipelineRun<Out>(dir, refName, 1)[0]!;
  const outs = readPipelineRun<Out>(dir, name, nproc);
  const covered = new Set<string>();
  for (const o of outs) {
    const dl = maxRelDiff(o.losses, ref.losses);
    assert.ok(dl <= 1e-5, `${name}: rank ${o.rank} losses differ from single-process by ${dl} (${o.losses} vs ${ref.losses})`);
    for (const [k, v] of Object.entries(o.params)) {
      assert.ok(k in ref.params, `${name}: rank ${o.rank} holds ${k}, which the whole model does not have`);
      const d = maxRelDiff(v, ref.params[k]!);
      assert.ok(d <= 1e-5, `${name}: rank ${o.rank} parameter ${k} differs from single-process by ${d}`);
      covered.add(k);
    }
  }
  const missing = Object.keys(ref.params).filter((k) => !covered.has(k));
  assert.deepEqual(missing, [], `${name}: parameters no rank holds`);
  // No rank builds the whole model: each holds a strict subset of its parameters.
  if (!opts.wholeOnOneRank) {
    for (const o of outs) assert.ok(Object.keys(o.params).length < Object.keys(ref.params).length, `${name}: rank ${o.rank} holds every parameter`);
  }
}

const queue = pool();
/**
 * One world running `runs` one after another, queued now. It is killed as hung after 20 s per run
 * (at least 5 minutes): a loaded 2-core machine runs a world of 11 runs for more than 2 minutes.
 */
const launch = (nproc: number, runs: Run[]): Promise<void> => started(queue(() => launchPipelineRuns('train', dir, nproc, runs, Math.max(300_000, 20_000 * runs.length))));

// The references (the whole model on the global batch of dp = 1, 2 and 6), and pp = 1 (consecutive
// stages on one rank hand over locally, a tied embedding's two copies live on the same rank) in the
// same world of one.
const refs = launch(1, [
  run('ref', 0, 1, 'gpipe', 1, false), run('ref_tied', 0, 1, 'gpipe', 1, true), run('ref_dp2', 0, 2, 'gpipe', 1, false),
  run('ref_dp2_tied', 0, 2, 'gpipe', 1, true),
  run('pp1_tied_interleaved', 1, 1, 'interleaved', 2, true), run('pp1_zb', 1, 1, 'zb', 1, false),
  run('ref_dp6', 0, 6, 'gpipe', 1, false), run('ref_dp6_tied', 0, 6, 'gpipe', 1, true),
]);

const runs2 = SCHEDULES.flatMap(([s, v]) => [run(`pp2_${s}`, 2, 1, s, v, false), run(`pp2_tied_${s}`, 2, 1, s, v, true)]);
// Gradient accumulation across steps: two pipeline steps of 2 micro-batches per optimizer step.
runs2.push(run('pp2_tied_accum_zb', 2, 1, 'zb', 1, true, 2));
const world2 = launch(2, runs2);

const runs4 = SCHEDULES.flatMap(([s, v]) => [run(`pp4_${s}`, 4, 1, s, v, false), run(`pp2dp2_${s}`, 2, 2, s, v, false)]);
runs4.push(run('pp2dp2_accum_1f1b', 2, 2, '1f1b', 1, false, 2));
const zeroRuns = [
  run('z1_1f1b', 2, 2, '1f1b', 1, false, 1, 1), run('z1_zb', 2, 2, 'zb', 1, false, 1, 1),
  run('z2_1f1b', 2, 2, '1f1b', 1, false, 1, 2), run('z2_zb', 2, 2, 'zb', 1, false, 1, 2),
  run('z1_gpipe', 2, 2, 'gpipe', 1, false, 1, 1), run('z2_interleaved', 2, 2, 'interleaved', 2, false, 1, 2),
  run('z2_tied_zb', 2, 2, 'zb', 1, true, 1, 2), run('z1_tied_1f1b', 2, 2, '1f1b', 1, true, 1, 1),
  run('z2_tied_accum_1f1b', 2, 2, '1f1b', 1, true, 2, 2),
  run('z3_1f1b', 2, 2, '1f1b', 1, false, 1, 3), run('z3_zb', 2, 2, 'zb', 1, false, 1, 3),
  run('z3_tied_interleaved', 2, 2, 'interleaved', 2, true, 1, 3), run('z3_tied_gpipe', 2, 2, 'gpipe', 1, true, 1, 3),
  run('z3_tied_accum_zb', 2, 2, 'zb', 1, true, 2, 3),
];
const world4 = launch(4, [...runs4, ...zeroRuns]);

const runs12 = [run('pp2_hsdp_s2r3_z2', 2, 6, '1f1b', 1, false, 1, 2, 3), run('pp2_hsdp_s2r3_z3_tied', 2, 6, 'zb', 1, true, 1, 3, 3)];
const world12 = launch(12, runs12);

test('2 stages on 2 ranks, every schedule, untied and tied embeddings, accumulation across steps, and pp=1: 5 steps equal single-process training', async () => {
  await Promise.all([refs, world2]);
  for (const [s] of SCHEDULES) {
    compare(`pp2_${s}`, 2, 'ref');
    compare(`pp2_tied_${s}`, 2, 'ref_tied');
  }
  compare('pp2_tied_accum_zb', 2, 'ref_tied');
  compare('pp1_tied_interleaved', 1, 'ref_tied', { wholeOnOneRank: true });
  compare('pp1_zb', 1, 'ref', { wholeOnOneRank: true });
});

test('4 stages on 4 ranks and pp=2 x dp=2, every schedule, accumulation across steps: 5 steps equal single-process training', async () => {
  await Promise.all([refs, world4]);
  for (const [s] of SCHEDULES) {
    compare(`pp4_${s}`, 4, 'ref');
    compare(`pp2dp2_${s}`, 4, 'ref_dp2');
  }
  compare('pp2dp2_accum_1f1b', 4, 'ref_dp2');
});

test('pp=2 x dp=2 with ZeRO-1, ZeRO-2 and ZeRO-3 over dp, every schedule, tied embeddings and accumulation across steps: 5 steps equal single-process training', async () => {
  const runs = zeroRuns;
  await Promise.all([refs, world4]);
  for (const r of runs) compare(r.name, 4, r.tie ? 'ref_dp2_tied' : 'ref_dp2');
  // The optimizer state is sharded: AdamW keeps 2 float64 values per element it updates, each rank
  // about half of its stages' elements (buckets are padded to an even length).
  for (const r of runs) {
    for (const o of readPipelineRun<Out>(dir, r.name, 4)) {
      const local = Object.values(o.params).reduce((n, v) => n + v.length, 0);
      assert.ok(o.stateBytes <= 16 * (local / 2 + 64), `${r.name}: rank ${o.rank} holds ${o.stateBytes} bytes of optimizer state for ${local} local elements`);
    }
  }
});

test('pp=2 over HSDP with unequal sizes (dpShard 2 x dpReplicate 3, ZeRO-2 and ZeRO-3, 12 ranks): 5 steps equal single-process training', async () => {
  await Promise.all([refs, world12]);
  compare('pp2_hsdp_s2r3_z2', 12, 'ref_dp6');
  compare('pp2_hsdp_s2r3_z3_tied', 12, 'ref_dp6_tied');
});
