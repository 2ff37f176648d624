// A model flotilla does not know (the MLP-Mixer of examples/own_model/model.ts, with its own loss
// and two tensors passed between layers) trained through parallelize() equals one process: data
// parallel, ZeRO-3 with a unit policy by class, pp=2 with 1F1B (and zero bubble), pp=2 x ZeRO-2,
// pp=2 x ZeRO-3 (the unit policy leaves the embedding and the head outside the units, so each stage
// has a root unit of its own), pp=2 over HSDP with the layout's non-default accumulation flavour
// (reduceScatterEachAllReduceLast, under zero bubble), and tensor parallelism from the model's own plan (tp=2, and tp=2 x pp=2),
// also with LoRA adapters on its Linears.
// Every rank's losses and parameters against the whole model on the whole batch, in float64.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { maxRelDiff } from './helpers/close.js';
import { runWorld, describeWorld } from './helpers/world.js';
import { readPipelineRun } from './helpers/pipeline_runs.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-user-'));
const script = 'test/fixtures/user_model_rank.ts';

interface Out { rank: number; losses: number[]; params: Record<string, number[]>; held: number; written: Record<string, number>; frozenMoved?: string[]; frozenHeld?: Record<string, number> }
interface Run { name: string; layout?: Record<string, unknown>; micro: number; frozen?: string[]; save?: string; load?: string; lora?: { rank: number; targets: string[] } }

async function launch(nproc: number, runs: Run[]): Promise<void> {
  const r = await runWorld({ nproc, script, args: [JSON.stringify({ out: dir, runs })], timeoutMs: 240_000 });
  assert.deepEqual(r.codes, new Array(nproc).fill(0), describeWorld(r));
}

function compare(name: string, nproc: number, opts: { split?: boolean; sliced?: number; ref?: string } = {}): void {
  const ref = readPipelineRun<Out>(dir, opts.ref ?? 'ref', 1)[0]!;
  const covered = new Set<string>();
  const written = new Map<string, number>();
  for (const o of readPipelineRun<Out>(dir, name, nproc)) {
    for (const [k, n] of Object.entries(o.written)) written.set(k, (written.get(k) ?? 0) + n);
    const dl = maxRelDiff(o.losses, ref.losses);
    assert.ok(dl <= 1e-7, `${name}: rank ${o.rank} losses differ from one process by ${dl} (${o.losses} vs ${ref.losses})`);
    for (const [k, v] of Object.entries(o.params)) {
      assert.ok(k in ref.params, `${name}: rank ${o.rank} holds ${k}, which the whole model does not have`);
      const d = maxRelDiff(v, ref.params[k]!);
      assert.ok(d <= 1e-7, `${name}: rank ${o.rank} parameter ${k} differs from one process by ${d}`);
      covered.add(k);
    }
    // Tensor parallelism: the rank held slices (fewer elements than its parameters' whole tensors).
    if (opts.sliced) {
      const wholeHeld = Object.values(o.params).reduce((a, v) => a + v.length, 0);
      assert.equal(wholeHeld - o.held, opts.sliced, `${name}: rank ${o.rank} holds ${o.held} of its parameters' ${wholeHeld} elements`);
    }
    if (opts.split) assert.ok(Object.keys(o.params).length < Object.keys(ref.params).length, `${name}: rank ${o.rank} holds the whole model`);
  }
  assert.deepEqual(Object.keys(ref.params).filter((k) => !covered.has(k)), [], `${name}: parameters no rank holds`);
  // The model's placements(): over the world every element of every parameter is written once.
  for (const [k, v] of Object.entries(ref.params)) assert.equal(written.get(k), v.length, `${name}: placements() write ${written.get(k)} of ${k}'s ${v.length} elements`);
}

