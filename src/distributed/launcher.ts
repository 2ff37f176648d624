// `flotilla run`: start N ranks of a script on this host with the launch contract set (env.ts).
//
//   flotilla run --nproc N [--nnodes M --node-rank R --master-addr A --master-port P]
//                [--max-restarts K] script.ts [script args...]
//
// Every rank gets RANK = node_rank * N + local_rank, WORLD_SIZE = M * N, LOCAL_RANK,
// LOCAL_WORLD_SIZE = N, GROUP_RANK = node_rank, MASTER_ADDR, MASTER_PORT, and
// FLOTILLA_RESTART_COUNT / FLOTILLA_MAX_RESTARTS. .ts scripts run under tsx, .js under node, and
// anything else is executed as it is (so `flotilla run --nproc 2 python3 peer.py` works too).
// Each output line is prefixed with `[rank k]`. SIGINT/SIGTERM are forwarded to the ranks (a second
// one kills them). When a rank exits non-zero or is killed, the others are stopped (SIGTERM, then
// SIGKILL after a grace period) and the launcher reports the rank and its exit code or signal.
//
// Rendezvous: on one node every rank meets through a FileStore in a fresh directory only this user
// can enter (FLOTILLA_STORE_FILE, a new file per attempt; the directory is removed when the launcher
// ends), and Gloo binds to loopback: the job listens on no interface but loopback. With several
// nodes, rank 0 serves flotilla's store on --master-addr only, and every rank must prove it knows
// FLOTILLA_JOB_SECRET, which the launcher passes on from its own environment (set the same value on
// every node; it is required unless --master-addr is a loopback address). See src/distributed/store.ts.
//
// Ranks end with their launcher: each is started under `setpriv --pdeathsig TERM` where setpriv
// exists (so even a rank that never reaches initProcessGroup gets SIGTERM when the launcher dies),
// and the launcher ends its ranks when its own parent goes away (e.g. a killed `npx flotilla` wrapper).
//
// Stalls: a rank whose collective times out tells the launcher so on an extra pipe (fd 3,
// FLOTILLA_STATUS_FD; see launcher_channel.ts). When the failures are all such timeouts, the launcher
// waits a moment for the others to time out too and names the rank(s) still running that never timed
// out (the one everybody waited for), not the first rank that gave up.
//
// Liveness (heartbeat.ts): the launchers of a multi-node job keep a heartbeat, so a lost node (its
// host or link gone, its launcher killed) is found within 30 s (FLOTILLA_HEARTBEAT_TIMEOUT_MS), and
// a node whose ranks fail tells the others at once: every launcher then stops its ranks and exits
// non-zero naming the node and its ranks. On every node, a rank that stays stopped (SIGSTOP, a
// debugger) for that long is treated as hung and ends the job like a rank that failed.
//
// --backend mpi: the ranks start through Open MPI's mpirun instead (src/distributed/mpi_launch.ts),
// which sets OMPI_COMM_WORLD_* in place of RANK/WORLD_SIZE; output prefixes, signal forwarding,
// stopping the others when one fails, restarts and exit codes are the same. One node only.
//
// Ports: on one node without --master-port each attempt picks a free port (so a restarted group
// never meets a store left over from the one it replaces). With --master-port on one node every
// attempt reuses it (the old ranks are all gone by then). With several nodes, which cannot agree on a
// free port, attempt k uses --master-port + k (default 29500 + k) on every node; each node's launcher
// restarts its ranks when they fail, and a failure on one node makes the ranks on the others fail
// within the process-group timeout, so all nodes restart together.
import { spawn, type ChildProcess } from 'node:child_process';
import { accessSync, constants as fsConstants, mkdtempSync, rmSync } from 'node:fs';
import { constants as osConstants, tmpdir } from 'node:os';
import { createServer } from 'node:net';
import { delimiter, join } from 'node:path';
import { createInterface } from 'node:readline';
import type { Readable } from 'node:stream';
import { DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, checkFlotillaEnv, isLoopback } from './env.js';
import { runMpiGroup, mpiInstalled, MPI_INSTALL_HINT } from './mpi_launch.js';
import { heartbeatConfig, NodeLink, watchStopped, type HeartbeatConfig } from './heartbeat.js';

