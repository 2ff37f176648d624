// Runtime hardening: what a run exposes on the network, who may use its rendezvous store, and that the
// launcher and teardown leave nothing behind and blame the right rank.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, readlinkSync, rmSync, writeFileSync } from 'node:fs';
import { connect, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { runWorld, parseResults, describeWorld, scriptCommand, isAlive, assertMpiBuilt, REPO_ROOT } from './helpers/world.js';
import { frame, storeProof, Op, Status } from '../src/distributed/store_server.js';
import { loopbackNamespace } from '../src/launch/mpirun.js';
import { sideBySide, suiteSlots } from './helpers/pool.js';
import { procStatusBytes } from '../src/io/proc_status.js';
import { runnableScript } from './helpers/compiled.js';

// Worlds here time out in seconds: no other file's launch runs beside this file (test/helpers/pool.ts).
await suiteSlots.holdAll();

const RANK_SCRIPT = 'test/helpers/ranks/hardening.ts';
/** The rank script `flotilla run` starts: compiled while dist/ is current (test/helpers/compiled.ts). */
const RUN_SCRIPT = runnableScript(join(REPO_ROOT, RANK_SCRIPT));
const FLOTILLA = join(REPO_ROOT, 'bin', 'flotilla.js');


/** Waits until `pattern` has matched `count` times in the process's stdout+stderr. */
function waitForOutput(child: ChildProcess, pattern: RegExp, count: number, what: string): Promise<RegExpMatchArray[]> {
  return new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => reject(new Error(`${what} did not happen within 60 s; output:\n${out}`)), 60_000);
    const on = (d: Buffer): void => {
      out += d;
      const found = [...out.matchAll(new RegExp(pattern, 'g'))];
      if (found.length >= count) {
        clearTimeout(timer);
        resolve(found);
      }
    };
    child.stdout?.on('data', on);
    child.stderr?.on('data', on);
  });
}

/** TCP sockets of a process, any state: local address, port, listening? (from /proc/net/tcp{,6}, what ss reads). */
function tcpSockets(pid: number): { addr: string; port: number; listening: boolean }[] {
  const inodes = new Set<string>();
  for (const fd of readdirSync(`/proc/${pid}/fd`)) {
    try {
      const m = /^socket:\[(\d+)\]$/.exec(readlinkSync(`/proc/${pid}/fd/${fd}`));
      if (m) inodes.add(m[1]!);
    } catch {
      // gone meanwhile
    }
  }
  const out: { addr: string; port: number; listening: boolean }[] = [];
  for (const [file, v6] of [['/proc/net/tcp', false], ['/proc/net/tcp6', true]] as const) {
    for (const line of readFileSync(file, 'utf8').split('\n').slice(1)) {
      const c = line.trim().split(/\s+/);
      if (!inodes.has(c[9]!)) continue;
      const [hex, port] = c[1]!.split(':') as [string, string];
      out.push({ addr: v6 ? hex : hex.match(/../g)!.reverse().map((b) => parseInt(b, 16)).join('.'), port: parseInt(port, 16), listening: c[3] === '0A' });
    }
  }
  return out;
}

function isLoopbackHex(addr: string): boolean {
  // IPv4 dotted 127.x, or IPv6 ::1 (in /proc's byte order) or ::ffff:127.x.x.x
  if (/^127\./.test(addr) || addr === '00000000000000000000000001000000') return true;
  return addr.toUpperCase().startsWith('0000000000000000FFFF0000') && addr.slice(30, 32).toUpperCase() === '7F';
}