// Frozen before parallelize (requiresGrad = false): the input projection (outside the units), all of
// block 2 (a ZeRO-3 unit with nothing to train) and one matrix of block 3.
const FROZEN = ['^0\\.', '^2\\.', '^3\\.fc\\.weight$'];
const isFrozen = (k: string): boolean => FROZEN.some((f) => new RegExp(f).test(k));
// LoRA adapters on every Linear (the blocks' fc and out, split by the model's own tp plan, and the
// head's, replicated), the rest frozen by applyLora.
const LORA = { lora: { rank: 2, targets: ['all-linear'] }, frozen: ['^(?!.*\\.lora[AB]\\.weight$)'] };
const ref = launch(1, [{ name: 'ref', micro: 1 }, { name: 'ref_frozen', micro: 1, frozen: FROZEN }, { name: 'ref_lora', micro: 1, ...LORA }]);

/** A LoRA run against one process's LoRA run: losses, parameters, and the frozen base unmoved. */
function compareLora(name: string, nproc: number, opts: { split?: boolean } = {}): void {
  compare(name, nproc, { ...opts, ref: 'ref_lora' });
  const lref = readPipelineRun<Out>(dir, 'ref_lora', 1)[0]!;
  assert.ok(lref.params['1.out.loraB.weight']!.some((x) => x !== 0), 'the adapters trained');
  for (const o of readPipelineRun<Out>(dir, name, nproc)) {
    assert.deepEqual(o.frozenMoved, [], `${name}: rank ${o.rank} moved the frozen base`);
    assert.ok(Object.keys(o.params).some((k) => k.endsWith('.fc.loraA.weight')), `${name}: rank ${o.rank} holds adapters`);
  }
}

test('your own model on 2 ranks: data parallel, ZeRO-3 with units by class, pp=2 with 1F1B and zero bubble, tp=2 with its own plan (also with LoRA adapters): equal to one process', async () => {
  await Promise.all([ref, launch(2, [
    { name: 'dp', layout: {}, micro: 2 },
    { name: 'z3', layout: { zero: 3 }, micro: 2 },
    { name: 'pp2_1f1b', layout: { pp: 2, ppSchedule: '1f1b' }, micro: 4 },
    { name: 'pp2_zb', layout: { pp: 2, ppSchedule: 'zb' }, micro: 4 },
    { name: 'tp2', layout: { tp: 2 }, micro: 2 },
    { name: 'frozen_dp', layout: {}, micro: 2, frozen: FROZEN, save: 'ck_dp' },
    { name: 'frozen_z3', layout: { zero: 3 }, micro: 2, frozen: FROZEN, save: 'ck_z3' },
    // The checkpoints loaded under the other layout (frozen parameters sharded one way, whole the other).
    { name: 'frozen_load_z3_into_dp', layout: {}, micro: 2, frozen: FROZEN, load: 'ck_z3' },
    { name: 'frozen_load_dp_into_z3', layout: { zero: 3 }, micro: 2, frozen: FROZEN, load: 'ck_dp' },
    { name: 'frozen_pp2', layout: { pp: 2, ppSchedule: '1f1b' }, micro: 4, frozen: FROZEN },
    { name: 'frozen_pp2_zb', layout: { pp: 2, ppSchedule: 'zb' }, micro: 4, frozen: FROZEN },
    { name: 'frozen_tp2', layout: { tp: 2 }, micro: 2, frozen: FROZEN },
    { name: 'lora_tp2', layout: { tp: 2 }, micro: 2, ...LORA },
  ])]);
  compareLora('lora_tp2', 2);
  compare('dp', 2);
  compare('z3', 2);
  compare('pp2_1f1b', 2, { split: true });
  compare('pp2_zb', 2, { split: true });
  compare('tp2', 2, { sliced: 4 * (72 + 64) }); // per block: half of fc's 16 x 8 weight and 16 biases, half of out's 8 x 16 weight
  // Frozen parameters: against one process training the same frozen model; placed (every element
  // written once), unchanged to the bit on every rank, and under ZeRO-3 split over the ranks.
  const fref = readPipelineRun<Out>(dir, 'ref_frozen', 1)[0]!;
  assert.equal(Object.keys(fref.params).filter(isFrozen).length, 14);
  assert.notDeepEqual(fref.params['1.fc.weight'], readPipelineRun<Out>(dir, 'ref', 1)[0]!.params['1.fc.weight'], 'freezing changed nothing');
  for (const [name, opts] of [['frozen_dp', {}], ['frozen_z3', {}], ['frozen_pp2', { split: true }], ['frozen_pp2_zb', { split: true }], ['frozen_tp2', { sliced: 4 * (72 + 64) }]] as const) {
    compare(name, 2, { ...opts, ref: 'ref_frozen' });
    for (const o of readPipelineRun<Out>(dir, name, 2)) {
      assert.deepEqual(o.frozenMoved, [], `${name}: rank ${o.rank} moved frozen parameters`);
      for (const k of Object.keys(o.params).filter(isFrozen)) assert.deepEqual(o.params[k], fref.params[k], `${name}: rank ${o.rank}: frozen ${k} changed`);
    }
  }
  // Checkpoint round trips of the partly frozen model across layouts: every parameter comes back.
  for (const [from, into] of [['frozen_z3', 'frozen_load_z3_into_dp'], ['frozen_dp', 'frozen_load_dp_into_z3']]) {
    const saved = readPipelineRun<Out>(dir, from!, 2)[0]!.params;
    for (const o of readPipelineRun<Out>(dir, into!, 2)) assert.deepEqual(o.params, saved, `${into}: rank ${o.rank} loaded other values than ${from} saved`);
  }
  const z3 = readPipelineRun<Out>(dir, 'frozen_z3', 2);
  for (const [k, v] of Object.entries(fref.params).filter(([k]) => isFrozen(k))) {
    const held = z3.map((o) => o.frozenHeld![k]!);
    assert.equal(held[0]! + held[1]!, v.length, `frozen_z3: ${k} held ${held.join(' + ')} of ${v.length}`);
  }
  // Each rank holds half of the frozen elements (its shard of each unit's frozen region; a small parameter may lie in one shard).
  const total = Object.entries(fref.params).filter(([k]) => isFrozen(k)).reduce((a, [, v]) => a + v.length, 0);
  for (const o of z3) {
    const mine = Object.values(o.frozenHeld!).reduce((a, b) => a + b, 0);
    assert.ok(mine <= total / 2 + 8 && mine > 0, `frozen_z3: rank ${o.rank} holds ${mine} of the ${total} frozen elements`);
  }
});