export const RUN_USAGE = `usage: flotilla run --nproc N [options] script.ts [script args...]

Starts N ranks of the script on this host with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, prefixes their output with [rank k], and stops them all when one fails.

options:
  --nproc N            ranks on this node (alias --nproc-per-node)
  --nnodes M           nodes in the job (default 1)
  --node-rank R        this node's index, 0..M-1 (default 0)
  --master-addr A      address of the node that runs global rank 0 (default ${DEFAULT_MASTER_ADDR})
  --master-port P      rendezvous port there (default: a free port on one node, ${DEFAULT_MASTER_PORT} on several)
  --max-restarts K     restart the whole group up to K times after a failure (default 0)
  --backend B          gloo (default), mpi (ranks start through Open MPI's mpirun; one node), or
                       auto (mpi when Open MPI is installed, else gloo)
  -h, --help           show this help`;

export interface RunOptions {
  nproc: number;
  nnodes: number;
  nodeRank: number;
  masterAddr: string;
  /** Undefined: pick a free port (one node) or use the default (several). */
  masterPort: number | undefined;
  maxRestarts: number;
  /** 'mpi': the ranks start through mpirun (src/distributed/mpi_launch.ts) and use the MPI backend. */
  backend: 'gloo' | 'mpi';
  script: string;
  scriptArgs: string[];
}

/** A malformed `flotilla run` command line; the message says what to fix. */
export class RunUsageError extends Error {
  constructor(message: string, readonly help = false) {
    super(message);
    this.name = 'RunUsageError';
  }
}

const OPTIONS: Record<string, keyof RunOptions> = {
  'nproc': 'nproc', 'nproc-per-node': 'nproc', 'nnodes': 'nnodes', 'node-rank': 'nodeRank',
  'master-addr': 'masterAddr', 'master-port': 'masterPort', 'max-restarts': 'maxRestarts', 'backend': 'backend',
};

function parseInt(flag: string, raw: string, min: number, max = Number.MAX_SAFE_INTEGER): number {
  if (!/^\d+$/.test(raw.trim())) throw new RunUsageError(`--${flag} ${JSON.stringify(raw)}: expected an integer`);
  const v = Number(raw);
  if (v < min || v > max) throw new RunUsageError(`--${flag} ${v}: must be ${max === Number.MAX_SAFE_INTEGER ? `at least ${min}` : `between ${min} and ${max}`}`);
  return v;
}

/**
 * Parses the arguments after `flotilla run`. Options come before the script; everything after the
 * script goes to it unchanged. Accepts --opt value, --opt=value, and torchrun's underscore spellings.
 */
