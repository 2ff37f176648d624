// The planner's enumeration and its refusals, without starting any process: every layout it lists
// passes the project's own checks on that world, and applying its overrides to the config gives that
// layout back; layouts the checks refuse are never listed; every [parallel] field is described by a
// layout axis (so a new field cannot be left out of the memory and time model); and the axes' terms
// add up across a pipeline's stages and tensor-parallel shards.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { loadConfig } from '../src/config/index.js';
import { validateConfig } from '../src/config/validate.js';
import { layoutProblems, PARALLEL_DEFAULTS } from '../src/parallel/layout.js';
import { enumerateLayouts, LAYOUT_FIELDS, FIELD_SECTION } from '../src/plan/enumerate.js';
import { PLAN_AXES, PLANNER_FIELDS } from '../src/plan/axes.js';
import { budgetOf, computeScaleOf, contextFor, inStepCosts, predict, type Measurements } from '../src/plan/predict.js';
import { probeLayout, type CommTable } from '../src/plan/calibrate.js';
import { modelFacts } from '../src/plan/facts.js';
import { pinnedFields } from '../src/plan/plan.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-plan-enum-'));
test.after(() => rmSync(dir, { recursive: true, force: true }));

function config(extra: string): string {
  const file = join(dir, `c${Math.random().toString(36).slice(2)}.toml`);
  writeFileSync(file, `[model]\nvocabSize = 256\nnLayer = 4\nnHead = 4\nnEmbd = 64\nblockSize = 64\n[data]\nseqLen = 64\nglobalBatch = 8\n${extra}\n`);
  return file;
}

test('every listed layout passes the layout checks on its world, and its overrides give it back', () => {
  const file = config('');
  const cfg = loadConfig(file, []);
  for (const world of [2, 4]) {
    const all = enumerateLayouts(cfg, world);
    assert.ok(all.length > 50, `${all.length} layouts on ${world} ranks`);
    // Each axis is represented: pipelines (every schedule), tp with and without sp, cp, HSDP, every ZeRO stage, checkpointing, bf16.
    const has = (f: (l: (typeof all)[number]['layout']) => boolean, what: string) => assert.ok(all.some((c) => f(c.layout)), `${what} on ${world} ranks`);
    for (const s of ['gpipe', '1f1b', 'interleaved', 'zb']) has((l) => l.pp === 2 && l.ppSchedule === s, `pp=2 ${s}`);
    has((l) => l.tp === 2 && l.sequenceParallel, 'tp=2 + sp');
    has((l) => l.tp === 2 && !l.sequenceParallel, 'tp=2');
    has((l) => l.cp === 2, 'cp=2');
    for (const z of [0, 1, 2, 3]) has((l) => l.zero === z, `zero ${z}`);
    has((l) => l.activationCheckpoint === 'full' && l.precision === 'bf16-mixed', 'full checkpointing in bf16');
    if (world === 4) has((l) => l.dpReplicate === 2 && l.dpShard === 2, 'HSDP 2 x 2');
    // A sample of every tenth (all of them parse a TOML file each): round trip and checks.
    for (const [i, c] of all.entries()) {
      if (i % 10 !== 0) continue;
      const back = loadConfig(file, c.overrides);
      for (const f of LAYOUT_FIELDS) assert.equal((back[FIELD_SECTION[f]] as unknown as Record<string, unknown>)[f], c.layout[f], `${f} of ${c.overrides.join(' ')}`);
      assert.deepEqual(validateConfig(back), [], c.overrides.join(' '));
      assert.deepEqual(layoutProblems(back.parallel, world), [], c.overrides.join(' '));
      assert.equal(back.data.globalBatch % (c.layout.dp * c.layout.microBatches), 0);
    }
    assert.equal(new Set(all.map((c) => JSON.stringify(c.layout))).size, all.length, 'no layout twice');
  }
});