test('a single-host `flotilla run` exposes nothing beyond loopback: no store listener, Gloo on 127.0.0.1', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-test-'));
  const go = join(dir, 'go');
  const launcher = spawn(process.execPath, [FLOTILLA, 'run', '--nproc', '2', RUN_SCRIPT, 'listen', go], { stdio: ['ignore', 'pipe', 'pipe'] });
  try {
    const pids = (await waitForOutput(launcher, /PID \d+ (\d+)/, 2, 'both ranks joining')).map((m) => Number(m[1]));
    const socks = pids.map((p) => tcpSockets(p));
    assert.ok(socks.every((s) => s.length > 0), `a rank has no TCP socket at all (its Gloo pairs are TCP): the inspection is broken: ${JSON.stringify(socks)}`);
    const exposed = socks.flat().filter((s) => !isLoopbackHex(s.addr));
    assert.deepEqual(exposed, [], `ranks have sockets beyond loopback: ${JSON.stringify(socks)}`);
    assert.deepEqual(socks.flat().filter((s) => s.listening), [], `ranks still listen after rendezvous: ${JSON.stringify(socks)}`);
  } finally {
    writeFileSync(go, '');
    const code = await new Promise((r) => launcher.on('close', r));
    rmSync(dir, { recursive: true, force: true });
    assert.equal(code, 0);
  }
});

/**
 * Listening TCP sockets of a process as its own network namespace sees them, and that namespace's
 * interfaces (from /proc/<pid>/net: a process in a namespace of its own has its own tables).
 */
function listenersInOwnNamespace(pid: number): { listening: { addr: string; port: number }[]; interfaces: string[]; ownNamespace: boolean } {
  const inodes = new Set<string>();
  for (const fd of readdirSync(`/proc/${pid}/fd`)) {
    try {
      const m = /^socket:\[(\d+)\]$/.exec(readlinkSync(`/proc/${pid}/fd/${fd}`));
      if (m) inodes.add(m[1]!);
    } catch {
      // gone meanwhile
    }
  }
  const listening: { addr: string; port: number }[] = [];
  for (const [file, v6] of [[`/proc/${pid}/net/tcp`, false], [`/proc/${pid}/net/tcp6`, true]] as const) {
    for (const line of readFileSync(file, 'utf8').split('\n').slice(1)) {
      const c = line.trim().split(/\s+/);
      if (!inodes.has(c[9]!) || c[3] !== '0A') continue;
      const [hex, port] = c[1]!.split(':') as [string, string];
      listening.push({ addr: v6 ? hex : hex.match(/../g)!.reverse().map((b) => parseInt(b, 16)).join('.'), port: parseInt(port, 16) });
    }
  }
  const interfaces = readFileSync(`/proc/${pid}/net/dev`, 'utf8').split('\n').slice(2).map((l) => l.split(':')[0]!.trim()).filter((n) => n !== '');
  return { listening, interfaces, ownNamespace: readlinkSync(`/proc/${pid}/ns/net`) !== readlinkSync('/proc/self/ns/net') };
}

/** The nearest ancestor of pid whose command name is `name`. */
function ancestorNamed(pid: number, name: string): number | undefined {
  for (let p = pid, i = 0; p > 1 && i < 10; i++) {
    const stat = readFileSync(`/proc/${p}/stat`, 'utf8');
    if (stat.slice(stat.indexOf('(') + 1, stat.lastIndexOf(')')) === name) return p;
    p = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
  }
  return undefined;
}

test('a single-host `flotilla run --backend mpi` is reachable on loopback only: ranks and mpirun', async (t) => {
  assertMpiBuilt();
  const ns = loopbackNamespace();
  if (typeof ns === 'string') t.diagnostic(`mpirun's own listener is not checked: no network namespace here (${ns}); the ranks still are`);
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-test-'));
  const go = join(dir, 'go');
  const launcher = spawn(process.execPath, [FLOTILLA, 'run', '--backend', 'mpi', '--nproc', '2', RUN_SCRIPT, 'listen', go], { stdio: ['ignore', 'pipe', 'pipe'] });
  let err = '';
  launcher.stderr!.on('data', (d) => (err += d));
  try {
    const pids = (await waitForOutput(launcher, /PID \d+ (\d+)/, 2, 'both ranks joining')).map((m) => Number(m[1]));
    const mpirun = ancestorNamed(pids[0]!, 'mpirun');
    assert.ok(mpirun !== undefined, 'mpirun is an ancestor of the ranks');
    const checked = typeof ns === 'string' ? [['rank 0', pids[0]!], ['rank 1', pids[1]!]] as const : [['rank 0', pids[0]!], ['rank 1', pids[1]!], ['mpirun', mpirun]] as const;
    for (const [what, pid] of checked) {
      const v = listenersInOwnNamespace(pid);
      const exposed = v.listening.filter((l) => !isLoopbackHex(l.addr));
      // Reachable from elsewhere only through a listener on a non-loopback address, or on a wildcard
      // address in a namespace that has an interface besides lo.
      const reachable = v.ownNamespace && v.interfaces.every((n) => n === 'lo') ? [] : exposed;
      assert.deepEqual(reachable, [], `${what} (pid ${pid}) listens beyond loopback: ${JSON.stringify(v)}`);
    }
  } finally {
    writeFileSync(go, '');
    const code = await new Promise((r) => launcher.on('close', r));
    rmSync(dir, { recursive: true, force: true });
    assert.equal(code, 0, err);
  }
});