export function parseRunArgs(argv: readonly string[]): RunOptions {
  const raw: Partial<Record<keyof RunOptions, string>> = {};
  let i = 0;
  for (; i < argv.length; i++) {
    const a = argv[i]!;
    if (a === '-h' || a === '--help') throw new RunUsageError('', true);
    if (a === '--') {
      i++;
      break;
    }
    if (!a.startsWith('-')) break;
    const eq = a.indexOf('=');
    const flag = (eq >= 0 ? a.slice(2, eq) : a.slice(2)).replace(/_/g, '-');
    const key = OPTIONS[flag];
    if (!a.startsWith('--') || key === undefined) {
      throw new RunUsageError(`unknown option ${a} (options: ${Object.keys(OPTIONS).map((o) => `--${o}`).join(', ')}; the script and its arguments come last)`);
    }
    let value: string | undefined;
    if (eq >= 0) value = a.slice(eq + 1);
    else {
      value = argv[++i];
      if (value === undefined) throw new RunUsageError(`--${flag} needs a value`);
    }
    raw[key] = value;
  }
  const script = argv[i];
  if (script === undefined) throw new RunUsageError('no script given: flotilla run --nproc N script.ts [args...]');
  if (raw.nproc === undefined) throw new RunUsageError('--nproc N is required (ranks to start on this node)');
  const nproc = parseInt('nproc', raw.nproc, 1);
  const nnodes = raw.nnodes === undefined ? 1 : parseInt('nnodes', raw.nnodes, 1);
  const nodeRank = raw.nodeRank === undefined ? 0 : parseInt('node-rank', raw.nodeRank, 0);
  if (nodeRank >= nnodes) throw new RunUsageError(`--node-rank ${nodeRank} must be below --nnodes ${nnodes}`);
  const masterAddr = raw.masterAddr ?? DEFAULT_MASTER_ADDR;
  if (masterAddr.trim() === '' || /\s/.test(masterAddr)) throw new RunUsageError(`--master-addr ${JSON.stringify(masterAddr)}: expected a host name or address`);
  const maxRestarts = raw.maxRestarts === undefined ? 0 : parseInt('max-restarts', raw.maxRestarts, 0);
  const masterPort = raw.masterPort === undefined ? undefined : parseInt('master-port', raw.masterPort, 1, 65535);
  if (masterPort !== undefined && nnodes > 1 && masterPort + maxRestarts > 65535) {
    throw new RunUsageError(`--master-port ${masterPort} + --max-restarts ${maxRestarts} exceeds 65535 (attempt k uses port P + k on several nodes)`);
  }
  const backend = parseBackend(raw.backend, nnodes);
  return { nproc, nnodes, nodeRank, masterAddr, masterPort, maxRestarts, backend, script, scriptArgs: argv.slice(i + 1) };
}

function parseBackend(raw: string | undefined, nnodes: number): 'gloo' | 'mpi' {
  const b = raw ?? 'gloo';
  if (b !== 'gloo' && b !== 'mpi' && b !== 'auto') throw new RunUsageError(`--backend ${JSON.stringify(b)}: expected gloo, mpi or auto`);
  if (b === 'gloo' || (b === 'auto' && (nnodes > 1 || !mpiInstalled()))) return 'gloo';
  if (nnodes > 1) throw new RunUsageError('--backend mpi starts ranks on one node; across hosts run mpirun with a hostfile yourself (each rank picks MPI under mpirun), or use --backend gloo');
  if (!mpiInstalled()) throw new RunUsageError(`--backend mpi: Open MPI is not available here (${MPI_INSTALL_HINT})`);
  return 'mpi';
}

/** A TCP port that was free on `host` a moment ago. */
export function freePort(host = '127.0.0.1'): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.unref();
    srv.on('error', reject);
    srv.listen(0, host, () => {
      const addr = srv.address();
      const port = typeof addr === 'object' && addr ? addr.port : 0;
      srv.close(() => resolve(port));
    });
  });
}

/** How to run a script: .ts under tsx, .js under node, anything else as an executable. */
export function commandFor(script: string, args: readonly string[]): [string, string[]] {
  if (/\.[mc]?ts$/.test(script)) return [process.execPath, ['--import', import.meta.resolve('tsx'), script, ...args]];
  if (/\.[mc]?js$/.test(script)) return [process.execPath, [script, ...args]];
  return [script, [...args]];
}

export interface LauncherIO {
  /** Where rank stdout lines go (default process.stdout). */
  stdout?: { write(s: string): unknown };
  /** Where rank stderr lines and the launcher's own messages go (default process.stderr). */
  stderr?: { write(s: string): unknown };
  /** Forward SIGINT/SIGTERM received by this process to the ranks (default true). */
  handleSignals?: boolean;
  /** How long stopped ranks get between SIGTERM and SIGKILL (default 5000 ms, env FLOTILLA_KILL_GRACE_MS). */
  graceMs?: number;
}

