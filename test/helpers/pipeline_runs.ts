// Launching test/fixtures/pipeline_rank.ts worlds and reading what each rank wrote: shared by the
// pipeline training and evaluation tests.
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { runWorld, describeWorld } from './world.js';
import type { Run } from '../fixtures/pipeline_rank.js';

const script = 'test/fixtures/pipeline_rank.ts';

/**
 * Runs every run of `runs` in one world of nproc ranks; each rank writes `${dir}/${run.name}.${rank}.json`.
 * The world is killed after `timeoutMs` (default 120 s; worlds of many runs pass more).
 */
export async function launchPipelineRuns(mode: 'train' | 'eval', dir: string, nproc: number, runs: Run[], timeoutMs = 120_000): Promise<void> {
  const r = await runWorld({ nproc, script, args: [JSON.stringify({ mode, out: dir, runs })], timeoutMs });
  assert.deepEqual(r.codes, new Array(nproc).fill(0), describeWorld(r));
}

/** Every rank's result of one run. */
export function readPipelineRun<T>(dir: string, name: string, nproc: number): T[] {
  return Array.from({ length: nproc }, (_, r) => {
    const f = join(dir, `${name}.${r}.json`);
    assert.ok(existsSync(f), `rank ${r} wrote no result for ${name}`);
    return JSON.parse(readFileSync(f, 'utf8')) as T;
  });
}
