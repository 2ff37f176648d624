// The `flotilla` command end to end: a short training run on one process and on two ranks
// (which must train identically, data parallel and as a 2-stage pipeline with its validation loss),
// and usage/config errors that exit 2 and write nothing. Every run is queued when the file loads,
// two at a time (test/helpers/pool.ts); each test awaits its own.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import type { ChildProcess } from 'node:child_process';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { readMetrics } from '../src/train/metrics.js';
import { flotilla as flotillaNow } from './helpers/cli.js';
import { pool, started } from './helpers/pool.js';
import { tinyGptToml } from './fixtures/tiny_gpt.js';
import { processTree } from '../src/launch/heartbeat.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-cli-'));

const config = join(dir, 'tiny.toml');
writeFileSync(config, tinyGptToml({ train: { name: 'smoke', steps: 20, evalEvery: 10, evalBatches: 2 }, log: { every: 5 } }, 'a tiny GPT for a quick smoke run'));

const queue = pool();
const flotilla = (args: string[], onStart?: (c: ChildProcess) => void): ReturnType<typeof flotillaNow> => started(queue(() => flotillaNow(args, { onStart })));

const mapsLibtorch = (pid: number): boolean => {
  try {
    return readFileSync(`/proc/${pid}/maps`, 'utf8').includes('libtorch_cpu');
  } catch {
    return false;
  }
};
/**
 * Whether the launcher process had libtorch loaded once a rank had: the launcher only starts and
 * watches ranks, and loading the addon would cost it a second of CPU (undefined: no rank was seen
 * with it loaded).
 */
function launcherLoadsLibtorch(c: ChildProcess): Promise<boolean | undefined> {
  return new Promise((res) => {
    const timer = setInterval(() => {
      if (processTree(c.pid!).slice(1).some(mapsLibtorch)) {
        clearInterval(timer);
        res(mapsLibtorch(c.pid!));
      }
    }, 20);
    c.on('exit', () => {
      clearInterval(timer);
      res(undefined);
    });
  });
}
let launcherMapped: Promise<boolean | undefined> | undefined;

const single = flotilla(['train', config, `--train.runDir=${join(dir, 'single')}`]);
const dp2 = [1, 2].map((mb) => [mb, flotilla(['train', config, '--nproc', '2', `--train.runDir=${join(dir, `dp2-mb${mb}`)}`, `--data.microBatches=${mb}`], (c) => {
  if (mb === 1) launcherMapped = launcherLoadsLibtorch(c);
})] as const);
// Plain SGD (`[optim] name = "sgd"`) at an SGD learning rate, saving its last step.
const sgd = flotilla(['train', config, '--optim.name=sgd', '--optim.lr=1', '--optim.minLr=0.1', '--checkpoint.every=20', `--train.runDir=${join(dir, 'sgd')}`]);
const tinyArgs = ['train', 'examples/gpt-tiny.toml', '--train.steps=4', '--train.evalEvery=2'];
const tinyOne = flotilla([...tinyArgs, `--train.runDir=${join(dir, 'tiny-one')}`]);
const tinyPp2 = flotilla([...tinyArgs, '--nproc', '2', '--parallel.pp=2', `--train.runDir=${join(dir, 'tiny-pp2')}`]);
const USAGE: [string[], RegExp][] = [
  [[], /usage:/],
  [['frobnicate'], /unknown command "frobnicate"; commands: train, verify, run, config/],
  [['train'], /train: missing the config file/],
  [['train', config, '--nproc', 'two'], /--nproc needs a positive integer, got "two"/],
  [['train', config, '--verbose'], /unknown option --verbose/],
  [['train', join(dir, 'nope.toml')], /config file .*nope\.toml does not exist/],
];
const usage = USAGE.map(([args, re]) => [args, re, flotilla(args)] as const);
const help = flotilla(['--help']);
const CONFIG_ERRORS: [string[], RegExp][] = [
  [['--model.nlayer=2'], /unknown key --model\.nlayer \(did you mean nLayer\?\); valid keys in \[model\]/],
  [['--optim.lr=fast'], /--optim\.lr must be a number, got "fast"/],
  [['--data.globalBatch=7', '--nproc', '2'], /data\.globalBatch=7 does not split over 2 data-parallel rank\(s\) x 1 micro-batch\(es\) = 2 equal parts; set data\.globalBatch to a multiple of 2 \(e\.g\. 6 or 8\)/],
  [['--parallel.dp=4', '--nproc', '2'], /parallel\.dp=4 but the world has 2 rank\(s\).*--nproc 4/],
  [['--data.source=/no/such/file.txt'], /text file \/no\/such\/file\.txt does not exist/],
];
// Each refused run names a run directory of its own, so the one that wrote is the one named.
const configErrors = CONFIG_ERRORS.map(([extra, re], i) => {
  const runDir = join(dir, `never-${i}`);
  return [extra, re, runDir, flotilla(['train', config, `--train.runDir=${runDir}`, ...extra])] as const;
});