type Outcome =
  | { kind: 'ok' }
  | { kind: 'failed'; rank: number; code: number | null; signal: NodeJS.Signals | null; stalled?: { ranks: number[]; timedOut: number[] }; hungMs?: number }
  | { kind: 'interrupted'; signal: NodeJS.Signals }
  /** Another node failed (fatal: false) or was lost (fatal: true); this node's ranks were stopped. */
  | { kind: 'peer'; why: string; fatal: boolean };

/** What an attempt hears from outside its ranks, and tells outside. */
interface AttemptControl {
  /** Set by runGroup: stops the attempt's ranks because of another node. */
  abort?: (why: string, fatal: boolean) => void;
  /** Called once when this node's ranks fail (so the other nodes can stop theirs now). */
  onLocalFailure: (what: string) => void;
  heartbeat: HeartbeatConfig;
}

function describeExit(code: number | null, signal: NodeJS.Signals | null): string {
  return signal ? `was killed by ${signal}` : `exited with code ${code}`;
}

function plural(n: number, word: string): string {
  return `${word}${n > 1 ? 's' : ''}`;
}

/** What the final line says about a failure. */
function describeFailure(f: Extract<Outcome, { kind: 'failed' }>): string {
  if (f.hungMs !== undefined) return `rank ${f.rank} hung: stopped for ${f.hungMs} ms (SIGSTOP or a debugger; FLOTILLA_HEARTBEAT_TIMEOUT_MS)`;
  if (f.stalled) {
    const { ranks, timedOut } = f.stalled;
    return `${plural(ranks.length, 'rank')} ${ranks.join(', ')} stalled: ${plural(timedOut.length, 'rank')} ${timedOut.join(', ')} timed out waiting in a collective`;
  }
  return `rank ${f.rank} ${describeExit(f.code, f.signal)}`;
}

/** How long, after the first rank times out, the launcher waits for the others to time out too. */
const STALL_WINDOW_MS = 3000;

/** setpriv's path when it is on PATH (util-linux): ranks start under it with a parent-death signal. */
function findSetpriv(): string | undefined {
  if (process.platform !== 'linux') return undefined;
  for (const dir of (process.env.PATH ?? '/usr/bin:/bin').split(delimiter)) {
    const p = join(dir, 'setpriv');
    try {
      accessSync(p, fsConstants.X_OK);
      return p;
    } catch {
      // not here
    }
  }
  return undefined;
}

function signalCode(signal: NodeJS.Signals): number {
  return 128 + ((osConstants.signals as Record<string, number>)[signal] ?? 1);
}

