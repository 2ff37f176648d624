// Checkpoints under every layout, with real ranks: each layout trains 6 steps saving at step 3;
// resuming its step-3 checkpoint under the same layout gives bit-identical losses and parameters,
// and resuming it in one process (or under another layout) gives one process's numbers. Shapes do
// not divide by the world (vocabulary 259, width 30), so shards of unequal sizes round-trip.
//
// The runs of one rank count train one after another in one world (`flotilla train-series`, a
// world's process starts paid once): the 2-rank layouts, each followed by its own resume; then the
// 3- and 4-rank ones, with data parallel's checkpoint resumed among them; the one-process
// references alongside; the resumes in one process last. Each test awaits the runs it compares.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { cpSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { readMeta } from '../src/checkpoint/format.js';
import { layoutFor } from '../src/parallel/layout.js';
import { CONFIG, flotilla, runOf, same, trainSeries, withoutNproc, work, type RunResult } from './helpers/ckpt_runs.js';
import { pool, started } from './helpers/pool.js';

const launch = pool();
const series = (nproc: number, runs: { name: string; extra: string[] }[]): Promise<RunResult[]> => started(launch(() => trainSeries(nproc, runs)));

/** A model of its own for the tied-embedding layout (4 stages need 4 layers). */
const TIED = ['--model.tieEmbeddings=true', '--model.nLayer=4'];

// ZeRO-1 and the zero-bubble schedule round-trip in the `verify --resume` test at the end (ZeRO-1
// resumed under ZeRO-1 bit-identically, then into a zero-bubble pipeline).
const LAYOUTS: [string, string[]][] = [
  ['data parallel 2', ['--nproc', '2']],
  ['ZeRO-2 on 2', ['--nproc', '2', '--parallel.zero=2', '--data.microBatches=2']],
  ['ZeRO-3 on 3', ['--nproc', '3', '--parallel.zero=3']],
  ['HSDP 2 x 2, ZeRO-3', ['--nproc', '4', '--parallel.zero=3', '--parallel.dpShard=2', '--parallel.dpReplicate=2']],
  ['pipeline 2, 1F1B', ['--nproc', '2', '--parallel.pp=2', '--data.microBatches=2']],
  ['pipeline 2, interleaved, tied embeddings', ['--nproc', '2', '--parallel.pp=2', '--parallel.ppSchedule=interleaved', '--parallel.ppVirtualStages=2', '--data.microBatches=2', ...TIED]],
  ['pipeline 2 x ZeRO-2 on 2', ['--nproc', '4', '--parallel.pp=2', '--parallel.zero=2', '--data.microBatches=2']],
];
const crossTested = new Set(['ZeRO-3 on 3', 'HSDP 2 x 2, ZeRO-3', 'pipeline 2, interleaved, tied embeddings', 'pipeline 2 x ZeRO-2 on 2']);
const slugOf = (name: string): string => name.replace(/\W+/g, '-');
const nprocOf = (args: string[]): number => Number(args[args.indexOf('--nproc') + 1]);
/** Where the layout's 6-step run saves step 3 (it does not exist yet when the series is written). */
const checkpoint3 = (name: string): string => join(work, `${slugOf(name)}-full`, 'checkpoints', 'step-000003');
const TIED_NAME = 'pipeline 2, interleaved, tied embeddings';

// Data parallel's checkpoint resumed into three other layouts (in their worlds).
const INTO: [string, string[]][] = [
  ['zero3-3', ['--nproc', '3', '--parallel.zero=3']],
  ['hsdp', ['--nproc', '4', '--parallel.zero=2', '--parallel.dpShard=2', '--parallel.dpReplicate=2']],
  ['pp2', ['--nproc', '2', '--parallel.pp=2', '--parallel.ppSchedule=gpipe', '--data.microBatches=3']],
];