/** A raw connection to the store: frames as in [Note: store wire format]. */
class RawClient {
  private buf = Buffer.alloc(0);
  private waiters: (() => void)[] = [];
  closed = false;
  constructor(readonly sock: Socket) {
    sock.on('data', (d) => {
      this.buf = Buffer.concat([this.buf, d]);
      this.waiters.splice(0).forEach((w) => w());
    });
    sock.on('close', () => {
      this.closed = true;
      this.waiters.splice(0).forEach((w) => w());
    });
    sock.on('error', () => undefined);
  }
  static open(port: number): Promise<RawClient> {
    return new Promise((resolve, reject) => {
      const s = connect(port, '127.0.0.1', () => resolve(new RawClient(s)));
      s.once('error', reject);
    });
  }
  /** The next reply frame, or undefined once the server closed the connection without one. */
  async reply(): Promise<{ status: number; fields: Buffer[] } | undefined> {
    for (;;) {
      if (this.buf.length >= 4 && this.buf.length >= 4 + this.buf.readUInt32LE(0)) {
        const n = this.buf.readUInt32LE(0);
        const body = this.buf.subarray(4, 4 + n);
        this.buf = this.buf.subarray(4 + n);
        const fields: Buffer[] = [];
        for (let at = 1; at < body.length;) {
          const len = body.readUInt32LE(at);
          fields.push(body.subarray(at + 4, at + 4 + len));
          at += 4 + len;
        }
        return { status: body[0]!, fields };
      }
      if (this.closed) return undefined;
      await new Promise<void>((r) => this.waiters.push(r));
    }
  }
  send(op: number, fields: Buffer[]): void {
    this.sock.write(frame(op, fields));
  }
  close(): void {
    this.sock.destroy();
  }
}

function rssBytes(pid: number): number {
  return procStatusBytes(pid)!.VmRSS!;
}