test('your own model on 4 ranks: pp=2 x ZeRO-2 over dp=2 (1F1B), pp=2 x ZeRO-3 with parameters outside the units, pp=2 x HSDP accumulating reduceScatterEachAllReduceLast, tp=2 x pp=2 (also with LoRA adapters): equal to one process', async () => {
  await Promise.all([ref, launch(4, [
    { name: 'pp2_z2', layout: { pp: 2, zero: 2, ppSchedule: '1f1b' }, micro: 2 },
    { name: 'pp2_z3', layout: { pp: 2, zero: 3, ppSchedule: '1f1b' }, micro: 2 },
    { name: 'pp2_hsdp_rs', layout: { pp: 2, zero: 2, dpReplicate: 2, accumulate: 'reduceScatterEachAllReduceLast', ppSchedule: 'zb' }, micro: 2 },
    { name: 'tp2_pp2', layout: { tp: 2, pp: 2, ppSchedule: '1f1b' }, micro: 2 },
    { name: 'lora_tp2_pp2', layout: { tp: 2, pp: 2, ppSchedule: '1f1b' }, micro: 2, ...LORA },
  ])]);
  compare('pp2_z2', 4, { split: true });
  compare('pp2_z3', 4, { split: true });
  compare('pp2_hsdp_rs', 4, { split: true });
  compare('tp2_pp2', 4, { split: true, sliced: 2 * (72 + 64) }); // two blocks per stage
  compareLora('lora_tp2_pp2', 4, { split: true });
});