// Each layout's 6-step run, then its resume of step 3 under itself, in the world of its rank count;
// data parallel's checkpoint into the layouts of that world after them.
function worldOf(nproc: number, after?: Promise<unknown>): { all: Promise<RunResult[]>; names: string[] } {
  const runs: { name: string; extra: string[] }[] = [];
  for (const [name, args] of LAYOUTS.filter(([, args]) => nprocOf(args) === nproc)) {
    runs.push({ name: `${slugOf(name)}-full`, extra: withoutNproc(args) });
    runs.push({ name: `${slugOf(name)}-self`, extra: [...withoutNproc(args), '--resume', checkpoint3(name)] });
  }
  for (const [slug, args] of INTO.filter(([, args]) => nprocOf(args) === nproc)) {
    runs.push({ name: `dp2-into-${slug}`, extra: [...withoutNproc(args), '--resume', checkpoint3('data parallel 2')] });
  }
  const all = after ? started(after.then(() => series(nproc, runs))) : series(nproc, runs);
  return { all, names: runs.map((r) => r.name) };
}
const worlds = [worldOf(2)];
worlds.push(worldOf(3, worlds[0]!.all), worldOf(4, worlds[0]!.all));
const runNamed = (name: string): Promise<RunResult> => {
  for (const w of worlds) if (w.names.includes(name)) return runOf(w.all, w.names.indexOf(name));
  throw new Error(`no run ${name}`);
};
const full = new Map(LAYOUTS.map(([name]) => [name, runNamed(`${slugOf(name)}-full`)]));
// The one-process runs every layout is compared with (and a resume of the first), then the sharded
// and split layouts' checkpoints resumed in one process, once every world has finished.
const references = series(1, [{ name: 'ref', extra: [] }, { name: 'ref-tied', extra: TIED }, { name: 'ref-resumed', extra: ['--resume', join(work, 'ref', 'checkpoints', 'step-000003')] }]);
const [reference, referenceTied, refResumed] = [0, 1, 2].map((i) => runOf(references, i)) as [Promise<RunResult>, Promise<RunResult>, Promise<RunResult>];
const ones = LAYOUTS.filter(([name]) => crossTested.has(name));
const oneRuns = started(Promise.all(worlds.map((w) => w.all)).then(() => series(1, ones.map(([name]) => ({
  name: `${slugOf(name)}-one`, extra: ['--resume', checkpoint3(name), ...(name === TIED_NAME ? TIED : [])],
})))));
const resumed = new Map(LAYOUTS.map(([name]) => [name, {
  self: runNamed(`${slugOf(name)}-self`),
  one: crossTested.has(name) ? runOf(oneRuns, ones.findIndex(([n]) => n === name)) : undefined,
}]));
const dpInto = INTO.map(([slug]) => [slug, runNamed(`dp2-into-${slug}`)] as const);
// `flotilla verify --resume` (each a straight run and a resumed one of its own, in one world).
const verify = (args: string[]) => started(launch(() => flotilla(['verify', CONFIG, ...args])));
const verifySame = verify(['--nproc', '2', '--parallel.zero=1', '--resume', '2', '--steps', '4']);
const verifyOther = verify(['--nproc', '2', '--parallel.zero=1', '--resume', '2', '--steps', '4', '--then', '--nproc', '2', '--parallel.pp=2', '--parallel.ppSchedule=zb', '--parallel.zero=0', '--data.microBatches=2']);
const verifyWrong = verify(['--nproc', '2', '--resume', '2', '--steps', '4', '--then', '--optim.lr=1e-2']);