/** Runs one attempt: every local rank, until all have exited. */
function runGroup(o: RunOptions, attempt: number, port: number, io: Required<LauncherIO>, storeDir: string | undefined, ctl: AttemptControl): Promise<Outcome> {
  if (o.backend === 'mpi') {
    const [cmd, args] = commandFor(o.script, o.scriptArgs);
    const env = { ...process.env, FLOTILLA_RESTART_COUNT: String(attempt), FLOTILLA_MAX_RESTARTS: String(o.maxRestarts), FLOTILLA_LAUNCHER_TTY: process.stdout.isTTY ? '1' : '0' };
    return runMpiGroup({ nproc: o.nproc, cmd, args, env }, io, ctl.heartbeat);
  }
  const worldSize = o.nnodes * o.nproc;
  let [cmd, baseArgs] = commandFor(o.script, o.scriptArgs);
  const setpriv = findSetpriv();
  if (setpriv !== undefined) [cmd, baseArgs] = [setpriv, ['--pdeathsig', 'TERM', '--', cmd, ...baseArgs]];
  const timedOut = new Set<number>(); // ranks that reported a collective timeout
  let stallTimer: NodeJS.Timeout | undefined;
  let firstTimeout: { rank: number; code: number | null; signal: NodeJS.Signals | null } | undefined;
  const children: (ChildProcess | undefined)[] = [];
  const running = new Set<number>();
  let outcome: Outcome = { kind: 'ok' };
  let stopping = false;
  let cleanExits = true; // every rank exited 0 (an interrupted run whose ranks stopped cleanly succeeded)
  let killTimer: NodeJS.Timeout | undefined;
  const say = (msg: string): void => void io.stderr.write(`flotilla run: ${msg}\n`);

  const stopAll = (signal: NodeJS.Signals): void => {
    for (const r of running) {
      const c = children[r - o.nodeRank * o.nproc];
      c?.kill(signal);
      if (signal !== 'SIGKILL') c?.kill('SIGCONT'); // a stopped rank acts on SIGTERM only once continued
    }
    if (signal !== 'SIGKILL' && killTimer === undefined) {
      killTimer = setTimeout(() => {
        if (running.size > 0) say(`rank(s) ${[...running].join(', ')} still running after ${io.graceMs} ms; killing`);
        for (const r of running) children[r - o.nodeRank * o.nproc]?.kill('SIGKILL');
      }, io.graceMs);
      killTimer.unref();
    }
  };

  const decideStall = (): void => {
    if (stallTimer) clearTimeout(stallTimer);
    stallTimer = undefined;
    if (firstTimeout === undefined || stopping) return;
    stopping = true;
    const suspects = [...running].filter((r) => !timedOut.has(r)).sort((a, b) => a - b);
    const gaveUp = [...timedOut].sort((a, b) => a - b);
    const f = firstTimeout;
    outcome = suspects.length > 0
      ? { kind: 'failed', rank: suspects[0]!, code: f.code, signal: f.signal, stalled: { ranks: suspects, timedOut: gaveUp } }
      : { kind: 'failed', rank: f.rank, code: f.code, signal: f.signal };
    say(suspects.length > 0
      ? `${describeFailure(outcome)}; stopping the other ${running.size} ${plural(running.size, 'rank')}`
      : `rank ${f.rank} timed out waiting in a collective; no rank on this node is left to blame (a rank on another node may have stalled)`);
    ctl.onLocalFailure(describeFailure(outcome));
    stopAll('SIGTERM');
  };

  ctl.abort = (why, fatal) => {
    if (stopping) return;
    stopping = true;
    outcome = { kind: 'peer', why, fatal };
    say(`${why}; stopping the ${running.size} ${plural(running.size, 'rank')} on this node`);
    stopAll('SIGTERM');
  };
  const stopWatch = watchStopped(
    () => [...running].map((r) => ({ label: String(r), pid: children[r - o.nodeRank * o.nproc]?.pid ?? -1 })).filter((x) => x.pid > 0),
    ctl.heartbeat,
    (label, _pid, ms) => {
      if (stopping) return;
      stopping = true;
      outcome = { kind: 'failed', rank: Number(label), code: null, signal: null, hungMs: ms };
      const others = running.size - 1;
      say(`${describeFailure(outcome)}; stopping it${others > 0 ? ` and the other ${others} ${plural(others, 'rank')}` : ''}`);
      ctl.onLocalFailure(describeFailure(outcome));
      stopAll('SIGTERM');
    },
  );

  const onSignal = (signal: NodeJS.Signals): void => {
    if (outcome.kind === 'interrupted') {
      say(`second ${signal}: killing the ranks`);
      stopAll('SIGKILL');
      return;
    }
    outcome = { kind: 'interrupted', signal };
    stopping = true;
    say(`received ${signal}; forwarding it to the ranks${signal === 'SIGINT' ? ' (Ctrl-C again kills them)' : ''}`);
    // A SIGINT asks flotilla ranks to save a checkpoint and stop after their current step: no
    // deadline but a second Ctrl-C. Other signals get the usual grace before SIGKILL.
    if (signal === 'SIGINT') for (const r of running) children[r - o.nodeRank * o.nproc]?.kill(signal);
    else stopAll(signal);
  };
  if (io.handleSignals) {
    process.on('SIGINT', onSignal);
    process.on('SIGTERM', onSignal);
  }

  return new Promise<Outcome>((resolve) => {
    let left = o.nproc;
    for (let local = 0; local < o.nproc; local++) {
      const rank = o.nodeRank * o.nproc + local;
      const env: NodeJS.ProcessEnv = {
        ...process.env,
        RANK: String(rank), WORLD_SIZE: String(worldSize), LOCAL_RANK: String(local), LOCAL_WORLD_SIZE: String(o.nproc),
        GROUP_RANK: String(o.nodeRank), MASTER_ADDR: o.masterAddr, MASTER_PORT: String(port),
        FLOTILLA_RESTART_COUNT: String(attempt), FLOTILLA_MAX_RESTARTS: String(o.maxRestarts),
        FLOTILLA_LAUNCHER_PID: String(process.pid),
        FLOTILLA_STATUS_FD: '3',
        ...(storeDir !== undefined ? { FLOTILLA_STORE_FILE: join(storeDir, `store.${attempt}`) } : {}),
        FLOTILLA_LAUNCHER_TTY: process.stdout.isTTY ? '1' : '0', // rank 0 may draw a progress bar on it
      };
      const child = spawn(cmd, baseArgs, { env, stdio: ['ignore', 'pipe', 'pipe', 'pipe'] });
      children[local] = child;
      running.add(rank);
      const prefix = `[rank ${rank}] `;
      createInterface({ input: child.stdout!, crlfDelay: Infinity }).on('line', (l) => void io.stdout.write(`${prefix}${l}\n`));
      createInterface({ input: child.stderr!, crlfDelay: Infinity }).on('line', (l) => void io.stderr.write(`${prefix}${l}\n`));
      createInterface({ input: child.stdio[3] as Readable, crlfDelay: Infinity }).on('line', (l) => {
        try {
          if ((JSON.parse(l) as { event?: string }).event === 'timeout') timedOut.add(rank);
        } catch {
          // not a status line
        }
      });
      let startError: string | undefined;
      child.on('error', (e) => {
        startError = e.message;
      });
      let exited = false;
      const onExit = (code: number | null, signal: NodeJS.Signals | null): void => {
        if (exited) return;
        exited = true;
        running.delete(rank);
        if (code !== 0 || signal !== null) cleanExits = false;
        if ((code !== 0 || signal !== null) && !stopping) {
          if (startError === undefined && timedOut.has(rank)) {
            // It gave up waiting for a peer: the cause is the rank it waited for. Give the others
            // a moment to time out as well, then name the one(s) still running that did not.
            firstTimeout ??= { rank, code, signal };
            stallTimer ??= setTimeout(decideStall, STALL_WINDOW_MS);
            if ([...running].every((r) => timedOut.has(r))) decideStall();
            return;
          }
          stopping = true;
          if (startError !== undefined) code = 127;
          outcome = { kind: 'failed', rank, code, signal };
          const others = running.size;
          const what = startError !== undefined ? `could not start (${startError})` : describeExit(code, signal);
          say(`rank ${rank} ${what}${others > 0 ? `; stopping the other ${others} rank${others > 1 ? 's' : ''}` : ''}`);
          ctl.onLocalFailure(`rank ${rank} ${what}`);
          stopAll('SIGTERM');
        }
        if (stopping || running.size === 0) decideStall();
      };
      // The decision waits for 'close' (the status pipe is drained by then), or 1 s after 'exit'
      // when something else holds the rank's pipes open.
      child.on('exit', (code, signal) => void setTimeout(() => onExit(code, signal), 1000).unref());
      child.on('close', (code, signal) => {
        // A rank that could not start has 'error' and 'close' but no 'exit'.
        onExit(code, signal);
        running.delete(rank);
        if (--left === 0) {
          stopWatch();
          ctl.abort = undefined;
          if (killTimer) clearTimeout(killTimer);
          if (stallTimer) clearTimeout(stallTimer);
          if (io.handleSignals) {
            process.off('SIGINT', onSignal);
            process.off('SIGTERM', onSignal);
          }
          resolve(outcome.kind === 'interrupted' && outcome.signal === 'SIGINT' && cleanExits ? { kind: 'ok' } : outcome);
        }
      });
    }
  });
}