test('layouts the checks refuse are not listed', () => {
  // 3 heads: tp = 2 cannot split them; dropout: no ring attention (cp); 1 block: no pipeline.
  const heads = enumerateLayouts(loadConfig(config(''), ['--model.nHead=1', '--model.nEmbd=63']), 4);
  assert.ok(heads.length > 0 && heads.every((c) => c.layout.tp === 1), 'nEmbd 63 / nHead 1 refuses tp 2 and 4');
  const drop = enumerateLayouts(loadConfig(config(''), ['--model.dropout=0.1']), 2);
  assert.ok(drop.length > 0 && drop.every((c) => c.layout.cp === 1), 'dropout refuses cp');
  const one = enumerateLayouts(loadConfig(config(''), ['--model.nLayer=1']), 2);
  assert.ok(one.length > 0 && one.every((c) => c.layout.pp === 1), 'one block refuses pp 2');
  // Interleaving needs pp x 2 blocks: 3 blocks on pp = 2 have none.
  assert.ok(enumerateLayouts(loadConfig(config(''), ['--model.nLayer=3']), 2).every((c) => c.layout.ppSchedule !== 'interleaved' || c.layout.pp === 1));
  // A global batch of 2 does not split into 4 data-parallel ranks x micro-batches.
  assert.ok(enumerateLayouts(loadConfig(config(''), ['--data.globalBatch=2']), 4).every((c) => c.layout.dp * c.layout.microBatches <= 2));
  // Every refusal is the project's: with a plain data-parallel world of 3 and 4 heads, tp = 3 is refused.
  assert.ok(enumerateLayouts(loadConfig(config(''), ['--data.globalBatch=6']), 3).every((c) => c.layout.tp === 1));
});

test('flags of layout fields pin them', () => {
  const file = config('');
  const o = ['--parallel.zero=3', '--train.precision=bf16-mixed'];
  const all = enumerateLayouts(loadConfig(file, o), 4, pinnedFields(o));
  assert.ok(all.length > 0);
  assert.ok(all.every((c) => c.layout.zero === 3 && c.layout.precision === 'bf16-mixed'));
});

test('every [parallel] field and every layout field is described by a layout axis or the planner', () => {
  const claimed = new Set<string>([...PLAN_AXES.flatMap((a) => a.fields), ...PLANNER_FIELDS]);
  for (const f of Object.keys(PARALLEL_DEFAULTS)) assert.ok(claimed.has(f), `[parallel] ${f} is in no plan axis (src/plan/axes.ts): describe what it holds and sends beside its code`);
  for (const f of LAYOUT_FIELDS) assert.ok(claimed.has(f), `layout field ${f} is in no plan axis`);
});

test('the terms add up: pipeline stages hold the whole model between them, tp shards divide it', () => {
  const cfg = loadConfig(config(''), []);
  const facts = modelFacts(cfg);
  assert.equal(facts.numParams, cfg.model.vocabSize * 64 * 2 + 64 * 64 + 4 * (12 * 64 * 64 + 13 * 64) + 2 * 64);
  const all = enumerateLayouts(cfg, 4);
  for (const c of all.filter((x) => x.layout.pp > 1 && x.layout.tp === 1 && x.layout.cp === 1 && x.layout.zero === 0)) {
    const stages = Array.from({ length: c.layout.pp }, (_, s) => budgetOf(contextFor(cfg, c.layout, facts, { nproc: 4, nnodes: 1 }, s)));
    assert.equal(stages.reduce((a, b) => a + b.params, 0), facts.numParams, c.overrides.join(' '));
    assert.equal(stages.reduce((a, b) => a + b.blocks, 0), cfg.model.nLayer);
    for (const b of stages) {
      assert.equal(b.memory.parameters, 4 * b.params);
      assert.equal(b.memory.optimizer, 8 * b.params);
      assert.ok(b.liveMicroBatches >= 1 && b.liveMicroBatches <= c.layout.microBatches);
    }
  }
  const tp = all.find((x) => x.layout.tp === 4 && x.layout.zero === 0)!;
  assert.equal(budgetOf(contextFor(cfg, tp.layout, facts, { nproc: 4, nnodes: 1 }, 0)).params, facts.numParams / 4);
  // ZeRO-3 over 4: a quarter of the parameters and optimizer state, plus two units gathered.
  const z3 = all.find((x) => x.layout.zero === 3 && x.layout.dp === 4 && x.layout.precision === 'fp32')!;
  const b = budgetOf(contextFor(cfg, z3.layout, facts, { nproc: 4, nnodes: 1 }, 0));
  assert.equal(b.memory.parameters, facts.numParams);
  assert.equal(b.memory.optimizer, 2 * facts.numParams);
  assert.equal(b.memory.zero3Gathers, 2 * 4 * facts.largestUnitParams);
});