test('one process: a resume from step 3 continues bit-identically (losses, norms, parameters, metrics file)', async () => {
  const ref = await reference;
  assert.equal(ref.metrics.length, 6);
  const again = await refResumed;
  assert.match(again.out, /\[resume\] resumed from step 3 \(.*step-000003; saved by 1 rank\(s\)/);
  same(again, ref, 4, 0, 'one process resumed');
});

for (const [name, args] of LAYOUTS) {
  test(`${name}: resumes itself bit-identically${crossTested.has(name) ? ', and resumes in one process with one process\'s numbers' : ''}`, async () => {
    const base = args.includes(TIED[0]!) ? await referenceTied : await reference;
    const f = await full.get(name)!;
    same(f, base, 1, 1e-5, `${name} vs one process`);
    const { self, one } = resumed.get(name)!;
    same(await self, f, 4, 0, `${name} resumed under ${name}`);
    // Sharded and split layouts into one process (data parallel's checkpoint goes into three other
    // layouts in the next test).
    if (one) same(await one, base, 4, 1e-5, `${name} resumed in one process`);
  });
}

test('a data-parallel checkpoint resumes under ZeRO-3 on 3 ranks, HSDP and a pipeline, with one process\'s numbers', async () => {
  for (const [slug, run] of dpInto) {
    const r = await run;
    assert.match(r.out, /\[resume\] resumed from step 3 .*saved by 2 rank\(s\), data parallel 2/);
    same(r, await reference, 4, 1e-5, `data-parallel checkpoint resumed as ${slug}`);
  }
});

test('flotilla verify --resume K: PASS for the same layout (bit-identical) and into another; FAIL when the resumed run trains differently', async () => {
  const same = await verifySame;
  assert.equal(same.code, 0, same.out + same.err);
  assert.match(same.out, /^PASS \(same layout: bit-identical expected\)$/m);
  assert.match(same.out, /max parameter difference \|\|Δθ\|\| \/ \|\|θ\|\|: 0\.00e\+0/);
  const other = await verifyOther;
  assert.equal(other.code, 0, other.out + other.err);
  assert.match(other.out, /^PASS \(tolerance: loss 0\.00001/m);
  const wrong = await verifyWrong;
  assert.equal(wrong.code, 1, wrong.out + wrong.err);
  assert.match(wrong.out, /^FAIL/m);
});

// Expert parallelism's checkpoint records its whole resolved layout, ep included; the same
// checkpoint with meta.json's layout as it was written before (no dp, accumulate or ep;
// ppSchedule and ppVirtualStages) reads back the same, from its saved config, and resumes.
const MOE = ['--moe.experts=2', '--moe.topK=1'];
const epRun = started(launch(() => flotilla(['train', CONFIG, '--nproc', '2', '--parallel.ep=2', ...MOE, `--train.runDir=${join(work, 'ep2')}`])));

test('a checkpoint records the resolved layout, ep included; one written without it reads back from its config and resumes', async () => {
  const r = await epRun;
  assert.equal(r.code, 0, r.out + r.err);
  const ckpt = join(work, 'ep2', 'checkpoints', 'step-000006');
  const meta = readMeta(ckpt);
  assert.deepEqual(meta.layout, { worldSize: 2, description: 'data parallel 2, expert parallel 2, accumulate reduceLast', ...layoutFor({ ep: 2 }, 2) });
  assert.equal(meta.layout.ep, 2);
  const old = join(work, 'ep2-old');
  cpSync(ckpt, old, { recursive: true });
  const raw = JSON.parse(readFileSync(join(old, 'meta.json'), 'utf8')) as Record<string, unknown>;
  raw.layout = { worldSize: 2, description: meta.layout.description, pp: 1, dpReplicate: 1, dpShard: 2, zero: 0, ppSchedule: '1f1b', ppVirtualStages: 1, tp: 1, cp: 1 };
  writeFileSync(join(old, 'meta.json'), JSON.stringify(raw));
  assert.deepEqual(readMeta(old).layout, meta.layout);
  const resumed = await started(launch(() => flotilla(['train', CONFIG, ...MOE, `--train.runDir=${join(work, 'ep2-resumed')}`, '--train.steps=7', '--resume', old])));
  assert.equal(resumed.code, 0, resumed.out + resumed.err);
  assert.match(resumed.out, /\[resume\] resumed from step 6 .*saved by 2 rank\(s\), data parallel 2, expert parallel 2/);
});
