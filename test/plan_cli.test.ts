// `flotilla plan` on the command line: one message naming the fix for each bad input (before
// anything is measured), and the --json shape of a real plan of a tiny model on 2 ranks (its
// calibration runs once into a temporary cache: a 2-rank collective table and a 2-rank baseline run).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { flotilla } from './helpers/cli.js';
import { parsePlanArgs } from '../src/cli/plan.js';
import { UsageError } from '../src/cli/usage.js';
import { loadConfig } from '../src/config/index.js';
import { LAYOUT_FIELDS, FIELD_SECTION } from '../src/plan/enumerate.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-plan-cli-'));
test.after(() => rmSync(dir, { recursive: true, force: true }));
const cfgFile = join(dir, 'tiny.toml');
writeFileSync(cfgFile, '[model]\nvocabSize = 256\nnLayer = 2\nnHead = 2\nnEmbd = 32\nblockSize = 32\n[data]\ntokenizer = "byte"\nseqLen = 32\nglobalBatch = 4\n[train]\nthreads = 1\n');

test('bad arguments: one message naming the fix, exit 2', async () => {
  const bad: [string[], RegExp][] = [
    [[], /missing the config file/],
    [[cfgFile], /--nproc N/],
    [[cfgFile, '--nproc', '0'], /--nproc needs a positive integer/],
    [[cfgFile, '--nproc', '2', '--memory', 'lots'], /--memory needs the GiB each rank may use/],
    [[cfgFile, '--nproc', '2', '--top', '0'], /--top needs a positive integer/],
    [[cfgFile, '--nproc', '2', '--measure', 'x'], /--measure needs a whole number/],
    [[cfgFile, '--nproc', '2', '--nnodes', '1:2'], /plan for one number of hosts/],
    [[cfgFile, '--nproc', '2', '--nnodes', '2', '--measure', '1'], /--measure trains on this host only/],
    [[cfgFile, '--nproc', '2', '--rounds', '0'], /--rounds needs a positive integer/],
    [[cfgFile, '--nproc', '2', '--fast'], /unknown option --fast/],
  ];
  for (const [args, re] of bad) assert.throws(() => parsePlanArgs(args), (e: Error) => e instanceof UsageError && re.test(e.message), args.join(' '));
  // Through the command: exit 2, one line, nothing measured.
  const r = await flotilla(['plan', cfgFile, '--nproc', 'two'], { timeoutMs: 60_000 });
  assert.equal(r.code, 2);
  assert.match(r.err, /^flotilla: plan: --nproc needs a positive integer \(ranks per host\), got "two"/);
  assert.equal(r.err.trim().split('\n').length, 1, r.err);
  // A config no layout can run: 3 ranks and a global batch of 4 (no split), one message.
  const none = await flotilla(['plan', cfgFile, '--nproc', '3'], { timeoutMs: 60_000, env: { FLOTILLA_CACHE_DIR: join(dir, 'cache') } });
  assert.equal(none.code, 2, none.err);
  assert.match(none.err, /no layout of this model runs on 3 rank\(s\).*globalBatch/s);
});