/**
 * `flotilla run`: parses argv (the arguments after `run`), runs the ranks, restarts the group up to
 * --max-restarts times after a failure, and resolves to the exit code: 0 when every rank exited 0;
 * the failing rank's exit code (128 + signal number if it was killed); 128 + the signal when the
 * launcher was interrupted; 2 for a usage error.
 */
export async function runLauncher(argv: readonly string[], ioOpts: LauncherIO = {}): Promise<number> {
  const stderr = ioOpts.stderr ?? process.stderr;
  try {
    checkFlotillaEnv(); // a bad FLOTILLA_* value: one line here, not a failure in every rank
  } catch (e) {
    if ((e as Error).name !== 'LaunchEnvError') throw e;
    stderr.write(`flotilla run: ${(e as Error).message}\n`);
    return 2;
  }
  const envGrace = Number(process.env.FLOTILLA_KILL_GRACE_MS || NaN);
  const io: Required<LauncherIO> = {
    stdout: ioOpts.stdout ?? process.stdout,
    stderr: ioOpts.stderr ?? process.stderr,
    handleSignals: ioOpts.handleSignals ?? true,
    graceMs: ioOpts.graceMs ?? (Number.isFinite(envGrace) && envGrace >= 0 ? envGrace : 5000),
  };
  let o: RunOptions;
  try {
    o = parseRunArgs(argv[0] === 'run' ? argv.slice(1) : argv);
  } catch (e) {
    if (!(e instanceof RunUsageError)) throw e;
    if (e.help) {
      io.stdout.write(`${RUN_USAGE}\n`);
      return 0;
    }
    io.stderr.write(`flotilla run: ${e.message}\n\n${RUN_USAGE}\n`);
    return 2;
  }
  const say = (msg: string): void => void io.stderr.write(`flotilla run: ${msg}\n`);
  let heartbeat: HeartbeatConfig;
  try {
    heartbeat = heartbeatConfig();
  } catch (e) {
    io.stderr.write(`flotilla run: ${(e as Error).message}\n`);
    return 2;
  }
  if (o.nnodes > 1 && !isLoopback(o.masterAddr) && !process.env.FLOTILLA_JOB_SECRET) {
    io.stderr.write(
      `flotilla run: --nnodes ${o.nnodes} with --master-addr ${o.masterAddr}: set FLOTILLA_JOB_SECRET to the same random value on every node ` +
        '(e.g. `export FLOTILLA_JOB_SECRET=$(openssl rand -hex 32)`, then copy it); the rendezvous store admits only ranks that know it\n',
    );
    return 2;
  }
  // One node: rendezvous through files in a directory only this user can enter (mkdtemp makes it 0700).
  const storeDir = o.nnodes === 1 ? mkdtempSync(join(tmpdir(), 'flotilla-')) : undefined;
  const parent = process.ppid;
  const watchParent = io.handleSignals
    ? setInterval(() => {
      if (process.ppid === parent) return;
      say(`the launcher's parent (pid ${parent}) is gone; stopping the ranks`);
      clearInterval(watchParent);
      process.kill(process.pid, 'SIGTERM'); // handled like a SIGTERM from the user
    }, 500)
    : undefined;
  watchParent?.unref();
  try {
    return await attempts(o, io, storeDir, heartbeat);
  } finally {
    if (watchParent) clearInterval(watchParent);
    if (storeDir !== undefined) rmSync(storeDir, { recursive: true, force: true });
  }
}

