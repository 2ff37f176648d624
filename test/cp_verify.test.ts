// `flotilla verify` with context parallelism, through the trainer: cp = 2 on the Llama (rotary
// positions) under bf16-mixed, where verify states its bfloat16 tolerance (ring attention computes
// its blocks in float32); and a checkpoint saved at cp = 2 x ZeRO-2 (the GPT) resumes at
// cp = 1 in one process, within float32 rounding of the straight run (checkpoints and the data
// position do not depend on cp). The float64 equivalence of every cp layout is test/cp_layouts.test.ts.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { REPO_ROOT } from './helpers/world.js';
import { BIN } from './helpers/cli.js';
import { pool, spawnAsync, started } from './helpers/pool.js';
import { tinyGptToml } from './fixtures/tiny_gpt.js';

const config = join(mkdtempSync(join(tmpdir(), 'flotilla-cp-verify-')), 'cp.toml');
writeFileSync(config, tinyGptToml({ model: { nLayer: 2 }, data: { globalBatch: 4 }, optim: { minLr: undefined }, parallel: { backend: 'gloo' } }));

const queue = pool(1);
function verify(args: string[]): Promise<{ code: number | null; out: string }> {
  return started(queue(async () => {
    const r = await spawnAsync(process.execPath, [BIN, 'verify', config, ...args], { cwd: REPO_ROOT, timeout: 300_000, env: { ...process.env, FLOTILLA_REPORT: '0' } });
    return { code: r.status, out: `${r.stdout}${r.stderr}` };
  }));
}

const runs = {
  bf16: verify(['--nproc', '2', '--steps', '3', '--parallel.cp=2', '--model.arch=llama', '--train.precision=bf16-mixed']),
  toCp1: verify(['--nproc', '2', '--parallel.cp=2', '--parallel.zero=2', '--resume', '2', '--steps', '4', '--then', '--nproc', '1', '--parallel.cp=1', '--parallel.zero=0']),
};

for (const [name, what] of [
  ['bf16', 'verify PASSes for cp = 2 on the Llama under bf16-mixed, at the stated bfloat16 tolerance'],
  ['toCp1', 'a checkpoint saved at cp = 2 x ZeRO-2 resumes at cp = 1 in one process'],
] as const) {
  test(what, async () => {
    const { code, out } = await runs[name];
    assert.equal(code, 0, out);
    assert.match(out, /^PASS \(/m);
    if (name === 'bf16') {
      assert.match(out, /cp 2\) against one process/);
      assert.match(out, /ring attention computes its blocks in float32/);
    }
  });
}