test('HSDP: every bucket reduce-scattered in its shard group is all-reduced across replicas, once per reduce-scatter (a unit under ZeRO-3)', () => {
  const cfg = loadConfig(config(''), []);
  const facts = modelFacts(cfg);
  const hsdp = enumerateLayouts(cfg, 4).filter((x) => x.layout.dpReplicate === 2 && x.layout.dpShard === 2 && x.layout.pp === 1);
  for (const zero of [2, 3]) {
    for (const mb of [1, 2]) {
      const c = hsdp.find((x) => x.layout.zero === zero && x.layout.microBatches === mb);
      assert.ok(c, `HSDP 2 x 2 with ZeRO-${zero} and ${mb} micro-batches is listed`);
      const ops = budgetOf(contextFor(cfg, c.layout, facts, { nproc: 4, nnodes: 1 }, 0)).comm;
      const rs = ops.find((o) => o.what === 'gradient reduce-scatter')!;
      const ar = ops.find((o) => o.what === 'gradient all-reduce across replicas')!;
      assert.equal(ar.group, 2);
      assert.equal(ar.calls, rs.calls, c.overrides.join(' '));
      assert.equal(ar.times, rs.times, c.overrides.join(' '));
      assert.equal(ar.bytes, rs.bytes / 2, 'the shard of each bucket');
      if (zero === 3) assert.equal(ar.calls, cfg.model.nLayer + 1, 'one per unit: each block and the root');
    }
  }
});

test('groups that span hosts are marked: 2 hosts x 2 ranks', () => {
  const cfg = loadConfig(config(''), []);
  const facts = modelFacts(cfg);
  const all = enumerateLayouts(cfg, 4);
  const w = { nproc: 2, nnodes: 2 };
  const dp4 = all.find((x) => x.layout.dp === 4 && x.layout.zero === 0)!;
  const dpOps = budgetOf(contextFor(cfg, dp4.layout, facts, w, 0)).comm;
  assert.ok(dpOps.length > 0 && dpOps.every((o) => o.crossHost), 'dp over 4 ranks spans both hosts');
  const tp2 = all.find((x) => x.layout.tp === 2 && x.layout.dp === 2 && x.layout.zero === 0)!;
  const ops = budgetOf(contextFor(cfg, tp2.layout, facts, w, 0)).comm;
  assert.ok(ops.some((o) => o.what.includes('per block')) && ops.some((o) => o.what.startsWith('gradient')), ops.map((o) => o.what).join('; '));
  assert.ok(ops.filter((o) => o.group === 2 && o.what.includes('per block')).every((o) => !o.crossHost), 'tp pairs are neighbours on one host');
  assert.ok(ops.filter((o) => o.what.startsWith('gradient')).every((o) => o.crossHost), 'dp across the tp pairs spans hosts');
});