/** The heartbeat port of a multi-node job: FLOTILLA_HEARTBEAT_PORT, else just above the store ports. */
export function heartbeatPort(o: RunOptions): number {
  const raw = process.env.FLOTILLA_HEARTBEAT_PORT?.trim();
  if (raw) return Number(raw);
  return (o.masterPort ?? DEFAULT_MASTER_PORT) + o.maxRestarts + 1;
}

async function attempts(o: RunOptions, io: Required<LauncherIO>, storeDir: string | undefined, heartbeat: HeartbeatConfig): Promise<number> {
  const say = (msg: string): void => void io.stderr.write(`flotilla run: ${msg}\n`);
  const ctl: AttemptControl = { heartbeat, onLocalFailure: () => undefined };
  let link: NodeLink | undefined;
  let lost: string | undefined; // a node was lost: no restart can bring it back
  if (o.nnodes > 1) {
    try {
      link = await NodeLink.start({
        nodeRank: o.nodeRank, nnodes: o.nnodes, nproc: o.nproc, host: o.masterAddr, port: heartbeatPort(o),
        secret: process.env.FLOTILLA_JOB_SECRET ?? '', config: heartbeat,
        joinTimeoutMs: Number(process.env.FLOTILLA_TIMEOUT_MS?.trim() || 300_000),
        onPeerDown: (why, fatal) => {
          if (fatal) lost = why;
          if (ctl.abort) ctl.abort(why, fatal);
          else if (fatal) say(why);
        },
      });
    } catch (e) {
      say((e as Error).message);
      return 1;
    }
    ctl.onLocalFailure = (what) => link!.announceFailure(`node ${o.nodeRank}: ${what}`);
  }
  try {
    return await attemptLoop(o, io, storeDir, ctl, () => lost, link);
  } finally {
    await link?.close();
  }
}

