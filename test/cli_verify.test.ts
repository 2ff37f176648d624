// `flotilla verify` end to end: it passes for every layout (with the default fused kernels against a
// one-process run of the op-by-op ones) and fails for a deliberately broken one
// (a fault injected by preloading test/fixtures/break_averaging.ts: one gradient bucket skips the
// 1/N averaging). The layouts are one verify (`--and`): those of one rank count train in one world,
// and each test reads its layout's block of the output. Both verifies are queued when the file
// loads (test/helpers/pool.ts); each test awaits its own.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { REPO_ROOT } from './helpers/world.js';
import { BIN, verifyBlock } from './helpers/cli.js';
import { pool, spawnAsync, started } from './helpers/pool.js';
import { verifyLayouts } from '../src/cli/train_args.js';

const small = ['--model.nLayer=2', '--model.nEmbd=64', '--data.seqLen=32', '--data.globalBatch=8', '--parallel.bucketSizeMb=0.1'];

const launch = pool();
// The broken run starts from the TypeScript sources, which its preload patches; the others run the
// `flotilla` command (the compiled CLI when dist/ is current, see bin/flotilla.js).
function verify(nproc: number, overrides: string[], env: Record<string, string> = {}, fromSources = false, more: string[] = []): Promise<{ code: number | null; out: string }> {
  return started(launch(async () => {
    const cli = fromSources ? ['--import', 'tsx', 'src/cli/main.ts'] : [BIN];
    const r = await spawnAsync(process.execPath, [...cli, 'verify', 'examples/gpt-tiny.toml', '--nproc', String(nproc), '--steps', '4', ...small, ...overrides, ...more], {
      cwd: REPO_ROOT, env: { ...process.env, ...env }, timeout: 240_000,
    });
    return { code: r.status, out: `${r.stdout}${r.stderr}` };
  }));
}

const layouts: [string, number, string[]][] = [
  ['data parallel', 2, []],
  ['ZeRO-1', 2, ['--parallel.zero=1']],
  ['ZeRO-2 with 2 micro-batches', 2, ['--parallel.zero=2', '--data.microBatches=2']],
  ['ZeRO-3', 2, ['--parallel.zero=3']],
  ['HSDP 2 x 2, ZeRO-3', 4, ['--parallel.zero=3', '--parallel.dpReplicate=2']],
  // Unequal sizes: a data-parallel rank of replicateRank * dpReplicate + shardRank would read the wrong rows.
  ['HSDP dpShard 2 x dpReplicate 3, ZeRO-2', 6, ['--parallel.zero=2', '--parallel.dpReplicate=3', '--data.globalBatch=12']],
  ['pipeline pp=2, 1F1B', 2, ['--parallel.pp=2', '--data.microBatches=4']],
  ['pipeline pp=2 x ZeRO-2 over dp=2', 4, ['--parallel.pp=2', '--parallel.zero=2', '--data.microBatches=4']],
  ['pipeline pp=2 x ZeRO-3 over dp=2, zero bubble', 4, ['--parallel.pp=2', '--parallel.zero=3', '--parallel.ppSchedule=zb', '--data.microBatches=4']],
  ['tp=2 + sequence and loss parallelism', 2, ['--parallel.tp=2', '--parallel.sequenceParallel=true', '--parallel.lossParallel=true']],
  ['context parallelism cp=2', 2, ['--parallel.cp=2']],
];

const all = verify(layouts[0]![1], layouts[0]![2], {}, false, layouts.slice(1).flatMap(([, nproc, overrides]) => ['--and', '--nproc', String(nproc), ...overrides]));
const preload = join(REPO_ROOT, 'test', 'fixtures', 'break_averaging.ts');
const broken = verify(2, ['--parallel.zero=2'], { NODE_OPTIONS: `${process.env.NODE_OPTIONS ?? ''} --import tsx --import ${preload}`.trim() }, true);

for (const [i, [name, nproc]] of layouts.entries()) {
  test(`verify PASSes for ${name} on ${nproc} ranks`, async () => {
    const { out } = await all;
    const block = verifyBlock(out, i);
    // The default kernels are the fused ones, and the one process runs op by op: each layout
    // checks the kernels under it too.
    assert.match(block, new RegExp(`^verify: 4 step\\(s\\) of examples/gpt-tiny.toml on ${nproc} ranks \\(backend \\w+; kernels fused, the one process eager;`), out);
    assert.match(block, /^PASS \(tolerance/m, out);
    assert.equal(block.match(/^ +\d+ +[\d.]+ +[\d.e+-]+ +[\d.]+ +[\d.e+-]+$/gm)?.length, 4, `one line per step:\n${block}`);
  });
}

test(`one verify of ${layouts.length} layouts: exit 0 and a summary line`, async () => {
  const { code, out } = await all;
  assert.equal(code, 0, out);
  assert.match(out, new RegExp(`^verify: ${layouts.length} of ${layouts.length} layouts PASS$`, 'm'));
});

test('verify --and: each layout gets the first one\'s overrides, then its own, and its own --nproc or the first one\'s', () => {
  assert.deepEqual(verifyLayouts(['c.toml', '--nproc', '2', '--a.b=1', '--and', '--c.d=2', '--and', '--nproc', '4', '--a.b=3']), [
    { nproc: 2, overrides: ['--a.b=1'] }, { nproc: 2, overrides: ['--a.b=1', '--c.d=2'] }, { nproc: 4, overrides: ['--a.b=1', '--a.b=3'] },
  ]);
  assert.throws(() => verifyLayouts(['c.toml', '--nproc', '2', '--and', '--steps', '3']), /--steps applies to every layout/);
  assert.throws(() => verifyLayouts(['c.toml', '--and', '--nproc', '2']), /the layout's rank count with --nproc N/);
});

test('verify FAILs (exit 1) when one bucket skips the 1/N averaging', async () => {
  const { code, out } = await broken;
  assert.equal(code, 1, out);
  assert.match(out, /^FAIL \(tolerance/m);
});

test('verify needs --nproc and names the fix', () => {
  const r = spawnSync(process.execPath, [BIN, 'verify', 'examples/gpt-tiny.toml'], { cwd: REPO_ROOT, encoding: 'utf8' });
  assert.equal(r.status, 2);
  assert.match(r.stderr, /--nproc N/);
});
