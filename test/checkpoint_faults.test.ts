// Checkpoints when things go wrong: a rank killed while saving, Ctrl-C, a group restarted after a
// crash, background saves, and checkpoints that are corrupt or from another model. Every failure
// is one clear message, exits non-zero, and leaves the files on disk as they were.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { cpSync, existsSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { readMetrics } from '../src/train/metrics.js';
import { consolidate } from '../src/checkpoint/export.js';
import { CONFIG, checkpointOf, flotilla, latestOf, rankPids, runOf, train, trainSeries, work, type RunResult } from './helpers/ckpt_runs.js';
import { pool, started } from './helpers/pool.js';

// Runs that no signal or kill depends on go through this queue, two at a time (test/helpers/pool.ts);
// the tests that kill or signal a run keep it to themselves.
const launch = pool();
// Three 2-rank runs in one world (flotilla train-series): blocking saves, background saves, and the
// uninterrupted run the --max-restarts test ends like.
const twoRank = started(launch(() => trainSeries(2, [
  { name: 'faults-ref', extra: [] },
  { name: 'faults-async', extra: ['--checkpoint.async=true', '--checkpoint.every=1', '--checkpoint.keep=2'] },
  { name: 'restarted-straight', extra: ['--parallel.backend=gloo', '--train.steps=12', '--checkpoint.every=0'] },
])));
const [refRun, asyncRun, restartedStraight] = [0, 1, 2].map((i) => runOf(twoRank, i)) as [Promise<RunResult>, Promise<RunResult>, Promise<RunResult>];
/** The source of the bad-checkpoint cases (one process). */
const goodRun = started(launch(() => train('bad-source', [])));
let ref: RunResult;

test('background (async) saves publish the same checkpoints as blocking ones, and training is not changed by them', async () => {
  ref = await refRun;
  const bg = await asyncRun;
  assert.deepEqual(bg.metrics.map((m) => m.loss), ref.metrics.map((m) => m.loss));
  const names = readdirSync(join(bg.dir, 'checkpoints')).sort();
  assert.deepEqual(names, ['latest', 'step-000005', 'step-000006'], 'keep = 2: older checkpoints deleted once newer ones are complete');
  assert.equal(latestOf(bg), 'step-000006');
  const a = consolidate(checkpointOf(ref, 6));
  const b = consolidate(checkpointOf(bg, 6));
  try {
    for (const [n, t] of Object.entries(a.tensors)) assert.deepEqual(b.tensors[n]!.toNumbers(), t.toNumbers(), n);
  } finally {
    for (const t of [...Object.values(a.tensors), ...Object.values(b.tensors)]) t.dispose();
  }
});

test('kill -9 of a rank while it saves: the previous checkpoint stays complete and `latest`; resuming from it reproduces the run', async () => {
  const dir = join(work, 'killed');
  const ckdir = join(dir, 'checkpoints');
  let killed = '';
  const r = await flotilla(['train', CONFIG, `--train.runDir=${dir}`, '--nproc', '2', '--parallel.backend=gloo', '--train.steps=200', '--optim.schedule=constant', '--checkpoint.every=1', '--checkpoint.keep=100'], {
    onStart: () => {
      const poll = setInterval(() => {
        // Kill rank 1 as soon as a save is in progress after at least two complete ones.
        if (!existsSync(ckdir)) return;
        const names = readdirSync(ckdir);
        const tmp = names.find((n) => n.startsWith('.tmp-step-'));
        if (!tmp || names.filter((n) => n.startsWith('step-')).length < 2) return;
        const pid = rankPids(dir).get(1);
        if (pid === undefined) return;
        clearInterval(poll);
        killed = tmp;
        process.kill(pid, 'SIGKILL');
      }, 2);
    },
  });
  assert.notEqual(r.code, 0, 'the run fails when a rank is killed');
  assert.ok(killed !== '', `rank 1 was killed during a save\n${r.out}${r.err}`);
  const latest = latestOf({ dir });
  const check = await flotilla(['checkpoint', 'check', dir]);
  assert.equal(check.code, 0, check.out + check.err);
  assert.match(check.out, new RegExp(`OK .*${latest}: step \\d+`));
  const step = Number(latest.slice('step-'.length));
  assert.ok(step >= 2 && step < 200, `latest is ${latest}`);
  // Resume from latest into the same directory (the leftover temporary directory is ignored, then removed).
  const resumed = await flotilla(['train', CONFIG, `--train.runDir=${dir}`, '--nproc', '2', '--parallel.backend=gloo', `--train.steps=${step + 2}`, '--optim.schedule=constant', '--checkpoint.every=1', '--resume']);
  assert.equal(resumed.code, 0, resumed.out + resumed.err);
  assert.match(resumed.out, new RegExp(`resumed from step ${step} `));
  assert.ok(!readdirSync(ckdir).some((n) => n.startsWith('.tmp-')), 'the interrupted save was cleaned up');
  // The straight run of the same steps gives the same losses.
  const straight = await flotilla(['train', CONFIG, `--train.runDir=${join(work, 'killed-straight')}`, '--nproc', '2', '--parallel.backend=gloo', `--train.steps=${step + 2}`, '--optim.schedule=constant', '--checkpoint.every=0']);
  assert.equal(straight.code, 0, straight.err);
  const want = readMetrics(join(work, 'killed-straight', 'metrics.jsonl'));
  const got = readMetrics(join(dir, 'metrics.jsonl'));
  assert.deepEqual(got.map((m) => m.step), want.map((m) => m.step), 'metrics continue without gaps or repeats');
  // A constant learning rate: the 200-step schedule and the shorter one agree, so every loss matches.
  assert.deepEqual(got.map((m) => m.loss), want.map((m) => m.loss));
});