async function attemptLoop(
  o: RunOptions, io: Required<LauncherIO>, storeDir: string | undefined, ctl: AttemptControl, lost: () => string | undefined, link: NodeLink | undefined,
): Promise<number> {
  const say = (msg: string): void => void io.stderr.write(`flotilla run: ${msg}\n`);
  for (let attempt = 0; ; attempt++) {
    if (lost() !== undefined) {
      say(`failed: ${lost()}`);
      return 1;
    }
    let port: number;
    if (o.nnodes > 1) port = (o.masterPort ?? DEFAULT_MASTER_PORT) + attempt;
    else if (o.masterPort !== undefined) port = o.masterPort;
    else {
      try {
        port = await freePort(o.masterAddr);
      } catch (e) {
        say(`could not find a free port on --master-addr ${o.masterAddr} (${(e as Error).message}); is it an address of this host? Pass --master-port`);
        return 1;
      }
    }
    const outcome = await runGroup(o, attempt, port, io, storeDir, ctl);
    if (outcome.kind === 'ok') {
      link?.announceDone();
      return 0;
    }
    if (outcome.kind === 'interrupted') return signalCode(outcome.signal);
    if (outcome.kind === 'peer') {
      if (outcome.fatal || attempt >= o.maxRestarts) {
        say(`failed: ${outcome.why}`);
        return 1;
      }
      say(`${outcome.why}; restarting all ${o.nproc} local rank${o.nproc > 1 ? 's' : ''} (restart ${attempt + 1} of ${o.maxRestarts})`);
      continue;
    }
    const what = describeFailure(outcome);
    if (attempt < o.maxRestarts) {
      say(`${what}; restarting all ${o.nproc} local rank${o.nproc > 1 ? 's' : ''} (restart ${attempt + 1} of ${o.maxRestarts})`);
      continue;
    }
    say(`failed: ${what}${o.maxRestarts > 0 ? ` (after ${o.maxRestarts} restart${o.maxRestarts > 1 ? 's' : ''})` : ''}`);
    if (outcome.signal) return signalCode(outcome.signal);
    return outcome.code !== null && outcome.code > 0 && outcome.code < 256 ? outcome.code : 1;
  }
}
