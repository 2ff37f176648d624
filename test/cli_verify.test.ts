// `flotilla verify` end to end: it passes for every layout and fails for a deliberately broken one
// (a fault injected by preloading test/fixtures/break_averaging.ts: one gradient bucket skips the
// 1/N averaging). Every verify is queued when the file loads, two at a time (test/helpers/pool.ts);
// each test awaits its own.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { REPO_ROOT } from './helpers/world.js';
import { BIN } from './helpers/cli.js';
import { pool, spawnAsync, started } from './helpers/pool.js';

const small = ['--model.nLayer=2', '--model.nEmbd=64', '--data.seqLen=32', '--data.globalBatch=8', '--parallel.bucketSizeMb=0.1'];

const launch = pool();
// The broken run starts from the TypeScript sources, which its preload patches; the others run the
// `flotilla` command (the compiled CLI when dist/ is current, see bin/flotilla.js).
function verify(nproc: number, overrides: string[], env: Record<string, string> = {}, fromSources = false): Promise<{ code: number | null; out: string }> {
  return started(launch(async () => {
    const cli = fromSources ? ['--import', 'tsx', 'src/cli/main.ts'] : [BIN];
    const r = await spawnAsync(process.execPath, [...cli, 'verify', 'examples/gpt-tiny.toml', '--nproc', String(nproc), '--steps', '4', ...small, ...overrides], {
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
];

const passes = layouts.map(([, nproc, overrides]) => verify(nproc, overrides));
const preload = join(REPO_ROOT, 'test', 'fixtures', 'break_averaging.ts');
const broken = verify(2, ['--parallel.zero=2'], { NODE_OPTIONS: `${process.env.NODE_OPTIONS ?? ''} --import tsx --import ${preload}`.trim() }, true);

for (const [i, [name, nproc]] of layouts.entries()) {
  test(`verify PASSes for ${name} on ${nproc} ranks`, async () => {
    const { code, out } = await passes[i]!;
    assert.equal(code, 0, out);
    assert.match(out, /^PASS \(tolerance/m);
    assert.equal(out.match(/^ +\d+ +[\d.]+ +[\d.e+-]+ +[\d.]+ +[\d.e+-]+$/gm)?.length, 4, `one line per step:\n${out}`);
  });
}

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
