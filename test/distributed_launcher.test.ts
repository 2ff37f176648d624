// `flotilla run`: argument parsing, the environment it sets, failure handling, restarts, signal
// forwarding, and a two-node job started as two launchers on loopback.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { runLauncher, parseRunArgs } from '../src/cli/run.js';
import { parseTrainArgs } from '../src/cli/train_args.js';
import { UsageError } from '../src/cli/usage.js';
import { freePort, parseAllResults, REPO_ROOT, scriptCommand } from './helpers/world.js';
import { suiteSlots } from './helpers/pool.js';

// Worlds here time out in seconds: no other file's launch runs beside this file (test/helpers/pool.ts).
await suiteSlots.holdAll();

const SCRIPT = 'test/helpers/ranks/launched.ts';

/** Runs the launcher in this process with its output captured, split per rank. */
async function launch(argv: string[], graceMs = 2000): Promise<{ code: number; out: string; err: string; perRank: Map<number, string> }> {
  let out = '', err = '';
  const code = await runLauncher(argv, {
    stdout: { write: (s: string) => (out += s) },
    stderr: { write: (s: string) => (err += s) },
    handleSignals: false,
    graceMs,
  });
  const perRank = new Map<number, string>();
  for (const line of (out + err).split('\n')) {
    const m = /^\[rank (\d+)\] (.*)$/.exec(line);
    if (m) perRank.set(Number(m[1]), `${perRank.get(Number(m[1])) ?? ''}${m[2]}\n`);
  }
  return { code, out, err, perRank };
}

type Vars = Record<string, string | number | boolean | undefined>;
function results(perRank: Map<number, string>, n: number): Vars[][] {
  return parseAllResults<Vars>(Array.from({ length: n }, (_, r) => perRank.get(r) ?? ''));
}

test('parseRunArgs: options, aliases, script arguments, and clear usage errors', () => {
  const o = parseRunArgs(['--nproc', '4', '--nnodes=2', '--node_rank', '1', '--master-addr', 'node0', '--master-port=1234', '--max-restarts', '2', 'train.ts', '--nproc', '9', 'x']);
  assert.deepEqual(o, { nproc: 4, nnodes: 2, nodeRank: 1, masterAddr: 'node0', masterPort: 1234, maxRestarts: 2, backend: 'gloo', script: 'train.ts', scriptArgs: ['--nproc', '9', 'x'] });
  assert.equal(parseRunArgs(['--nproc-per-node', '2', 's.ts']).nproc, 2);
  assert.deepEqual(parseRunArgs(['--nproc', '1', '--', '-weird.ts']).script, '-weird.ts');
  const bad: [string[], RegExp][] = [
    [['s.ts'], /--nproc N is required/],
    [['--nproc', '2'], /no script given/],
    [['--nproc', 'two', 's.ts'], /--nproc "two": expected an integer/],
    [['--nproc', '0', 's.ts'], /--nproc 0: must be at least 1/],
    [['--nproc', '2', '--nnodes', '2', '--node-rank', '2', 's.ts'], /--node-rank 2 must be below --nnodes 2/],
    [['--nproc', '2', '--master-port', '70000', 's.ts'], /--master-port 70000: must be between 1 and 65535/],
    [['--nproc', '2', '--bogus', 's.ts'], /unknown option --bogus/],
    [['--nproc'], /--nproc needs a value/],
    [['--nproc', '2', '--nnodes', 'two', 's.ts'], /--nnodes "two": expected a number of hosts M, or MIN:MAX/],
    [['--nproc', '2', '--nnodes', '3:2', 's.ts'], /--nnodes 3:2: MIN must not exceed MAX/],
    [['--nproc', '2', '--nnodes', '0:2', 's.ts'], /--nnodes 0:2: hosts must be at least 1/],
    [['--nproc', '2', '--nnodes', '3', '--master-addr', 'a,b', 's.ts'], /--master-addr a,b: a list of addresses is for an elastic job, whose node 0 moves when a host is lost; give --nnodes MIN:MAX, or one address/],
    [['--nproc', '2', '--nnodes', '2:3', '--master-addr', 'a,,b', 's.ts'], /--master-addr "a,,b": expected a host name or address, or a list of them \(A,B,C\)/],
  ];
  for (const [argv, re] of bad) assert.throws(() => parseRunArgs(argv), (e: Error) => e instanceof UsageError && re.test(e.message), argv.join(' '));
  assert.equal(parseRunArgs(['--nproc', '1', '--nnodes', '2:3', 's.ts']).minNodes, 2);
  assert.equal(parseRunArgs(['--nproc', '1', '--nnodes', '3:3', 's.ts']).minNodes, undefined, 'MIN = MAX is a fixed job');
  // An elastic job's list of master addresses: node 0 first; the ranks meet at the first.
  const listed = parseRunArgs(['--nproc', '1', '--nnodes', '2:3', '--master-addr', '10.0.0.1,10.0.0.2,10.0.0.3', 's.ts']);
  assert.deepEqual([listed.masterAddr, listed.masterAddrs], ['10.0.0.1', ['10.0.0.1', '10.0.0.2', '10.0.0.3']]);
});