test('in-step collectives: a probe run\'s shortfall is spread over its in-step calls, and every layout with those calls pays it per call', () => {
  // [Note: in-step collectives] A model of constant costs: 1 ms per block forward and backward, 0.5 ms
  // per collective, no optimizer or loop time, so every price below is exact.
  const cfg = loadConfig(config(''), []);
  const one = loadConfig(config(''), ['--model.nLayer=1']);
  const flat: [number, number][] = [[1, 0.5], [2 ** 40, 0.5]];
  const comm: CommTable = { backend: 'gloo', worldSize: 4, table: Object.fromEntries(['allReduce', 'allGather', 'reduceScatter', 'sendRecv'].flatMap((op) => [2, 4].map((g) => [`${op}:${g}`, flat]))) };
  const part = { fwdMs: 1, bwdMs: 1, actBytes: 0 };
  const m: Measurements = {
    compute: (p) => ({ ...p, block: part, rest: { fwdMs: 0, bwdMs: 0, actBytes: 0 } }), optimizerNsPerParam: 0, comm, cores: 2,
    baseline: { bytes: 0, startupBytes: 0, stepMs: 0, zero3CallMs: 0, zero3MsPerMiB: 0 },
  };
  const w = { nproc: 4, nnodes: 1 };
  const layout = probeLayout('tp', one, 4);
  assert.deepEqual([layout.tp, layout.dp, layout.sequenceParallel], [2, 2, false]);
  const priced = predict(one, layout, modelFacts(one), w, m).stepMs;
  const calls = budgetOf(contextFor(one, layout, modelFacts(one), w, 0)).comm.filter((op) => op.inStep === 'tp').reduce((a, op) => a + (op.calls ?? 1) * op.times, 0);
  assert.equal(calls, 4, 'one block: two sums forward, two input gradients backward');
  const costs = inStepCosts([{ probe: 'tp', layout, stepMs: priced + 8 }], one, modelFacts(one), w, m, () => true);
  assert.equal(costs.tp, 2, '8 ms more than priced, over 4 calls');
  // A measurement under the price charges nothing.
  assert.equal(inStepCosts([{ probe: 'tp', layout, stepMs: priced - 5 }], one, modelFacts(one), w, m, () => true).tp, 0);
  // The reference ('dp': the same model under plain data parallelism, measured just before): what it
  // exceeds its own price by is not the collectives' (the probe model's mispricing, the machine's
  // speed in those minutes), and a probe is charged only what it exceeds its price by beyond that.
  const ref = probeLayout('dp', one, 4);
  assert.deepEqual([ref.dp, ref.tp, ref.zero], [4, 1, 0]);
  const refPriced = predict(one, ref, modelFacts(one), w, m).stepMs;
  const runs = [{ probe: 'dp' as const, layout: ref, stepMs: refPriced + 30 }, { probe: 'tp' as const, layout, stepMs: priced + 30 + 8 }];
  const against = inStepCosts(runs, one, modelFacts(one), w, m, () => true);
  assert.deepEqual(against, { tp: 2 }, '30 ms over price in both runs are not tp\'s; the 8 beyond are, over 4 calls; the reference is charged nothing');
  assert.deepEqual(inStepCosts([runs[1]!, { ...runs[0]!, stepMs: refPriced - 10 }], one, modelFacts(one), w, m, () => true), { tp: 12 }, 'a reference under its price: (38 + 10) / 4');
  // A reference whose shape was not calibrated is left out: the probe's own shortfall is charged.
  assert.deepEqual(inStepCosts(runs, one, modelFacts(one), w, m, (p) => p.samples === one.data.globalBatch / layout.dp), { tp: 9.5 });
  // [Note: trainer's pace] The reference's shortfall, over its priced compute, scales every layout's compute.
  const refP = predict(one, ref, modelFacts(one), w, m);
  const scale = computeScaleOf({ probe: 'dp', layout: ref, stepMs: refP.stepMs + 0.25 * refP.time.computeMs }, one, modelFacts(one), w, m);
  assert.ok(Math.abs(scale - 1.25) < 1e-9, `${scale}`);
  const paced = predict(cfg, layout, modelFacts(cfg), w, { ...m, computeScale: scale }), plain = predict(cfg, layout, modelFacts(cfg), w, m);
  assert.ok(Math.abs(paced.time.computeMs - 1.25 * plain.time.computeMs) < 1e-9 && paced.time.commMs === plain.time.commMs, 'compute scaled, collectives not');
  assert.equal(computeScaleOf({ probe: 'dp', layout: ref, stepMs: 100 * refP.stepMs }, one, modelFacts(one), w, m), 2, 'a reference far off what it could be is held to 2x');
  // The 4-block model's tp layouts pay 2 ms for each of their 16 in-step calls; the others nothing more.
  const withCost = { ...m, inStepCallMs: costs };
  for (const c of enumerateLayouts(cfg, 4).filter((x) => x.layout.pp === 1 && x.layout.microBatches === 1)) {
    const more = predict(cfg, c.layout, modelFacts(cfg), w, withCost).stepMs - predict(cfg, c.layout, modelFacts(cfg), w, m).stepMs;
    const expect = c.layout.tp > 1 && !c.layout.sequenceParallel ? 2 * 4 * cfg.model.nLayer : 0;
    assert.ok(Math.abs(more - expect) < 1e-9, `${c.overrides.join(' ')}: ${more} ms more, expected ${expect}`);
  }
});

