// Checkpoints under every layout, with real ranks: each layout trains 6 steps saving at step 3;
// resuming its step-3 checkpoint under the same layout gives bit-identical losses and parameters,
// and resuming it in one process (or under another layout) gives one process's numbers. Shapes do
// not divide by the world (vocabulary 259, width 30), so shards of unequal sizes round-trip.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { checkpointOf, same, train, type RunResult } from './helpers/ckpt_runs.js';

let refRun: RunResult | undefined;
/** The one-process run every layout is compared with (made by the first test that needs it). */
async function reference(): Promise<RunResult> {
  refRun ??= await train('ref');
  return refRun;
}

test('one process: a resume from step 3 continues bit-identically (losses, norms, parameters, metrics file)', async () => {
  const ref = await reference();
  assert.equal(ref.metrics.length, 6);
  const again = await train('ref-resumed', ['--resume', checkpointOf(ref, 3)]);
  assert.match(again.out, /\[resume\] resumed from step 3 \(.*step-000003; saved by 1 rank\(s\)/);
  same(again, ref, 4, 0, 'one process resumed');
});

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

const saved = new Map<string, RunResult>();
const crossTested = new Set(['ZeRO-3 on 3', 'HSDP 2 x 2, ZeRO-3', 'pipeline 2, interleaved, tied embeddings', 'pipeline 2 x ZeRO-2 on 2']);

for (const [name, args] of LAYOUTS) {
  test(`${name}: resumes itself bit-identically${crossTested.has(name) ? ', and resumes in one process with one process\'s numbers' : ''}`, async () => {
    const tied = args.includes(TIED[0]!);
    const base = tied ? await train('ref-tied', TIED) : await reference();
    const slug = name.replace(/\W+/g, '-');
    const full = await train(`${slug}-full`, args);
    saved.set(name, full);
    same(full, base, 1, 1e-5, `${name} vs one process`);
    const self = await train(`${slug}-self`, [...args, '--resume', checkpointOf(full, 3)]);
    same(self, full, 4, 0, `${name} resumed under ${name}`);
    // Sharded and split layouts into one process (data parallel's checkpoint goes into three other
    // layouts in the next test).
    if (!crossTested.has(name)) return;
    const one = await train(`${slug}-one`, ['--resume', checkpointOf(full, 3), ...(tied ? TIED : [])]);
    same(one, base, 4, 1e-5, `${name} resumed in one process`);
  });
}

test('a data-parallel checkpoint resumes under ZeRO-3 on 3 ranks, HSDP and a pipeline, with one process\'s numbers', async () => {
  const dp = saved.get('data parallel 2') ?? (await train('dp2-again', ['--nproc', '2']));
  const into: [string, string[]][] = [
    ['zero3-3', ['--nproc', '3', '--parallel.zero=3']],
    ['hsdp', ['--nproc', '4', '--parallel.zero=2', '--parallel.dpShard=2', '--parallel.dpReplicate=2']],
    ['pp2', ['--nproc', '2', '--parallel.pp=2', '--parallel.ppSchedule=gpipe', '--data.microBatches=3']],
  ];
  for (const [slug, args] of into) {
    const r = await train(`dp2-into-${slug}`, [...args, '--resume', checkpointOf(dp, 3)]);
    assert.match(r.out, /\[resume\] resumed from step 3 .*saved by 2 rank\(s\), data parallel 2/);
    same(r, await reference(), 4, 1e-5, `data-parallel checkpoint resumed as ${slug}`);
  }
});

test('flotilla verify --resume K: PASS for the same layout (bit-identical) and into another; FAIL when the resumed run trains differently', async () => {
  const { flotilla, CONFIG } = await import('./helpers/ckpt_runs.js');
  const same = await flotilla(['verify', CONFIG, '--nproc', '2', '--parallel.zero=1', '--resume', '2', '--steps', '4']);
  assert.equal(same.code, 0, same.out + same.err);
  assert.match(same.out, /^PASS \(same layout: bit-identical expected\)$/m);
  assert.match(same.out, /max parameter difference \|\|Δθ\|\| \/ \|\|θ\|\|: 0\.00e\+0/);
  const other = await flotilla(['verify', CONFIG, '--nproc', '2', '--parallel.zero=1', '--resume', '2', '--steps', '4', '--then', '--nproc', '2', '--parallel.pp=2', '--parallel.ppSchedule=zb', '--parallel.zero=0', '--data.microBatches=2']);
  assert.equal(other.code, 0, other.out + other.err);
  assert.match(other.out, /^PASS \(tolerance: loss 0\.00001/m);
  const wrong = await flotilla(['verify', CONFIG, '--nproc', '2', '--resume', '2', '--steps', '4', '--then', '--optim.lr=1e-2']);
  assert.equal(wrong.code, 1, wrong.out + wrong.err);
  assert.match(wrong.out, /^FAIL/m);
});