test('--json: every layout with its config-named fields, overrides that select it, memory, time and fit', async () => {
  const pin = ['--train.precision=fp32', '--train.activationCheckpoint=none', '--parallel.cp=1', '--data.microBatches=1'];
  // One launch per calibration measurement here (the suite's time); --measure below takes two.
  const r = await flotilla(['plan', cfgFile, '--nproc', '2', '--json', '--memory', '64', '--rounds', '1', ...pin], { timeoutMs: 240_000, env: { FLOTILLA_CACHE_DIR: join(dir, 'cache') } });
  assert.equal(r.code, 0, r.err);
  assert.match(r.err + r.out, /2 process\(es\) at once as the ranks run, 1 time\(s\)/);
  // And then what it measures as it goes, n of m and elapsed ([Note: measuring progress]).
  assert.match(r.err + r.out, /\[plan\] compute: measured 1 of \d+ \(.+\); .+ elapsed/);
  assert.match(r.err + r.out, /\[plan\] compute: measured (\d+) of \1 \(.+\); .+ elapsed, done/);
  // The in-step probes the candidates need, data parallelism's buckets among them ([Note: in-step collectives]).
  assert.match(r.err + r.out, /measuring the in-step probes' reference, a \d-block model under data parallelism, on 2 rank/);
  for (const probe of ['tp', 'zero2']) assert.match(r.err + r.out, new RegExp(`measuring ${probe} collectives inside the step`));
  const rows = JSON.parse(r.out) as { layout: Record<string, unknown>; overrides: string[]; peakMemoryMiB: number; stepMs: number; fits: boolean; memoryMiB: Record<string, number> }[];
  assert.ok(rows.length >= 5, `${rows.length} rows`);
  const keys = ['dp', 'zero', 'dpShard', 'dpReplicate', 'pp', 'ppSchedule', 'ppVirtualStages', 'tp', 'sequenceParallel', 'microBatches', 'activationCheckpoint', 'precision'];
  for (const [i, row] of rows.entries()) {
    for (const k of keys) assert.ok(k in row.layout, `layout.${k}`);
    assert.ok(row.peakMemoryMiB > 0 && Number.isFinite(row.stepMs) && row.stepMs > 0, JSON.stringify(row));
    assert.equal(row.fits, row.peakMemoryMiB <= 64 * 1024);
    if (i > 0) assert.ok(row.stepMs >= rows[i - 1]!.stepMs, 'ranked by step time');
    // The memory terms add up to the peak (or the start-up's mark is the peak).
    const sum = Object.values(row.memoryMiB).reduce((a, b) => a + b, 0);
    assert.ok(Math.abs(sum - row.peakMemoryMiB) < 0.5 || row.peakMemoryMiB > sum, `${sum} vs ${row.peakMemoryMiB}`);
    // The overrides select exactly this layout.
    const back = loadConfig(cfgFile, [...pin, ...row.overrides]);
    for (const f of LAYOUT_FIELDS) assert.equal((back[FIELD_SECTION[f]] as unknown as Record<string, unknown>)[f], row.layout[f], `${f}: ${row.overrides.join(' ')}`);
  }
  assert.ok(rows.every((x) => x.layout.precision === 'fp32' && x.layout.microBatches === 1), 'pinned fields kept');
  assert.ok(rows.some((x) => x.layout.pp === 2) && rows.some((x) => x.layout.zero === 3) && rows.some((x) => x.layout.tp === 2));
  // The table: the same layouts, ranked, the best one's command.
  const t = await flotilla(['plan', cfgFile, '--nproc', '2', '--top', '3', ...pin], { timeoutMs: 120_000, env: { FLOTILLA_CACHE_DIR: join(dir, 'cache') } });
  assert.equal(t.code, 0, t.err);
  assert.match(t.out, /ranked by predicted step time/);
  assert.match(t.out, /^best: .*flotilla train \S+tiny\.toml --nproc 2/m);
  assert.equal(t.out.split('\n').filter((l) => /^\d+\s{2}/.test(l)).length, 3, t.out);
  // --measure with --rounds 2: the first layout trained in two fresh launches, the median kept
  // (of two, the slower); the calibration comes from the cache, measured with one.
  const m = await flotilla(['plan', cfgFile, '--nproc', '2', '--json', '--measure', '1', '--rounds', '2', ...pin], { timeoutMs: 240_000, env: { FLOTILLA_CACHE_DIR: join(dir, 'cache') } });
  assert.equal(m.code, 0, m.err);
  assert.doesNotMatch(m.err + m.out, /calibrating|measuring a rank's baseline/);
  const measured = (JSON.parse(m.out) as { measured?: { stepMs: number; launchMs: number[]; steps: number[] } }[]).filter((x) => x.measured).map((x) => x.measured!);
  assert.equal(measured.length, 1);
  assert.equal(measured[0]!.launchMs.length, 2, JSON.stringify(measured[0]));
  assert.equal(measured[0]!.stepMs, Math.max(...measured[0]!.launchMs));
  // [Note: steady steps] 8 steps, 7 step times after the first; the median leaves out the second
  // step (warming up) and the last (it evaluates): the upper middle of the five between.
  const steps = measured[0]!.steps;
  assert.equal(steps.length, 7, JSON.stringify(steps));
  assert.equal(measured[0]!.stepMs, [...steps.slice(1, -1)].sort((a, b) => a - b)[2]);
});

test('train --plan trains with the layout the plan ranks first and says which (calibration cached by the test above)', async () => {
  const pin = ['--train.precision=fp32', '--train.activationCheckpoint=none', '--parallel.cp=1', '--data.microBatches=1'];
  const env = { FLOTILLA_CACHE_DIR: join(dir, 'cache') };
  const j = await flotilla(['plan', cfgFile, '--nproc', '2', '--json', ...pin], { timeoutMs: 120_000, env });
  assert.equal(j.code, 0, j.err);
  const best = (JSON.parse(j.out) as { layout: { zero: number; pp: number; tp: number; dp: number }; fits: boolean }[]).find((x) => x.fits)!;
  const r = await flotilla(['train', cfgFile, '--nproc', '2', '--plan', ...pin, '--train.steps=2', '--train.evalEvery=0', '--train.evalBatches=1', '--checkpoint.every=0', '--log.progress=plain', `--train.runDir=${join(dir, 'run')}`], { timeoutMs: 240_000, env });
  assert.equal(r.code, 0, r.err + r.out);
  assert.match(r.out, /\[plan\] training with the layout ranked first of \d+: /);
  // The ranks run it: the mesh line names the chosen degrees.
  const mesh = /mesh pp (\d+) x dpReplicate (\d+) x dpShard (\d+) x cp (\d+) x tp (\d+)/.exec(r.out);
  assert.ok(mesh, r.out);
  assert.equal(Number(mesh[1]), best.layout.pp);
  assert.equal(Number(mesh[5]), best.layout.tp);
  // [parallel] auto inside an already started world is refused with the fix.
  const inside = await flotilla(['train', cfgFile, '--parallel.auto=true'], { timeoutMs: 60_000, env: { ...env, RANK: '0', WORLD_SIZE: '1', LOCAL_RANK: '0', LOCAL_WORLD_SIZE: '1', MASTER_ADDR: '127.0.0.1', MASTER_PORT: '29999' } });
  assert.equal(inside.code, 2, inside.err);
  assert.match(inside.err, /auto = true inside a world already started/);
});
