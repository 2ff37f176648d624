// Teardown: initProcessGroup / destroyProcessGroup cycles in one process, on every backend and
// every kind of rendezvous, must keep working and leave open files, threads and listeners flat.
// Before, a second cycle under `flotilla run` failed with "RANK=1 was given to two processes" (the
// rank claims of every cycle met in one store file), and under MPI every cycle left a communicator
// and its worker thread behind. The three worlds start when the file loads, two at a time
// (test/helpers/pool.ts): each rank counts only its own files, threads and sockets.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runLauncher } from '../src/cli/run.js';
import { runWorld, parseAllResults, describeWorld, assertMpiBuilt } from './helpers/world.js';
import { pool, started } from './helpers/pool.js';

const SCRIPT = 'test/helpers/ranks/teardown.ts';
const CYCLES = 50;

interface Usage { fds: number; threads: number; listeners: number }
interface Report { rank: number; sum: number; after: Usage[] }

function checkFlat(reports: Report[], what: string): void {
  assert.equal(reports.length, 2, what);
  for (const { rank, sum, after } of reports) {
    assert.equal(sum, 6, `rank ${rank}: (1 + 2) summed on the world, then again on the sub-group`);
    assert.equal(after.length, CYCLES, `rank ${rank}: ${what}`);
    for (const a of after) assert.equal(a.listeners, 0, `rank ${rank}: listening sockets left after destroyProcessGroup: ${JSON.stringify(a)}`);
    // The first cycle loads what stays loaded (MPI's own progress threads, libraries): compare later ones to it.
    const first = after[0]!;
    const last = after[CYCLES - 1]!;
    assert.ok(last.fds <= first.fds + 2, `rank ${rank}: open files grew from ${first.fds} to ${last.fds} over ${CYCLES} cycles`);
    assert.ok(last.threads <= first.threads, `rank ${rank}: threads grew from ${first.threads} to ${last.threads} over ${CYCLES} cycles`);
  }
}

const queue = pool();
const launched = started(queue(async () => {
  let out = '';
  let err = '';
  const code = await runLauncher(['--nproc', '2', '--backend', 'gloo', SCRIPT, 'cycles', String(CYCLES)], {
    stdout: { write: (s: string) => (out += s) }, stderr: { write: (s: string) => (err += s) }, handleSignals: false,
  });
  return { code, out, err };
}));
const handStarted = started(queue(() => runWorld({ nproc: 2, script: SCRIPT, args: ['cycles', String(CYCLES)], timeoutMs: 120_000, store: 'socket' })));
const mpirun = started(queue(async () => {
  assertMpiBuilt();
  return runWorld({ nproc: 2, script: SCRIPT, args: ['cycles', String(CYCLES)], backend: 'mpi', timeoutMs: 120_000 });
}));

test(`flotilla run (Gloo, FileStore rendezvous): ${CYCLES} init/destroy cycles work; fds, threads flat`, async () => {
  const { code, out, err } = await launched;
  assert.equal(code, 0, err);
  const perRank = ['', ''];
  for (const line of out.split('\n')) {
    const m = /^\[rank (\d+)\] (.*)$/.exec(line);
    if (m) perRank[Number(m[1])] += `${m[2]}\n`;
  }
  checkFlat(parseAllResults<Report>(perRank).map((r) => r[0]!), err);
});

test(`hand-started ranks (Gloo, flotilla's store on one MASTER_PORT): ${CYCLES} cycles; fds, threads, listeners flat`, async () => {
  const w = await handStarted;
  assert.deepEqual(w.codes, [0, 0], describeWorld(w));
  checkFlat(parseAllResults<Report>(w.outputs).map((r) => r[0]!), describeWorld(w));
});

test(`mpirun (Open MPI): ${CYCLES} cycles free their communicators and worker threads`, async () => {
  const w = await mpirun;
  assert.deepEqual(w.codes, [0, 0], describeWorld(w));
  checkFlat(parseAllResults<Report>(w.outputs).map((r) => r[0]!), describeWorld(w));
});
