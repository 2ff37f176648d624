// The Open MPI backend through `flotilla run --backend mpi` (ranks under mpirun): the launch contract,
// output prefixes, failure handling and exit codes, and the errors a user gets for a backend that
// cannot run. The collectives themselves run on both backends in distributed_collectives.test.ts,
// distributed_failure.test.ts and parallel_ddp.test.ts.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { resolve } from 'node:path';
import { spawnMpiJob } from '../src/launch/mpirun.js';
import { runLauncher } from '../src/cli/run.js';
import { assertMpiBuilt, isAlive, parseAllResults, REPO_ROOT, scriptCommand } from './helpers/world.js';
import { suiteSlots } from './helpers/pool.js';
import { runnableScript } from './helpers/compiled.js';

// Worlds here time out in seconds: no other file's launch runs beside this file (test/helpers/pool.ts).
await suiteSlots.holdAll();

// Ranks start from the compiled script while dist/ is current (test/helpers/compiled.ts).
const SCRIPT = runnableScript('test/helpers/ranks/mpi_rank.ts');

async function launch(argv: string[]): Promise<{ code: number; out: string; err: string; perRank: string[] }> {
  assertMpiBuilt();
  let out = '', err = '';
  const code = await runLauncher(argv, {
    stdout: { write: (s: string) => (out += s) },
    stderr: { write: (s: string) => (err += s) },
    handleSignals: false,
    graceMs: 2000,
  });
  const perRank: string[] = [];
  for (const line of (out + err).split('\n')) {
    const m = /^\[rank (\d+)\] (.*)$/.exec(line);
    if (m) perRank[Number(m[1])] = `${perRank[Number(m[1])] ?? ''}${m[2]}\n`;
  }
  return { code, out, err, perRank };
}

interface R { rank: number; size: number; backend: string; sum: number; rankVar: string | null }

test('flotilla run --backend mpi: ranks join MPI_COMM_WORLD through mpirun, output prefixed by rank', async () => {
  const r = await launch(['--backend', 'mpi', '--nproc', '3', SCRIPT, 'ok']);
  assert.equal(r.code, 0, r.err);
  const res = parseAllResults<R>(r.perRank).map((x) => x[0]!);
  assert.deepEqual(res.map((x) => [x.rank, x.size, x.backend, x.sum]), [0, 1, 2].map((k) => [k, 3, 'mpi', 6]));
  assert.ok(res.every((x) => x.rankVar === null), 'under mpirun the rank comes from OMPI_COMM_WORLD_*, not RANK');
  for (let k = 0; k < 3; k++) assert.match(r.perRank[k]!, /^backend mpi \(Open MPI v[\d.]+; shared memory within a host\), 3 ranks$/m);
});

test('flotilla run --backend mpi: a rank that exits non-zero stops the others; the launcher exits with its code, naming it', async () => {
  const r = await launch(['--backend', 'mpi', '--nproc', '3', SCRIPT, 'fail', '1', '3']);
  assert.equal(r.code, 3, r.err);
  assert.match(r.err, /flotilla run: rank 1 exited with code 3; stopping the other 2 ranks/);
  assert.match(r.err, /flotilla run: failed: rank 1 exited with code 3/);
});

test('flotilla run --backend mpi: a rank killed by a signal gives 128 + signal, naming the rank', async () => {
  const r = await launch(['--backend', 'mpi', '--nproc', '2', SCRIPT, 'selfkill', '0']);
  assert.equal(r.code, 137, r.err);
  assert.match(r.err, /flotilla run: rank 0 was killed by SIGKILL/);
});