test('flotilla train --nnodes: the grammar of flotilla run, its errors prefixed train:, and the flags that need it', () => {
  const hosts = (extra: string[]) => parseTrainArgs(['c.toml', ...extra]).hosts;
  assert.deepEqual(hosts(['--nnodes', '2:3', '--node-rank', '1', '--master-addr', 'a', '--master-port', '29500']), { nnodes: 3, nodeRank: 1, minNodes: 2, masterAddr: 'a', masterPort: 29500 });
  assert.equal(hosts(['--nnodes', '1']), undefined, 'one host is a local run');
  const bad: [string[], RegExp][] = [
    [['--nnodes', '3:2', '--node-rank', '0'], /^train: --nnodes 3:2: MIN must not exceed MAX/],
    [['--nnodes', 'x'], /^train: --nnodes "x": expected a number of hosts M, or MIN:MAX/],
    [['--nnodes', '2'], /^train: --nnodes 2 needs --node-rank R/],
    [['--nnodes', '2', '--node-rank', '2'], /^train: --node-rank 2 must be below --nnodes 2/],
    [['--node-rank', '1'], /^train: --node-rank goes with --nnodes M/],
  ];
  for (const [argv, re] of bad) assert.throws(() => hosts(argv), (e: Error) => e instanceof UsageError && re.test(e.message), argv.join(' '));
});

test('usage errors print the usage and return 2', async () => {
  const r = await launch(['--nproc', 'x', SCRIPT]);
  assert.equal(r.code, 2);
  assert.match(r.err, /flotilla run: --nproc "x": expected an integer[\s\S]*usage: flotilla run --nproc N/);
  const h = await launch(['--help']);
  assert.equal(h.code, 0);
  assert.match(h.out, /usage: flotilla run/);
});

test('two ranks: the environment contract, prefixed output, exit 0', async () => {
  const r = await launch(['--nproc', '2', SCRIPT, 'ok']);
  assert.equal(r.code, 0, r.err);
  const res = results(r.perRank, 2).map((x) => x[0]!);
  res.forEach((v, rank) => {
    assert.deepEqual(
      { ...v, MASTER_PORT: undefined },
      { RANK: String(rank), WORLD_SIZE: '2', LOCAL_RANK: String(rank), LOCAL_WORLD_SIZE: '2', GROUP_RANK: '0', MASTER_ADDR: '127.0.0.1', MASTER_PORT: undefined, FLOTILLA_RESTART_COUNT: '0', sum: 1 },
    );
  });
  assert.equal(res[0]!.MASTER_PORT, res[1]!.MASTER_PORT);
  assert.match(r.out, /^\[rank 0\] rank 0 of 2: sum 1$/m);
});

test('a rank exiting 3 stops the others; the launcher returns 3 naming the rank', async () => {
  const r = await launch(['--nproc', '3', SCRIPT, 'fail', '1', '3']);
  assert.equal(r.code, 3);
  assert.match(r.err, /flotilla run: rank 1 exited with code 3; stopping the other 2 ranks/);
  assert.match(r.err, /flotilla run: failed: rank 1 exited with code 3/);
  assert.match(r.err, /^\[rank 1\] rank 1 failing on purpose$/m);
});

test('a rank killed by a signal: the launcher names the signal and returns 128 + its number', async () => {
  const r = await launch(['--nproc', '2', SCRIPT, 'selfkill', '0']);
  assert.equal(r.code, 128 + 9);
  assert.match(r.err, /flotilla run: rank 0 was killed by SIGKILL; stopping the other 1 rank/);
});

