// Faults a job must survive by ending, in seconds, with every survivor exiting non-zero, the culprit
// named and no process left behind: a hung rank, a rank that throws in the middle of a pipeline step
// on another node, and (in network namespaces) two hosts whose link is cut mid-training. The
// collective timeout is long in every test (120 s): ending within the bounds below is the heartbeat's
// doing, not the timeout's. docs/FAULTS.md reproduces these by hand and tabulates them.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { join } from 'node:path';
import { assertMpiBuilt, freePort, isAlive, REPO_ROOT } from './helpers/world.js';
import { sideBySide, suiteSlots } from './helpers/pool.js';
import { runnableScript } from './helpers/compiled.js';
import { makeHosts } from './helpers/hosts.js';

// Worlds here time out in seconds: no other file's launch runs beside this file (test/helpers/pool.ts).
await suiteSlots.holdAll();

const FLOTILLA = join(REPO_ROOT, 'bin', 'flotilla.js');
// Ranks start from the compiled script while dist/ is current (test/helpers/compiled.ts).
const SCRIPT = runnableScript(join(REPO_ROOT, 'test', 'helpers', 'ranks', 'faults.ts'));
/** Short beats so a fault test ends in seconds; the collective timeout stays long. */
const FAST = { FLOTILLA_HEARTBEAT_MS: '300', FLOTILLA_HEARTBEAT_TIMEOUT_MS: '2000', FLOTILLA_TIMEOUT_MS: '120000', FLOTILLA_KILL_GRACE_MS: '2000' };
/** Generous bounds (far below the 120 s collective timeout). */
const DETECT_BOUND_MS = 45_000;

interface Proc { child: ChildProcess; out: string; done: Promise<number | null>; seen: (re: RegExp, n?: number) => Promise<RegExpMatchArray[]> }