test('the store admits only holders of the job secret: a foreign client cannot join or read, and its oversized request allocates nothing', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-test-'));
  const go = join(dir, 'go');
  const secret = 'test-secret-0123456789abcdef';
  let serverPid = 0;
  let port = 0;
  const world = runWorld({
    nproc: 2, script: RANK_SCRIPT, args: ['serve', go], store: 'socket', env: { FLOTILLA_JOB_SECRET: secret, TEST_TIMEOUT_MS: '20000' },
    onSpawn: (rank, child) => {
      if (rank !== 0) return;
      child.stdout!.on('data', (d: Buffer) => {
        const m = /READY (\d+)/.exec(d.toString());
        if (m) serverPid = Number(m[1]);
      });
    },
  });
  try {
    while (serverPid === 0) await new Promise((r) => setTimeout(r, 50));
    port = Number(/MASTER_PORT=(\d+)/.exec(readFileSync(`/proc/${serverPid}/environ`, 'utf8').replace(/\0/g, '\n'))![1]);
    const rssBefore = rssBytes(serverPid);

    // 1. Reading a key without authenticating: refused, nothing returned.
    let c = await RawClient.open(port);
    const hello = await c.reply();
    assert.equal(hello?.fields[0]?.length, 32, 'the store greets with a 32-byte nonce');
    c.send(Op.get, [Buffer.from('join/rank/0'), Buffer.from('0')]);
    let r = await c.reply();
    assert.equal(r?.status, Status.refused, 'a GET before authenticating must be refused');
    assert.equal(await c.reply(), undefined, 'the connection must be closed after the refusal');

    // 2. A wrong proof: refused.
    c = await RawClient.open(port);
    const nonce = (await c.reply())!.fields[0]!;
    c.send(Op.auth, [storeProof('not-the-secret', nonce)]);
    r = await c.reply();
    assert.equal(r?.status, Status.refused);
    assert.match(r!.fields[0]!.toString(), /not a member of this job/);

    // 3. A 9-byte request declaring a 1 GiB key, and one declaring 3 GiB after the prefix: refused unread.
    for (const declared of [0x40000000, 0xc0000000]) {
      c = await RawClient.open(port);
      await c.reply();
      const req = Buffer.alloc(9);
      req.writeUInt32LE(declared, 0);
      req[4] = Op.set;
      req.writeUInt32LE(declared - 5, 5);
      c.sock.write(req);
      r = await c.reply();
      assert.equal(r?.status, Status.refused);
      assert.match(r!.fields[0]!.toString(), /above the limit/);
    }

    // 4. A rank process with another secret cannot join: refused, naming the fix.
    const intruder = await new Promise<{ code: number | null; out: string }>((resolve) => {
      const [cmd, argv] = scriptCommand(join(REPO_ROOT, RANK_SCRIPT), ['join']);
      const child = spawn(cmd, argv, {
        cwd: REPO_ROOT,
        env: { ...process.env, RANK: '1', WORLD_SIZE: '2', MASTER_ADDR: '127.0.0.1', MASTER_PORT: String(port), FLOTILLA_JOB_SECRET: 'another-secret-0123456789' },
      });
      let out = '';
      child.stdout.on('data', (d) => (out += d));
      child.stderr.on('data', (d) => (out += d));
      child.on('close', (code) => resolve({ code, out }));
    });
    assert.notEqual(intruder.code, 0);
    assert.match(intruder.out, /refused this rank: not a member of this job .*give every rank the same FLOTILLA_JOB_SECRET/);

    // 5. A half-sent message that stays open while the job uses the store again (newGroup below).
    const half = await RawClient.open(port);
    await half.reply();
    half.sock.write(Buffer.from([0x30, 0, 0]));

    // Control: with the secret, the same client code can read a key (the probes above were real).
    c = await RawClient.open(port);
    c.send(Op.auth, [storeProof(secret, (await c.reply())!.fields[0]!)]);
    assert.equal((await c.reply())?.status, Status.ok);
    c.send(Op.get, [Buffer.from('join/rank/0'), Buffer.from('1000')]);
    r = await c.reply();
    assert.equal(r?.status, Status.ok);
    assert.equal(r!.fields[0]!.toString(), '1');
    c.close();

    const grown = rssBytes(serverPid) - rssBefore;
    assert.ok(grown < 64 * 1024 * 1024, `rank 0 grew by ${(grown / 2 ** 20).toFixed(1)} MiB while refusing the requests`);
    writeFileSync(go, '');
    const res = await world;
    half.close();
    assert.deepEqual(res.codes, [0, 0], describeWorld(res));
    const out = parseResults<{ rank: number; sum: number; groupSum: number }>(res.outputs);
    for (const o of out) {
      assert.equal(o.sum, 3);
      assert.equal(o.groupSum, 30, 'the job kept using its store while a foreign connection sat half-sent');
    }
  } finally {
    writeFileSync(go, '');
    await world.catch(() => undefined);
    rmSync(dir, { recursive: true, force: true });
  }
});

test('a non-loopback MASTER_ADDR without a job secret is refused with the fix', async () => {
  const res = await runWorld({ nproc: 1, script: RANK_SCRIPT, args: ['join'], store: 'socket', env: { WORLD_SIZE: '2', MASTER_ADDR: '10.255.255.1', FLOTILLA_JOB_SECRET: undefined } });
  assert.notEqual(res.codes[0], 0);
  assert.match(res.outputs[0]!, /set FLOTILLA_JOB_SECRET/);
});