test('Ctrl-C (SIGINT) saves a checkpoint at the end of the current step and exits 0, in one process and under the launcher (Gloo and Open MPI)', async () => {
  // The three runs go side by side, each in its own directory with its own signals.
  const runs = ([['1', 'gloo'], ['2', 'gloo'], ['2', 'mpi']] as const).map(async ([nproc, backend]) => {
    const dir = join(work, `sigint-${nproc}-${backend}`);
    let sent = false;
    const r = await flotilla(['train', CONFIG, `--train.runDir=${dir}`, '--nproc', nproc, `--parallel.backend=${backend}`, '--train.steps=100000', '--checkpoint.every=0'], {
      onStart: (child) => {
        const poll = setInterval(() => {
          const m = join(dir, 'metrics.jsonl');
          if (!existsSync(m) || readFileSync(m, 'utf8').split('\n').length < 4) return;
          clearInterval(poll);
          sent = true;
          // As a terminal does: the foreground group gets it. Gloo ranks are in the launcher's group
          // (and get the launcher's forwarded one too); mpirun's job runs in a group of its own.
          if (nproc === '1' || backend === 'mpi') child.kill('SIGINT');
          else for (const pid of [child.pid!, ...rankPids(dir).values()]) process.kill(pid, 'SIGINT');
        }, 20);
      },
    });
    return { nproc, backend, dir, sent, r };
  });
  for (const run of runs) started(run); // a run that fails before its turn is reported there
  for (const run of runs) {
    const { nproc, backend, dir, sent, r } = await run;
    assert.ok(sent);
    assert.equal(r.code, 0, `--nproc ${nproc} (${backend}): exit ${r.code}\n${r.out}\n${r.err}`);
    assert.match(r.out, /\[stop\] stopped after step (\d+) of 100000; continue with --resume/);
    const stopped = Number(/stopped after step (\d+)/.exec(r.out)![1]);
    assert.equal(latestOf({ dir }), `step-${String(stopped).padStart(6, '0')}`);
    const m = readMetrics(join(dir, 'metrics.jsonl'));
    assert.equal(m[m.length - 1]!.step, stopped);
  }
});

test('--max-restarts 1: a rank killed mid-run; the restarted group resumes from the latest checkpoint and ends with the uninterrupted run\'s loss', async () => {
  const dir = join(work, 'restarted');
  const straight = await restartedStraight;
  let killed = false;
  const r = await flotilla(['train', CONFIG, `--train.runDir=${dir}`, '--nproc', '2', '--parallel.backend=gloo', '--train.steps=12', '--checkpoint.every=2', '--max-restarts', '1'], {
    onStart: () => {
      const poll = setInterval(() => {
        const m = join(dir, 'metrics.jsonl');
        if (!existsSync(m) || readFileSync(m, 'utf8').split('\n').length < 7) return;
        const pid = rankPids(dir).get(1);
        if (pid === undefined) return;
        clearInterval(poll);
        killed = true;
        process.kill(pid, 'SIGKILL');
      }, 10);
    },
  });
  assert.ok(killed);
  assert.equal(r.code, 0, r.out + r.err);
  assert.match(r.err, /restarting all 2 local ranks \(restart 1 of 1\)/);
  assert.match(r.out, /\[resume\] resumed from step \d+/);
  const got = readMetrics(join(dir, 'metrics.jsonl'));
  assert.deepEqual(got.map((x) => x.step), straight.metrics.map((x) => x.step));
  assert.equal(got[got.length - 1]!.loss, straight.metrics[straight.metrics.length - 1]!.loss);
});

