// One live run per run directory ([Note: run lock] in src/train/run_dir.ts): a second run into a
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

test('a zombie holds nothing: the lock of a killed process its parent has not reaped yet is stale', async () => {
  const dir = join(root, 'zombie');
  mkdirSync(dir);
  // sh starts a child that exits at once, then becomes a process that never reaps it: a zombie for 30 s.
  const parent = spawn('sh', ['-c', 'sleep 0 & echo $!; exec sleep 30'], { stdio: ['ignore', 'pipe', 'inherit'] });
  try {
    const [chunk] = (await once(parent.stdout!, 'data')) as [Buffer];
    const pid = Number(chunk.toString().trim());
    const stat = (): string[] => { const s = readFileSync(`/proc/${pid}/stat`, 'utf8'); return s.slice(s.lastIndexOf(')') + 2).split(' '); };
    for (const end = Date.now() + 10_000; stat()[0] !== 'Z'; await new Promise((r) => setTimeout(r, 20))) assert.ok(Date.now() < end, 'no zombie');
    writeFileSync(join(dir, LOCK_FILE), JSON.stringify({ pid, host: hostname(), startTicks: stat()[19], since: 'then' }));
    assert.equal(runDirProblem(parseConfig('', [`--train.runDir=${dir}`])), undefined);
    const { release } = lockRunDir(dir);
    release();
  } finally {
    parent.kill('SIGKILL');
  }
});

test('a later attempt of the same job takes over its earlier attempt\'s lock on any host; another job\'s, or the same attempt\'s, from another host is refused', () => {
  const dir = join(root, 'same-job');
  mkdirSync(dir);
  const lock = (holder: object): void => writeFileSync(join(dir, LOCK_FILE), JSON.stringify({ pid: 1, host: 'another-host', startTicks: '1', since: 'then', ...holder }));
  const cfg = parseConfig('', [`--train.runDir=${dir}`]);
  const saved = { job: process.env.FLOTILLA_JOB, attempt: process.env.FLOTILLA_RESTART_COUNT };
  Object.assign(process.env, { FLOTILLA_JOB: 'job-a', FLOTILLA_RESTART_COUNT: '3' });
  try {
    lock({ job: 'job-a', attempt: 2 });
    assert.equal(runDirProblem(cfg), undefined, 'its own job\'s earlier attempt holds nothing');
    const { release } = lockRunDir(dir);
    assert.deepEqual(JSON.parse(readFileSync(join(dir, LOCK_FILE), 'utf8')).job, 'job-a');
    release();
    assert.ok(!existsSync(join(dir, LOCK_FILE)));
    for (const other of [{ job: 'job-b', attempt: 2 }, { job: 'job-a', attempt: 3 }, {}]) {
      lock(other);
      assert.match(runDirProblem(cfg) ?? '', /in use by a live run \(pid 1 on host another-host/, JSON.stringify(other));
      assert.throws(() => lockRunDir(dir), /in use by a live run \(pid 1 on host another-host/);
    }
  } finally {
    for (const [k, v] of [['FLOTILLA_JOB', saved.job], ['FLOTILLA_RESTART_COUNT', saved.attempt]] as const) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  }
});