test('flotilla run --backend mpi: ranks end when the launcher is killed with SIGKILL', async () => {
  assertMpiBuilt();
  const launcher = spawn(process.execPath, [`${REPO_ROOT}/bin/flotilla.js`, 'run', '--backend', 'mpi', '--nproc', '2', SCRIPT, 'fail', '5', '1'], { cwd: REPO_ROOT, stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  const pids = await new Promise<number[]>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`ranks did not start:\n${out}`)), 30_000);
    launcher.stdout.on('data', (d: Buffer) => {
      out += d.toString();
      const found = [...out.matchAll(/"pid":(\d+)/g)].map((m) => Number(m[1]));
      if (found.length === 2) {
        clearTimeout(timer);
        resolve(found);
      }
    });
  });
  launcher.kill('SIGKILL');
  const until = Date.now() + 10_000;
  while (pids.some(isAlive) && Date.now() < until) await new Promise((res) => setTimeout(res, 100));
  assert.deepEqual(pids.filter(isAlive), [], 'ranks outlived their launcher');
});

test('mpirun jobs started at the same moment each keep their session files in a directory of their own, removed when the job ends', async () => {
  // Four jobs at once: with one shared <tmp>/ompi.<host>.<uid> they raced to make it ("File exists").
  assertMpiBuilt();
  const jobs = await Promise.all([0, 1, 2, 3].map(() => new Promise<{ code: number | null; lines: string[] }>((done) => {
    const lines: string[] = [];
    spawnMpiJob({
      nproc: 2, cmd: 'sh', args: ['-c', 'echo "$OMPI_MCA_orte_tmpdir_base"; ls "$OMPI_MCA_orte_tmpdir_base"'],
      onLine: (rank, _stream, line) => void lines.push(`${rank} ${line}`),
      onRankExit: () => {},
      onClose: (code) => done({ code, lines }),
    });
  })));
  const dirs = new Set<string>();
  for (const j of jobs) {
    assert.equal(j.code, 0, j.lines.join('\n'));
    const own = j.lines.find((l) => l.startsWith('0 /'))?.slice(2);
    assert.ok(own !== undefined, j.lines.join('\n'));
    assert.ok(j.lines.includes(`1 ${own}`), 'both ranks of a job see the same directory');
    assert.ok(j.lines.some((l) => /^0 ompi\./.test(l)), `mpirun's session files are in the job's directory:\n${j.lines.join('\n')}`);
    assert.equal(existsSync(own), false, `${own} outlived its job`);
    dirs.add(own);
  }
  assert.equal(dirs.size, 4, 'every job has a directory of its own');
});

test('backend errors a user can cause name the fix', async () => {
  let badErr = '';
  const bad = await runLauncher(['--backend', 'nccl', '--nproc', '2', SCRIPT], { stdout: { write: () => true }, stderr: { write: (s: string) => (badErr += s) }, handleSignals: false });
  assert.equal(bad, 2);
  assert.match(badErr, /--backend "nccl": expected gloo, mpi or auto/);
  let nodes = '';
  assert.equal(await runLauncher(['--backend', 'mpi', '--nnodes', '2', '--nproc', '1', SCRIPT], { stdout: { write: () => true }, stderr: { write: (s: string) => (nodes += s) }, handleSignals: false }), 2);
  assert.match(nodes, /--backend mpi starts ranks on one node/);
  // backend 'mpi' in a process mpirun did not start (a world of two by torchrun-style variables).
  const [cmd, args] = scriptCommand(resolve(REPO_ROOT, SCRIPT), ['ok']);
  const p = spawnSync(cmd, args, {
    cwd: REPO_ROOT, encoding: 'utf8', timeout: 30_000,
    env: { ...process.env, RANK: '0', WORLD_SIZE: '2', MASTER_ADDR: '127.0.0.1', MASTER_PORT: '1', FLOTILLA_BACKEND: 'mpi' },
  });
  assert.notEqual(p.status, 0);
  assert.match(p.stderr, /backend 'mpi' needs ranks started by mpirun \(flotilla run --backend mpi --nproc N script\.ts/);
  const q = spawnSync(cmd, args, { cwd: REPO_ROOT, encoding: 'utf8', timeout: 30_000, env: { ...process.env, FLOTILLA_BACKEND: 'tcp' } });
  assert.notEqual(q.status, 0);
  assert.match(q.stderr, /unknown FLOTILLA_BACKEND 'tcp' \(expected auto, gloo, mpi\)/);
});