test('flotilla train: 20 steps on one process write metrics, and the loss falls', async () => {
  const runDir = join(dir, 'single');
  const r = await single;
  assert.equal(r.code, 0, r.out + r.err);
  assert.match(r.out, /^\[world\] backend local \(one process, no collectives\), started by a single process/m);
  assert.match(r.out, /^step 20\/20 \| loss \d\.\d{4} \| val \d\.\d{4}/m, 'plain progress lines when stdout is not a terminal');
  const m = readMetrics(join(runDir, 'metrics.jsonl'));
  assert.equal(m.length, 20);
  const first = m[0]!.loss;
  const last = m[19]!.loss;
  assert.ok(last < first - 1, `loss ${first} -> ${last}`);
  assert.ok(existsSync(join(runDir, 'config.toml')));
});

test('flotilla train --nproc 2 trains exactly like one process (data parallel, with and without accumulation)', async () => {
  assert.equal((await single).code, 0);
  const one = readMetrics(join(dir, 'single', 'metrics.jsonl'));
  for (const [mb, run] of dp2) {
    const runDir = join(dir, `dp2-mb${mb}`);
    const r = await run;
    assert.equal(r.code, 0, r.out + r.err);
    assert.match(r.out, /\[rank 0\] \[mesh\] data parallel 2, accumulate reduceLast/);
    assert.match(r.out, /\[rank 0\] \[parallelize\] \d+ bucket\(s\)/);
    assert.doesNotMatch(r.out, /\[rank 1\] \[/, 'only rank 0 prints progress');
    if (mb === 1) assert.equal(await launcherMapped, false, 'the launcher process never loads libtorch (only its ranks do)');
    const m = readMetrics(join(runDir, 'metrics.jsonl'));
    assert.equal(m.length, 20);
    m.forEach((row, i) => {
      const ref = one[i]!;
      assert.ok(Math.abs(row.loss - ref.loss) / ref.loss < 1e-5, `microBatches ${mb}, step ${i + 1}: loss ${row.loss} vs ${ref.loss}`);
      if (ref.valLoss !== undefined) assert.ok(Math.abs(row.valLoss! - ref.valLoss) / ref.valLoss < 1e-5, `val loss at step ${i + 1}`);
    });
  }
});

test('flotilla train --nproc 2 --parallel.pp=2 reports validation losses and the memory line; they equal one process', async () => {
  const [one, pp] = await Promise.all([tinyOne, tinyPp2]);
  assert.equal(one.code, 0, one.out + one.err);
  assert.equal(pp.code, 0, pp.out + pp.err);
  assert.match(pp.out, /\[rank 0\] \[mesh\] pipeline 2/);
  assert.match(pp.out, /\[rank 0\] \[memory\] rank 0 holds parameters \d+\.\d+ MiB .*optimizer state \d+\.\d+ MiB .*step peak \d+\.\d+ MiB/);
  // the ranks run the tensor cache (the default allocator) and say what it keeps
  assert.match(pp.out, /\[rank 0\] \[memory\] .*the process: resident \d+ MiB, peak \d+ MiB \(.*; \d+ MiB of it is freed tensor memory the cache keeps\)/);
  assert.match(pp.out, /\[rank 0\] step 2\/4 \| loss \d\.\d{4} \| val \d\.\d{4}/);
  assert.match(pp.out, /\[rank 0\] \[done\] loss \d\.\d{4} -> \d\.\d{4}, val loss \d\.\d{4}/);
  const ref = readMetrics(join(dir, 'tiny-one', 'metrics.jsonl'));
  const got = readMetrics(join(dir, 'tiny-pp2', 'metrics.jsonl'));
  assert.deepEqual(got.map((r) => r.valLoss !== undefined), [false, true, false, true], 'validation at steps 2 and 4');
  got.forEach((row, i) => {
    const want = ref[i]!;
    assert.ok(Math.abs(row.loss - want.loss) / want.loss < 1e-5, `step ${i + 1}: loss ${row.loss} vs one process ${want.loss}`);
    if (want.valLoss !== undefined) {
      assert.ok(Math.abs(row.valLoss! - want.valLoss) / want.valLoss < 1e-5, `step ${i + 1}: val loss ${row.valLoss} vs one process ${want.valLoss}`);
    }
  });
});

test('[optim] name = "sgd" trains with SGD; resuming its checkpoint under AdamW is refused, naming the way out', async () => {
  const r = await sgd;
  assert.equal(r.code, 0, r.out + r.err);
  assert.match(r.out, /^\[optimizer\] SGD, weight decay 0\.1 on \d+ matrices; lr 1 /m);
  const m = readMetrics(join(dir, 'sgd', 'metrics.jsonl'));
  assert.equal(m.length, 20);
  assert.ok(m[19]!.loss < m[0]!.loss - 1, `loss ${m[0]!.loss} -> ${m[19]!.loss}`);
  assert.equal((await single).code, 0);
  const adamw = readMetrics(join(dir, 'single', 'metrics.jsonl'));
  assert.notEqual(m[1]!.loss, adamw[1]!.loss, 'another optimizer, another second step');
  const resumed = await flotilla(['train', config, '--train.steps=22', '--resume', join(dir, 'sgd', 'checkpoints', 'step-000020'), `--train.runDir=${join(dir, 'sgd-as-adamw')}`]);
  assert.equal(resumed.code, 2, resumed.out + resumed.err);
  assert.match(resumed.err, /holds SGD optimizer state, and optim\.name chooses AdamW: set optim\.name to the optimizer that saved it, or start a new run from its weights with train\.initFrom/);
});

test('bad usage exits 2 with one message', async () => {
  for (const [args, re, run] of usage) {
    const r = await run;
    assert.equal(r.code, 2, `flotilla ${args.join(' ')}: ${r.err}`);
    assert.match(r.err, re);
    assert.doesNotMatch(r.err, /\n\s+at /, 'no stack trace');
  }
  const h = await help;
  assert.equal(h.code, 0);
  assert.match(h.out, /flotilla train <config\.toml> \[--nproc N\]/);
});

test('config errors exit 2 naming the field, and nothing is written', async () => {
  for (const [extra, re, runDir, run] of configErrors) {
    const r = await run;
    assert.equal(r.code, 2, `${extra.join(' ')} should fail with exit 2:\n${r.out}${r.err}`);
    assert.doesNotMatch(r.out + r.err, /\[rank \d\]/, 'rejected before any rank starts');
    assert.match(r.out + r.err, re);
    assert.ok(!existsSync(runDir), `${extra.join(' ')} created the run directory`);
  }
});
