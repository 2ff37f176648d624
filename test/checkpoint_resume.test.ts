// Checkpoints under every layout, with real ranks: each layout trains 6 steps saving at step 3;
// resuming its step-3 checkpoint under the same layout gives bit-identical losses and parameters,
// and resuming it in one process (or under another layout) gives one process's numbers. Shapes do
// not divide by the world (vocabulary 259, width 30), so shards of unequal sizes round-trip.
//
// Every run is queued when the file loads and runs as soon as what it resumes from exists, two
// launches at a time (test/helpers/pool.ts); each test awaits the runs it compares.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { CONFIG, checkpointOf, flotilla, same, train, type RunResult } from './helpers/ckpt_runs.js';
import { pool, started } from './helpers/pool.js';

const launch = pool();
/** `train` queued now; a run that resumes queues when the run it resumes from has finished. */
const queued = (name: string, extra: string[] = []): Promise<RunResult> => started(launch(() => train(name, extra)));
const after = <T>(first: Promise<T>, then: (t: T) => Promise<RunResult>): Promise<RunResult> => started(first.then(then));

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

// The one-process runs every layout is compared with, and every layout's 6-step run.
const reference = queued('ref');
const referenceTied = queued('ref-tied', TIED);
const full = new Map(LAYOUTS.map(([name, args]) => [name, queued(`${slugOf(name)}-full`, args)]));
// `flotilla verify --resume` (each a straight run and a resumed one of its own).
const verify = (args: string[]) => started(launch(() => flotilla(['verify', CONFIG, ...args])));
const verifySame = verify(['--nproc', '2', '--parallel.zero=1', '--resume', '2', '--steps', '4']);
const verifyOther = verify(['--nproc', '2', '--parallel.zero=1', '--resume', '2', '--steps', '4', '--then', '--nproc', '2', '--parallel.pp=2', '--parallel.ppSchedule=zb', '--parallel.zero=0', '--data.microBatches=2']);
const verifyWrong = verify(['--nproc', '2', '--resume', '2', '--steps', '4', '--then', '--optim.lr=1e-2']);
// Resumes of step 3: in one process, each layout under itself and (the sharded and split layouts,
// and data parallel's into three others) elsewhere.
const refResumed = after(reference, (ref) => launch(() => train('ref-resumed', ['--resume', checkpointOf(ref, 3)])));
const resumed = new Map(LAYOUTS.map(([name, args]) => {
  const tied = args.includes(TIED[0]!);
  const self = after(full.get(name)!, (f) => launch(() => train(`${slugOf(name)}-self`, [...args, '--resume', checkpointOf(f, 3)])));
  const one = crossTested.has(name) ? after(full.get(name)!, (f) => launch(() => train(`${slugOf(name)}-one`, ['--resume', checkpointOf(f, 3), ...(tied ? TIED : [])]))) : undefined;
  return [name, { self, one }];
}));
const INTO: [string, string[]][] = [
  ['zero3-3', ['--nproc', '3', '--parallel.zero=3']],
  ['hsdp', ['--nproc', '4', '--parallel.zero=2', '--parallel.dpShard=2', '--parallel.dpReplicate=2']],
  ['pp2', ['--nproc', '2', '--parallel.pp=2', '--parallel.ppSchedule=gpipe', '--data.microBatches=3']],
];
const dpInto = INTO.map(([slug, args]) => [slug, after(full.get('data parallel 2')!, (dp) => launch(() => train(`dp2-into-${slug}`, [...args, '--resume', checkpointOf(dp, 3)])))] as const);

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