test('tensor and sequence parallelism\'s activations: Megatron\'s count of a block (the norms\' and linears\' inputs whole, the rest split; sp splits the norms\' inputs too); under full checkpointing only the sharded block input', () => {
  // Constant calibration: a block keeps 16 MiB per micro-batch, the rest nothing.
  const cfg = loadConfig(config(''), []);
  const flat: [number, number][] = [[1, 0.5], [2 ** 40, 0.5]];
  const comm: CommTable = { backend: 'gloo', worldSize: 2, table: Object.fromEntries(['allReduce', 'allGather', 'reduceScatter', 'sendRecv'].flatMap((op) => [2].map((g) => [`${op}:${g}`, flat]))) };
  const block = 16 * 2 ** 20;
  const m: Measurements = {
    compute: (p) => ({ ...p, block: { fwdMs: 1, bwdMs: 1, actBytes: block }, rest: { fwdMs: 0, bwdMs: 0, actBytes: 0 } }), optimizerNsPerParam: 0, comm, cores: 2,
    baseline: { bytes: 0, startupBytes: 0, stepMs: 0, zero3CallMs: 0, zero3MsPerMiB: 0 },
  };
  const w = { nproc: 2, nnodes: 1 };
  const layouts = enumerateLayouts(cfg, 2).map((c) => c.layout).filter((l) => l.tp === 2 && l.pp === 1 && l.microBatches === 1 && l.precision === 'fp32');
  const act = (sp: boolean, ac: string) => {
    const l = layouts.find((x) => x.sequenceParallel === sp && x.activationCheckpoint === ac);
    assert.ok(l, `a tp=2 layout with sequenceParallel ${sp} and checkpointing ${ac} is listed`);
    return predict(cfg, l, modelFacts(cfg), w, m).stages[0]!.terms.activations;
  };
  const blocks = cfg.model.nLayer;
  // Width h 64, 4 heads, 64 tokens: a block is 34 h + 5 a s = 2176 + 1280 = 3456 (per s b); whole on
  // each tp rank 10 h = 640 (tp) or 4 h = 256 (sp), the rest halved.
  const close = (a: number, b: number, what: string) => assert.ok(Math.abs(a - b) < 1e-6 * b, `${what}: ${a} vs ${b}`);
  close(act(false, 'none'), blocks * block * (640 + (3456 - 640) / 2) / 3456, 'tp alone');
  close(act(true, 'none'), blocks * block * (256 + (3456 - 256) / 2) / 3456, 'sp: the norms\' inputs split too');
  close(act(true, 'selective'), act(true, 'none'), 'selective as none (the calibration measured the difference)');
  assert.equal(act(true, 'full'), blocks * block / 2, 'full checkpointing keeps the block input, sharded');
});

