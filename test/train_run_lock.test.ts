// One live run per run directory ([Note: run lock] in src/train/run_record.ts): a second run into a
// directory a live run holds is refused before it starts, naming the holder, and nothing in the
// directory changes; a stale lock of a dead run is taken over.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { hostname, tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { once } from 'node:events';
import { ConfigError, parseConfig } from '../src/config/index.js';
import { RunRecord } from '../src/train/run_record.js';
import { LOCK_FILE, lockRunDir, runDirProblem } from '../src/train/run_dir.js';

const root = mkdtempSync(join(tmpdir(), 'flotilla-lock-'));
const BIN = resolve('bin/flotilla.js');

/** A process that holds `dir`'s lock until killed; resolves once it holds it. */
async function holder(dir: string): Promise<ChildProcess> {
  const code = `import { lockRunDir } from ${JSON.stringify(resolve('src/train/run_dir.ts'))}; lockRunDir(${JSON.stringify(dir)}); console.log('held'); setInterval(() => {}, 1000);`;
  const child = spawn(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', code], { stdio: ['ignore', 'pipe', 'inherit'] });
  const [chunk] = (await once(child.stdout!, 'data')) as [Buffer];
  assert.match(chunk.toString(), /held/);
  return child;
}

function snapshot(dir: string): Map<string, string> {
  return new Map(readdirSync(dir).map((f) => [f, statSync(join(dir, f)).isFile() ? readFileSync(join(dir, f), 'utf8') : 'dir']));
}

test('a live run holds its directory: a second run is refused naming the holder, and nothing changes', async () => {
  const dir = join(root, 'live');
  mkdirSync(dir);
  writeFileSync(join(dir, 'metrics.jsonl'), '{"step":1,"loss":5,"lr":0.001,"tokensPerSec":1,"elapsedS":1}\n');
  const child = await holder(dir);
  try {
    const cfg = parseConfig('', [`--train.runDir=${dir}`, '--train.steps=2']);
    const problem = runDirProblem(cfg, { resume: true });
    assert.ok(problem !== undefined, 'a resume into a held directory must be refused');
    assert.match(problem, new RegExp(`in use by a live run \\(pid ${child.pid}, since `));
    assert.throws(() => new RunRecord(cfg, { resume: true, startStep: 0, worldSize: 1 }), (e: Error) => e instanceof ConfigError && e.message.includes(`pid ${child.pid}`));
    // Taking the lock directly (two launchers racing past the first check) is refused too.
    assert.throws(() => lockRunDir(dir), (e: Error) => e instanceof ConfigError && e.message.includes(`pid ${child.pid}`));

    // The CLI refuses before any rank starts: one message, exit status non-zero, nothing written.
    const before = snapshot(dir);
    const r = spawnSync(process.execPath, [BIN, 'train', resolve('examples/gpt-tiny.toml'), '--train.runDir', dir, '--train.steps=2', '--resume', 'latest'], { encoding: 'utf8', timeout: 120_000 });
    assert.notEqual(r.status, 0, r.stdout + r.stderr);
    assert.match(r.stderr, new RegExp(`is in use by a live run \\(pid ${child.pid}`), r.stderr);
    assert.deepEqual(snapshot(dir), before, 'the refused run changed the directory');
  } finally {
    child.kill('SIGKILL');
    await once(child, 'exit');
  }
});

test('a dead run\'s lock is stale and taken over; the lock goes when the run record closes', async () => {
  const dir = join(root, 'stale');
  mkdirSync(dir);
  const child = await holder(dir);
  child.kill('SIGKILL'); // dies without removing its lock, as a killed run does
  await once(child, 'exit');
  assert.ok(existsSync(join(dir, LOCK_FILE)), 'the killed holder leaves its lock behind');
  const cfg = parseConfig('', [`--train.runDir=${dir}`]);
  assert.equal(runDirProblem(cfg), undefined, 'a stale lock alone does not make the directory an earlier run\'s');
  const rec = new RunRecord(cfg, { resume: false, startStep: 0, worldSize: 1 });
  const held = JSON.parse(readFileSync(join(dir, LOCK_FILE), 'utf8')) as { pid: number; host: string };
  assert.deepEqual([held.pid, held.host], [process.pid, hostname()]);
  rec.close();
  assert.ok(!existsSync(join(dir, LOCK_FILE)), 'close() releases the lock');
});

test('a lock taken over from a reused pid: the start time decides, not the pid alone', () => {
  const dir = join(root, 'reused');
  mkdirSync(dir);
  // Our own parent's pid is alive, but it never took this lock (another start time).
  writeFileSync(join(dir, LOCK_FILE), JSON.stringify({ pid: process.ppid, host: hostname(), startTicks: '1', since: 'then' }));
  const cfg = parseConfig('', [`--train.runDir=${dir}`]);
  assert.equal(runDirProblem(cfg), undefined);
  const { release } = lockRunDir(dir);
  release();
});