function start(cmd: string, args: string[], env: Record<string, string | undefined>): Proc {
  const child = spawn(cmd, args, { cwd: REPO_ROOT, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  const p: Proc = {
    child, out: '',
    done: new Promise((res) => child.on('close', (code) => res(code))),
    seen: (re, n = 1) => new Promise((resolve, reject) => {
      const check = (): boolean => {
        const found = [...p.out.matchAll(new RegExp(re, 'g'))];
        if (found.length < n) return false;
        resolve(found);
        return true;
      };
      if (check()) return;
      const timer = setTimeout(() => reject(new Error(`${re} not seen ${n} time(s) within 90 s; output:\n${p.out}`)), 90_000);
      const on = (): void => {
        if (check()) {
          clearTimeout(timer);
          child.stdout!.off('data', on);
          child.stderr!.off('data', on);
        }
      };
      child.stdout!.on('data', on);
      child.stderr!.on('data', on);
    }),
  };
  const verbose = process.env.FLOTILLA_TEST_VERBOSE === '1';
  child.stdout!.on('data', (d) => {
    p.out += d;
    if (verbose) process.stderr.write(`[${child.pid}] ${d}`);
  });
  child.stderr!.on('data', (d) => {
    p.out += d;
    if (verbose) process.stderr.write(`[${child.pid}] ${d}`);
  });
  return p;
}

async function gone(pids: number[], withinMs = 15_000): Promise<number[]> {
  const until = Date.now() + withinMs;
  while (pids.some(isAlive) && Date.now() < until) await new Promise((r) => setTimeout(r, 100));
  const left = pids.filter(isAlive);
  for (const p of left) process.kill(p, 'SIGKILL');
  return left;
}

for (const backend of ['gloo', 'mpi'] as const) {
  test(`${backend}: a rank stopped with SIGSTOP is found as hung within the heartbeat timeout; the job ends naming it, no orphans`, async () => {
    if (backend === 'mpi') assertMpiBuilt();
    const job = start(process.execPath, [FLOTILLA, 'run', '--backend', backend, '--nproc', '2', SCRIPT, 'train', '1000'], FAST);
    try {
      const pids = (await job.seen(/PID \d+ (\d+)/, 2)).map((m) => Number(m[1]));
      const victim = Number(/\[rank 1\] PID 1 (\d+)/.exec(job.out)![1]);
      await job.seen(/STEP 1 3/);
      const t0 = Date.now();
      process.kill(victim, 'SIGSTOP');
      const code = await job.done;
      const ms = Date.now() - t0;
      assert.notEqual(code, 0, job.out);
      assert.match(job.out, /flotilla run: failed: rank 1 hung: stopped for \d+ ms/, job.out);
      assert.ok(ms < DETECT_BOUND_MS, `took ${ms} ms to end the job`);
      assert.deepEqual(await gone(pids), [], 'ranks outlived the job');
    } finally {
      job.child.kill('SIGKILL');
    }
  });
}

// Both backends at once: each job spends its 10 s waiting for the collective timeout, idle.
sideBySide('a rank stopped with SIGSTOP past the collective timeout, on Gloo and on Open MPI side by side', (['gloo', 'mpi'] as const).map((backend) => [`${backend}: a rank stopped with SIGSTOP past the collective timeout is named as stalled, not the rank that timed out waiting for it`, async () => {
    if (backend === 'mpi') assertMpiBuilt();
    // The collective timeout (10 s) comes long before the hung-rank watch (120 s): only the rank
    // that timed out can tell the launcher whom it waited for.
    const env = { ...FAST, FLOTILLA_TIMEOUT_MS: '10000', FLOTILLA_HEARTBEAT_TIMEOUT_MS: '120000' };
    const job = start(process.execPath, [FLOTILLA, 'run', '--backend', backend, '--nproc', '2', SCRIPT, 'train', '1000'], env);
    try {
      const pids = (await job.seen(/PID \d+ (\d+)/, 2)).map((m) => Number(m[1]));
      const victim = Number(/\[rank 0\] PID 0 (\d+)/.exec(job.out)![1]);
      await job.seen(/STEP 1 3/);
      process.kill(victim, 'SIGSTOP');
      const code = await job.done;
      assert.notEqual(code, 0, job.out);
      assert.match(job.out, /flotilla run: failed: rank 0 stalled: rank 1 timed out waiting in a collective/, job.out);
      assert.deepEqual(await gone(pids), [], 'ranks outlived the job');
    } finally {
      job.child.kill('SIGKILL');
    }
  }]));

test('two nodes (loopback): a rank that throws mid-step on node 1 ends node 0\'s ranks within seconds, not at the collective timeout', async () => {
  const port = await freePort();
  const common = ['run', '--nnodes', '2', '--nproc', '1', '--master-addr', '127.0.0.1', '--master-port', String(port)];
  const env = { ...FAST, FLOTILLA_HEARTBEAT_TIMEOUT_MS: '60000' }; // only the failure message can end it in time
  const n0 = start(process.execPath, [FLOTILLA, ...common, '--node-rank', '0', SCRIPT, 'throw-mid-step'], env);
  const n1 = start(process.execPath, [FLOTILLA, ...common, '--node-rank', '1', SCRIPT, 'throw-mid-step'], env);
  try {
    const pids = [...(await n0.seen(/PID \d+ (\d+)/)), ...(await n1.seen(/PID \d+ (\d+)/))].map((m) => Number(m[1]));
    const t0 = Date.now();
    const [c0, c1] = await Promise.all([n0.done, n1.done]);
    const ms = Date.now() - t0;
    assert.notEqual(c1, 0, n1.out);
    assert.notEqual(c0, 0, n0.out);
    assert.match(n0.out, /flotilla run: failed: node 1 \(rank 1\) failed: node 1: rank 1 exited with code 1/, n0.out);
    assert.ok(ms < DETECT_BOUND_MS, `node 0 took ${ms} ms to stop`);
    assert.deepEqual(await gone(pids), [], 'ranks outlived the job');
  } finally {
    n0.child.kill('SIGKILL');
    n1.child.kill('SIGKILL');
  }
});

// ---------------------------------------------------------------------------------------------
// Two hosts: two network namespaces on one bridge (test/helpers/hosts.ts).

test('two hosts (network namespaces, veth): defaults reach across (Gloo on the veth, named in the header); a cut link is found within the heartbeat timeout on both sides, no orphans', async (t) => {
  const hosts = makeHosts(2);
  if (typeof hosts === 'string') {
    t.skip(`cannot make network namespaces here: ${hosts}`);
    return;
  }
  const { ns: NS, addr: ADDR } = hosts;
  const nodes: Proc[] = [];
  try {
    const env = { ...FAST, FLOTILLA_JOB_SECRET: 'two-host-test-secret-0123456789', FLOTILLA_GLOO_IFACE: undefined, GLOO_SOCKET_IFNAME: undefined, FLOTILLA_GLOO_HOSTNAME: undefined };
    for (const k of [0, 1]) {
      nodes.push(start(...hosts.exec(k, process.execPath, [FLOTILLA, 'run', '--nnodes', '2', '--node-rank', String(k), '--nproc', '1',
        '--master-addr', ADDR[0]!, '--master-port', '29400', SCRIPT, 'train', '1000']), env));
    }
    // Training runs across the hosts with the defaults: Gloo bound to each host's veth address.
    await nodes[0]!.seen(/STEP 0 5/);
    await nodes[1]!.seen(/STEP 1 5/);
    for (const k of [0, 1]) {
      assert.match(nodes[k]!.out, new RegExp(`backend gloo \\(c10d Gloo over TCP on ${NS[k]}v ${ADDR[k]!.replace(/\./g, '\\.')} \\(the route to MASTER_ADDR 10\\.77\\.0\\.1\\)\\), 2 ranks`), nodes[k]!.out);
    }
    const pids = [0, 1].map((k) => Number(new RegExp(`PID ${k} (\\d+)`).exec(nodes[k]!.out)![1]));
    // Cut the link mid-training.
    const t0 = Date.now();
    assert.ok(hosts.cut(0));
    const codes = await Promise.all(nodes.map((n) => n.done));
    const ms = Date.now() - t0;
    assert.notEqual(codes[0], 0, nodes[0]!.out);
    assert.notEqual(codes[1], 0, nodes[1]!.out);
    assert.match(nodes[0]!.out, /flotilla run: failed: node 1 \(rank 1\) lost: no heartbeat for \d+ ms/, nodes[0]!.out);
    assert.match(nodes[1]!.out, /flotilla run: failed: node 0 \(rank 0\) lost: no heartbeat for \d+ ms/, nodes[1]!.out);
    assert.ok(ms < DETECT_BOUND_MS, `the cut took ${ms} ms to end both nodes`);
    assert.deepEqual(await gone(pids), [], 'ranks outlived the job');
  } finally {
    for (const n of nodes) n.child.kill('SIGKILL');
    await Promise.all(nodes.map((n) => n.done));
    hosts.drop();
  }
});