test('zero bubble keeps, per deferred weight gradient, the output gradients of a block\'s Linears (read from the model) and of the head', () => {
  const cfg = loadConfig(config(''), []);
  const facts = modelFacts(cfg);
  // The GPT's block: c_attn 3C, c_proj C, fc 4C, proj C.
  assert.equal(facts.blockLinearOutputs, 9 * cfg.model.nEmbd);
  const w = { nproc: 2, nnodes: 1 };
  const layouts = enumerateLayouts(cfg, 2).map((c) => c.layout).filter((l) => l.pp === 2 && l.microBatches === 4 && l.precision === 'fp32' && l.activationCheckpoint === 'none');
  const terms = (schedule: string, stage: number) => {
    const l = layouts.find((x) => x.ppSchedule === schedule);
    assert.ok(l, `pp=2 ${schedule} with 4 micro-batches is listed`);
    return budgetOf(contextFor(cfg, l, facts, w, stage)).memory.activations;
  };
  // ZB-H1 on 2 stages defers one W at a time on the first and two on the last (F0 I0 F1 I1 W0 ...);
  // micro-batches of 8 / 4 samples x 64 tokens; 2 blocks' Linears per stage, the head's logits on the last.
  const tokens = (8 / 4) * 64;
  assert.equal(terms('zb', 0), 1 * tokens * 4 * 2 * facts.blockLinearOutputs);
  assert.equal(terms('zb', 1), 2 * tokens * 4 * (2 * facts.blockLinearOutputs + cfg.model.vocabSize));
  assert.equal(terms('1f1b', 0), 0, 'a schedule without split backward keeps none');
});

test('shared cores: a pipeline\'s ranks run alone on a core in its bubbles, so 4 ranks on 2 cores cost the whole work over the cores, not the crowded timeline', () => {
  // [Note: shared cores] Constant calibration: 1 ms per block forward and backward with every rank of
  // the host computing at once; free collectives, no optimizer or loop time.
  const cfg = loadConfig(config(''), []);
  const flat: [number, number][] = [[1, 0], [2 ** 40, 0]];
  const comm: CommTable = { backend: 'gloo', worldSize: 4, table: Object.fromEntries(['allReduce', 'allGather', 'reduceScatter', 'sendRecv'].flatMap((op) => [2, 4].map((g) => [`${op}:${g}`, flat]))) };
  const m = (cores: number): Measurements => ({
    compute: (p) => ({ ...p, block: { fwdMs: 1, bwdMs: 1, actBytes: 0 }, rest: { fwdMs: 0, bwdMs: 0, actBytes: 0 } }), optimizerNsPerParam: 0, comm, cores,
    baseline: { bytes: 0, startupBytes: 0, stepMs: 0, zero3CallMs: 0, zero3MsPerMiB: 0 },
  });
  const w = { nproc: 4, nnodes: 1 };
  const all = enumerateLayouts(cfg, 4).map((c) => c.layout).filter((l) => l.precision === 'fp32' && l.activationCheckpoint === 'none' && l.tp === 1 && l.cp === 1);
  const pipe = all.find((l) => l.pp === 2 && l.dp === 2 && l.ppSchedule === '1f1b' && l.microBatches === 4);
  assert.ok(pipe, 'pp 2 x dp 2, 1F1B over 4 micro-batches is listed');
  const compute = (l: typeof pipe, cores: number) => predict(cfg, l, modelFacts(cfg), w, m(cores)).time.computeMs;
  // A stage holds 2 blocks: 2 ms forward and 2 backward per micro-batch. Uncrowded (4 cores), the
  // 1F1B timeline of 2 stages is (4 + 1) x (2 + 2) = 20 ms. On 2 cores the calibration ran twice as
  // slow as a rank alone: the timeline at 1 + 1 ms is 10 ms, each rank computes 8 ms of it, and 4
  // ranks' 8 ms over 2 cores is 16 ms.
  assert.equal(compute(pipe, 4), 20);
  assert.equal(compute(pipe, 2), 16);
  // Without a pipeline every rank computes all the time: the crowded calibration is the step.
  const dp = all.find((l) => l.pp === 1 && l.dp === 4 && l.microBatches === 1);
  assert.ok(dp);
  assert.equal(compute(dp, 2), compute(dp, 4));
});