/** Runs the launcher as its own process (as `flotilla run` would be) and signals it once all ranks are ready. */
async function launchAndSignal(argv: string[], signal: NodeJS.Signals, env: Record<string, string> = {}): Promise<{ code: number | null; out: string; err: string }> {
  const [cmd, args] = scriptCommand('test/helpers/launch_cli.ts', argv);
  const child = spawn(cmd, args, { cwd: REPO_ROOT, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '', err = '', signalled = false;
  const nproc = Number(argv[argv.indexOf('--nproc') + 1]);
  child.stdout.on('data', (b: Buffer) => {
    out += b.toString();
    if (!signalled && (out.match(/^\[rank \d+\] ready$/gm) ?? []).length === nproc) {
      signalled = true;
      child.kill(signal);
    }
  });
  child.stderr.on('data', (b: Buffer) => (err += b.toString()));
  const timer = setTimeout(() => child.kill('SIGKILL'), 40_000);
  const code = await new Promise<number | null>((res) => child.on('close', (c) => res(c)));
  clearTimeout(timer);
  return { code, out, err };
}

test('SIGINT to the launcher is forwarded to every rank; ranks that stop cleanly make it return 0, otherwise 130', async () => {
  // flotilla train answers Ctrl-C by saving a checkpoint and exiting 0: the run succeeded.
  const clean = await launchAndSignal(['--nproc', '2', SCRIPT, 'wait'], 'SIGINT');
  assert.equal(clean.code, 0, clean.out + clean.err);
  assert.match(clean.err, /received SIGINT; forwarding it to the ranks/);
  for (const rank of [0, 1]) assert.match(clean.out, new RegExp(`^\\[rank ${rank}\\] FLOTILLA_RESULT .*"signal":"SIGINT"`, 'm'));
  const r = await launchAndSignal(['--nproc', '2', SCRIPT, 'wait'], 'SIGINT', { EXIT_ON_SIGNAL: '130' });
  assert.equal(r.code, 130, r.out + r.err);
  for (const rank of [0, 1]) assert.match(r.out, new RegExp(`^\\[rank ${rank}\\] FLOTILLA_RESULT .*"signal":"SIGINT"`, 'm'));
});

test('ranks that ignore SIGTERM are killed after the grace period; the launcher returns 143', async () => {
  const r = await launchAndSignal(['--nproc', '2', SCRIPT, 'stubborn'], 'SIGTERM', { FLOTILLA_KILL_GRACE_MS: '500' });
  assert.equal(r.code, 143, r.out + r.err);
  assert.match(r.out, /ignoring SIGTERM/);
  assert.match(r.err, /still running after 500 ms; killing/);
});

test('--max-restarts restarts the whole group on a fresh port', async () => {
  const r = await launch(['--nproc', '2', '--max-restarts', '2', SCRIPT, 'fail-once']);
  assert.equal(r.code, 0, r.err);
  assert.match(r.err, /rank 1 exited with code 3; restarting all 2 local ranks \(restart 1 of 2\)/);
  const res = results(r.perRank, 2);
  const first = res[1]![0]!, second = res[1]![1]!;
  assert.equal(first.failed, true);
  assert.equal(first.FLOTILLA_RESTART_COUNT, '0');
  assert.equal(second.FLOTILLA_RESTART_COUNT, '1');
  assert.equal(second.sum, 1);
  assert.notEqual(first.MASTER_PORT, second.MASTER_PORT);
  assert.equal(res[0]![0]!.FLOTILLA_RESTART_COUNT, '1', 'rank 0 reports only from the successful attempt');
});

test('restarts run out: the last failure is reported', async () => {
  const r = await launch(['--nproc', '2', '--max-restarts', '1', SCRIPT, 'fail', '0', '5']);
  assert.equal(r.code, 5);
  assert.match(r.err, /restart 1 of 1/);
  assert.match(r.err, /failed: rank 0 exited with code 5 \(after 1 restart\)/);
});

test('two nodes on loopback: two launchers with --nnodes 2 form one world of 4', async () => {
  const port = await freePort();
  const common = ['--nproc', '2', '--nnodes', '2', '--master-addr', '127.0.0.1', '--master-port', String(port)];
  const [a, b] = await Promise.all([
    launch([...common, '--node-rank', '0', SCRIPT, 'ok']),
    launch([...common, '--node-rank', '1', SCRIPT, 'ok']),
  ]);
  assert.equal(a.code, 0, a.err);
  assert.equal(b.code, 0, b.err);
  assert.deepEqual([...a.perRank.keys()].sort(), [0, 1]);
  assert.deepEqual([...b.perRank.keys()].sort(), [2, 3]);
  const all = new Map([...a.perRank, ...b.perRank]);
  const res = results(all, 4).map((x) => x[0]!);
  res.forEach((v, rank) => {
    assert.equal(v.RANK, String(rank));
    assert.equal(v.WORLD_SIZE, '4');
    assert.equal(v.LOCAL_RANK, String(rank % 2));
    assert.equal(v.GROUP_RANK, String(Math.floor(rank / 2)));
    assert.equal(v.MASTER_PORT, String(port));
    assert.equal(v.sum, 0 + 1 + 2 + 3);
  });
});