/** Every file under dir with its size and modification time (to prove nothing was written). */
function snapshotTree(dir: string): string {
  const out: string[] = [];
  const walk = (d: string) => {
    for (const n of readdirSync(d).sort()) {
      const p = join(d, n);
      const s = statSync(p);
      if (s.isDirectory()) walk(p);
      else out.push(`${p} ${s.size} ${s.mtimeMs}`);
    }
  };
  walk(dir);
  return out.join('\n');
}

test('bad checkpoints: another model, a missing or truncated file, a checksum mismatch, overlapping pieces, --resume latest with none: one message, non-zero exit, nothing written', async () => {
  const good = await goodRun;
  const src = checkpointOf(good, 6);
  const copy = (name: string): string => {
    const d = join(work, `bad-${name}`, 'checkpoints', 'step-000006');
    cpSync(src, d, { recursive: true });
    return d;
  };
  const cases: [string, (d: string) => void, string[], RegExp][] = [
    ['other-model', () => undefined, ['--model.nEmbd=32'], /parameter '.*' is \[.*\] there and \[.*\] in this model; it comes from a different model config/],
    ['missing', (d) => rmSync(join(d, 'rank-00000.safetensors')), [], /is missing rank-00000\.safetensors \(listed in meta\.json\); the checkpoint is incomplete/],
    ['truncated', (d) => writeFileSync(join(d, 'rank-00000.safetensors'), readFileSync(join(d, 'rank-00000.safetensors')).subarray(0, 1000)), [], /rank-00000\.safetensors has 1000 bytes, meta\.json records \d+: the file is truncated/],
    ['bitflip', (d) => {
      const f = join(d, 'rank-00000.safetensors');
      const b = readFileSync(f);
      b[b.length - 5] = b[b.length - 5]! ^ 0xff;
      writeFileSync(f, b);
    }, [], /rank-00000\.safetensors: checksum mismatch .* the file is corrupt/],
    ['overlap', (d) => {
      const f = join(d, 'meta.json');
      const m = JSON.parse(readFileSync(f, 'utf8'));
      m.pieces.push({ ...m.pieces[0], offset: 0 });
      writeFileSync(f, JSON.stringify(m));
    }, [], /pieces of '.*' \(param\) overlap/],
    ['absurd', (d) => {
      const f = join(d, 'meta.json');
      const m = JSON.parse(readFileSync(f, 'utf8'));
      m.pieces[0].numel = 2 ** 52;
      writeFileSync(f, JSON.stringify(m));
    }, [], /lies outside its \d+ elements|past the end of rank-00000\.safetensors/],
    ['no-meta', (d) => rmSync(join(d, 'meta.json')), [], /no meta\.json: it is incomplete/],
  ];
  // Every case spoils its own copy; the refused runs then go two at a time.
  const runs = cases.map(([name, spoil, extra, re]) => {
    const d = copy(name);
    spoil(d);
    const runDir = join(work, `bad-${name}`);
    const before = snapshotTree(runDir);
    return { name, re, runDir, before, run: started(launch(() => flotilla(['train', CONFIG, `--train.runDir=${runDir}`, '--resume', d, ...extra]))) };
  });
  const empty = join(work, 'bad-none');
  const none = started(launch(() => flotilla(['train', CONFIG, `--train.runDir=${empty}`, '--resume'])));
  const check = started(launch(() => flotilla(['checkpoint', 'check', join(work, 'bad-bitflip')])));
  // A run directory of an earlier run is still refused without --resume, with the way out named.
  const earlier = started(launch(() => flotilla(['train', CONFIG, `--train.runDir=${good.dir}`])));
  for (const { name, re, runDir, before, run } of runs) {
    const r = await run;
    assert.notEqual(r.code, 0, `${name}: should fail\n${r.out}`);
    assert.match(r.err, re, name);
    assert.doesNotMatch(r.err, /\n\s+at /, `${name}: no stack trace`);
    assert.equal(snapshotTree(runDir), before, `${name}: nothing on disk changed`);
  }
  const r = await none;
  assert.notEqual(r.code, 0);
  assert.match(r.err, /--resume latest: no complete checkpoint in .*bad-none\/checkpoints; start the run without --resume/);
  assert.ok(!existsSync(empty), 'no run directory was created');
  const chk = await check;
  assert.equal(chk.code, 1);
  assert.match(chk.err, /checksum mismatch/);
  const again = await earlier;
  assert.equal(again.code, 2);
  assert.match(again.err, /holds checkpoints of an earlier run: resume that run from them/);
});