test('an unresolvable MASTER_ADDR fails at once, naming the host (rank 0 and the others)', async () => {
  const host = 'no-such-host.invalid';
  const res = await runWorld({
    nproc: 2, script: RANK_SCRIPT, args: ['join'], timeoutMs: 60_000, store: 'socket',
    env: { MASTER_ADDR: host, FLOTILLA_JOB_SECRET: 'a-secret-of-some-length', FLOTILLA_TIMEOUT_MS: undefined, TEST_TIMEOUT_MS: '300000' },
  });
  for (const r of [0, 1]) {
    assert.notEqual(res.codes[r], 0, describeWorld(res));
    assert.match(res.outputs[r]!, new RegExp(`MASTER_ADDR=${host.replace(/\./g, '\\.')} cannot be resolved`), describeWorld(res));
  }
});

// Side by side: both wait out a short timeout (the rendezvous', the collective's), idle.
sideBySide('rendezvous and collective timeouts name the culprit: a duplicate RANK, a stalled rank', [
  ['a duplicate RANK is detected at rendezvous and named', async () => {
    const res = await runWorld({
      nproc: 3, script: RANK_SCRIPT, args: ['join'], store: 'socket', env: { TEST_TIMEOUT_MS: '4000' },
      rankEnv: (r) => ({ RANK: String(Math.min(r, 1)), LOCAL_RANK: String(Math.min(r, 1)) }),
    });
    assert.ok(res.codes.every((c) => c !== 0), describeWorld(res));
    const all = res.outputs.join('\n');
    assert.match(all, /RANK=1 was given to two processes of this job/, describeWorld(res));
    assert.match(res.outputs[0]!, /RANK 1 was given to two processes; rank 2 never joined/, describeWorld(res));
  }],
  ['a stalled rank: the launcher names it, not a rank that timed out waiting for it', async () => {
    const launcher = spawn(process.execPath, [FLOTILLA, 'run', '--nproc', '3', RUN_SCRIPT, 'stall', '1'], {
      stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, TEST_TIMEOUT_MS: '3000' },
    });
    let err = '';
    launcher.stderr!.on('data', (d) => (err += d));
    const code = await new Promise((r) => launcher.on('close', r));
    assert.notEqual(code, 0);
    const last = err.trim().split('\n').pop()!;
    assert.match(last, /^flotilla run: failed: rank 1 stalled: ranks 0, 2 timed out waiting in a collective/, err);
  }],
]);

test('ranks end when the launcher dies before they join a process group', async () => {
  const launcher = spawn(process.execPath, [FLOTILLA, 'run', '--nproc', '2', RUN_SCRIPT, 'prejoin'], { stdio: ['ignore', 'pipe', 'pipe'] });
  const pids = (await waitForOutput(launcher, /PID \d+ (\d+)/, 2, 'both ranks starting')).map((m) => Number(m[1]));
  launcher.kill('SIGKILL');
  for (let i = 0; i < 100 && pids.some(isAlive); i++) await new Promise((r) => setTimeout(r, 100));
  const left = pids.filter(isAlive);
  for (const p of left) process.kill(p, 'SIGKILL');
  assert.deepEqual(left, [], 'ranks outlived their launcher');
});

test('killing a wrapper around the launcher (as npx is) stops the launcher and its ranks', async () => {
  // `sh -c 'cmd; exit'` keeps the shell as the launcher's parent, like npm exec's shell.
  const cmd = `${JSON.stringify(process.execPath)} ${JSON.stringify(FLOTILLA)} run --nproc 2 ${JSON.stringify(RUN_SCRIPT)} prejoin; exit $?`;
  const wrapper = spawn('sh', ['-c', cmd], { stdio: ['ignore', 'pipe', 'pipe'] });
  const pids = (await waitForOutput(wrapper, /PID \d+ (\d+)/, 2, 'both ranks starting')).map((m) => Number(m[1]));
  const launcherPid = Number(readFileSync(`/proc/${pids[0]}/stat`, 'utf8').split(') ')[1]!.split(' ')[1]);
  assert.ok(isAlive(launcherPid));
  wrapper.kill('SIGKILL');
  const procs = [launcherPid, ...pids];
  for (let i = 0; i < 150 && procs.some(isAlive); i++) await new Promise((r) => setTimeout(r, 100));
  const left = procs.filter(isAlive);
  for (const p of left) process.kill(p, 'SIGKILL');
  assert.deepEqual(left, [], 'the launcher or its ranks outlived the wrapper');
});