test('export writes one safetensors file that PyTorch reads with the same values; generate is deterministic for a seed', async () => {
  const run = await refRun;
  const out = join(work, 'model.safetensors');
  const e = await flotilla(['export', run.dir, out]);
  assert.equal(e.code, 0, e.err);
  assert.match(e.out, /exported step 6: \d+ parameters/);
  const again = await flotilla(['export', run.dir, out]);
  assert.equal(again.code, 2, 'an existing output is not overwritten');
  const py = execFileSync('/usr/bin/python3', ['-c', `
import json, sys
sys.path.insert(0, 'test/oracle')
from st import load
t, meta = load(${JSON.stringify(out)})
print(json.dumps({'names': sorted(t), 'sums': {k: float(v.double().sum()) for k, v in t.items()}, 'shapes': {k: list(v.shape) for k, v in t.items()}, 'model': json.loads(meta['flotilla.model'])}))
`], { cwd: join(import.meta.dirname, '..'), encoding: 'utf8' });
  const got = JSON.parse(py) as { names: string[]; sums: Record<string, number>; shapes: Record<string, number[]>; model: Record<string, unknown> };
  assert.deepEqual(got.names, [...run.params.keys()].sort());
  for (const [n, v] of run.params) {
    const sum = v.reduce((a, b) => a + b, 0);
    assert.ok(Math.abs(got.sums[n]! - sum) <= 1e-9 * Math.max(1, Math.abs(sum)) + 1e-9, `${n}: PyTorch sum ${got.sums[n]} vs ${sum}`);
  }
  assert.equal(got.model.vocabSize, 259);
  const gen = (src: string, seed: number) => flotilla(['generate', src, '--prompt', 'Call me', '--tokens', '20', '--seed', String(seed)]);
  const [a, b, c, d] = await Promise.all([gen(run.dir, 7), gen(run.dir, 7), gen(out, 7), gen(run.dir, 8)]);
  for (const x of [a, b, c, d]) assert.equal(x.code, 0, x.err);
  assert.ok(a.out.startsWith('Call me'));
  assert.equal(a.out, b.out, 'the same seed samples the same text');
  assert.equal(a.out, c.out, 'the exported file samples what the checkpoint does');
  assert.notEqual(a.out, d.out, 'another seed samples other text');
});

test('train.initFrom starts a new run (step 0, fresh optimizer) from an exported file or a checkpoint, under another layout', async () => {
  const src = await refRun;
  const out = join(work, 'init-from.safetensors');
  const oneStep = ['--train.steps=1', '--optim.lr=1e-12', '--optim.minLr=0', '--optim.schedule=constant', '--checkpoint.every=0'];
  // The fresh run and the run from the checkpoint need no export: they start beside it.
  const freshRun = started(launch(() => train('init-none', oneStep)));
  const fromCheckpoint = started(launch(() => train('init-checkpoint', [...oneStep, `--train.initFrom=${checkpointOf(src, 6)}`])));
  if (!existsSync(out)) assert.equal((await flotilla(['export', src.dir, out])).code, 0);
  const fromExport = started(launch(() => train('init-export', [...oneStep, `--train.initFrom=${out}`, '--nproc', '2', '--parallel.zero=3'])));
  const badRun = started(launch(() => flotilla(['train', CONFIG, `--train.runDir=${join(work, 'init-bad')}`, `--train.initFrom=${out}`, '--model.nEmbd=32'])));
  const fresh = await freshRun;
  for (const [name, run] of [['export', fromExport], ['checkpoint', fromCheckpoint]] as const) {
    const r = await run;
    assert.match(r.out, /\[init\] weights from .*; step 0, fresh optimizer state/);
    assert.deepEqual(r.metrics.map((m) => m.step), [1], `${name}: a new run starts at step 1`);
    assert.ok(r.metrics[0]!.loss < fresh.metrics[0]!.loss - 0.1, `${name}: first loss ${r.metrics[0]!.loss} is the trained model's, not a fresh one's (${fresh.metrics[0]!.loss})`);
    // One step at lr 1e-12 leaves the weights where they started: the source run's final weights.
    for (const [n, v] of src.params) {
      const g = r.params.get(n)!;
      let d = 0, t = 0;
      for (let i = 0; i < v.length; i++) [d, t] = [d + (g[i]! - v[i]!) ** 2, t + v[i]! ** 2];
      assert.ok(Math.sqrt(d / t) < 1e-6, `${name}: parameter ${n} moved ${Math.sqrt(d / t)} from the source's`);
    }
  }
  const bad = await badRun;
  assert.notEqual(bad.code, 0);
  assert.match(bad.err, /it comes from a different model config/);
});
