// Test harness: start a world of real ranks on loopback for one test.
//
//   const { codes, outputs } = await runWorld({ nproc: 2, script: 'test/helpers/ranks/x.ts' });
//   const results = parseResults<MyResult>(outputs);   // what each rank passed to emitResult()
//
// Each rank is `node script args` (see scriptCommand) with the launch contract (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=<free port>). The ranks meet in a
// FileStore in a fresh directory, as under `flotilla run` on one host, unless the test asks for
// flotilla's socket store (store: 'socket'), which rank 0 serves on MASTER_PORT with a secret of the
// world's own. Why: a free port is only free until somebody takes it, and two worlds of test files
// running side by side once got the same one before either rank 0 listened; with no secret on
// loopback their ranks met in one store and both hung. A world that runs
// past timeoutMs is killed and runWorld rejects naming the ranks that were still running, with the
// end of their output. Set FLOTILLA_TEST_VERBOSE=1 to stream rank output while the test runs.
// This module does not load the native addon; rank scripts import emitResult from ./rank.js.
import { spawn, type ChildProcess } from 'node:child_process';
import { freePort } from '../../src/launch/launcher.js';
import { spawnMpiJob } from '../../src/launch/mpirun.js';
import { randomBytes } from 'node:crypto';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { isAbsolute, join, resolve } from 'node:path';
import { runnableScript } from './compiled.js';

export interface WorldOptions {
  nproc: number;
  /** The rank script (.ts compiled or under tsx, see scriptCommand); relative paths resolve from the repository root. */
  script: string;
  args?: string[];
  /** Extra environment for every rank (values override the launch contract's). */
  env?: Record<string, string | undefined>;
  /** Environment for one rank only: rankEnv(rank). */
  rankEnv?: (rank: number) => Record<string, string | undefined>;
  /** Kill the world after this long (default 60 s). */
  timeoutMs?: number;
  /** Called once per rank right after it starts (tests use it to signal a rank). */
  onSpawn?: (rank: number, child: ChildProcess) => void;
  /**
   * 'gloo' (default): every rank is its own child process with the launch contract set. 'mpi': the
   * ranks run under one mpirun (src/launch/mpirun.ts) with FLOTILLA_BACKEND=mpi; rankEnv
   * and onSpawn are not available there.
   */
  backend?: 'gloo' | 'mpi';
  /**
   * 'file' (default): a FileStore in a fresh directory (FLOTILLA_STORE_FILE), removed afterwards.
   * 'socket': flotilla's store served by rank 0 on MASTER_PORT, with a secret of this world's own
   * unless env sets FLOTILLA_JOB_SECRET (tests of the socket store itself).
   */
  store?: 'file' | 'socket';
}

/**
 * The backends the collective tests run on. Both, always: scripts/setup.sh installs Open MPI, and a
 * machine without it fails the MPI tests with the install line (assertMpiBuilt) instead of skipping.
 */
export const BACKENDS = ['gloo', 'mpi'] as const;

/** Fails naming the fix when the MPI addon was not built (Open MPI missing when the addon was built). */
export function assertMpiBuilt(): void {
  if (!existsSync(resolve(REPO_ROOT, 'native', 'build', 'Release', 'flotilla_mpi.node'))) {
    throw new Error('native/build/Release/flotilla_mpi.node is missing: apt-get install libopenmpi-dev openmpi-bin, then bash scripts/ensure.sh');
  }
}

export interface WorldResult {
  /** Exit code per rank; null when the rank was ended by a signal. */
  codes: (number | null)[];
  /** The signal that ended each rank, if any. */
  signals: (NodeJS.Signals | null)[];
  /** Everything each rank wrote (stdout and stderr, interleaved as it arrived). */
  outputs: string[];
  port: number;
}

export const REPO_ROOT = resolve(import.meta.dirname, '..', '..');

export { freePort };

/** Whether a process with this pid exists (signal 0 probes without delivering anything). */
export function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/**
 * Command and arguments that run a script: .ts/.mts/.cts compiled against dist/ while it is current
 * (test/helpers/compiled.ts), else under tsx; .js under node.
 */
export function scriptCommand(script: string, args: string[] = []): [string, string[]] {
  script = runnableScript(script);
  if (/\.[mc]?ts$/.test(script)) return [process.execPath, ['--import', import.meta.resolve('tsx'), script, ...args]];
  return [process.execPath, [script, ...args]];
}

function tail(s: string, lines = 15): string {
  return s.split('\n').slice(-lines).join('\n');
}

/** Thrown when a world runs past its timeout; lists the ranks that were still running. */
export class WorldTimeoutError extends Error {
  constructor(readonly hung: number[], readonly outputs: string[], timeoutMs: number) {
    super(
      `world timed out after ${timeoutMs} ms: rank${hung.length > 1 ? 's' : ''} ${hung.join(', ')} still running (killed)\n` +
        outputs.map((o, r) => `--- rank ${r}${hung.includes(r) ? ' (hung)' : ''}, last lines:\n${tail(o)}`).join('\n'),
    );
    this.name = 'WorldTimeoutError';
  }
}

/** Starts nproc ranks of script on a free loopback port and resolves when all have exited. */
export async function runWorld(opts: WorldOptions): Promise<WorldResult> {
  const { nproc } = opts;
  if (!Number.isInteger(nproc) || nproc < 1) throw new Error(`runWorld: nproc must be a positive integer, got ${nproc}`);
  const timeoutMs = opts.timeoutMs ?? 60_000;
  if (opts.backend === 'mpi') {
    assertMpiBuilt();
    return runMpiWorld(opts, timeoutMs);
  }
  const port = await freePort();
  const storeDir = opts.store === 'socket' ? undefined : mkdtempSync(join(tmpdir(), 'flotilla-world-'));
  const storeEnv = storeDir !== undefined
    ? { FLOTILLA_STORE_FILE: join(storeDir, 'store') }
    : { FLOTILLA_STORE_FILE: undefined, ...(opts.env && 'FLOTILLA_JOB_SECRET' in opts.env ? {} : { FLOTILLA_JOB_SECRET: randomBytes(16).toString('hex') }) };
  const { cmd, argv, verbose, outputs, codes, signals } = worldState(opts);
  const running = new Set<number>();
  const children: ChildProcess[] = [];

  const done = Promise.all(
    Array.from({ length: nproc }, (_, rank) => new Promise<void>((res) => {
      const env: Record<string, string | undefined> = {
        ...process.env,
        RANK: String(rank), WORLD_SIZE: String(nproc), LOCAL_RANK: String(rank), LOCAL_WORLD_SIZE: String(nproc),
        MASTER_ADDR: '127.0.0.1', MASTER_PORT: String(port),
        ...storeEnv,
        ...opts.env,
        ...opts.rankEnv?.(rank),
      };
      const child = spawn(cmd, argv, { cwd: REPO_ROOT, env, stdio: ['ignore', 'pipe', 'pipe'] });
      children[rank] = child;
      running.add(rank);
      const collect = (chunk: Buffer): void => {
        const s = chunk.toString();
        outputs[rank] += s;
        if (verbose) process.stderr.write(s.replace(/^(?=.)/gm, `[rank ${rank}] `));
      };
      child.stdout!.on('data', collect);
      child.stderr!.on('data', collect);
      child.on('error', (e) => {
        outputs[rank] += `\n[runWorld] could not start rank ${rank}: ${e.message}\n`;
      });
      child.on('close', (code, signal) => {
        codes[rank] = code;
        signals[rank] = signal;
        running.delete(rank);
        res();
      });
      opts.onSpawn?.(rank, child);
    })),
  );

  let timer: NodeJS.Timeout | undefined;
  const timedOut = new Promise<'timeout'>((res) => {
    timer = setTimeout(() => res('timeout'), timeoutMs);
  });
  const winner = await Promise.race([done.then(() => 'done' as const), timedOut]);
  clearTimeout(timer);
  const hung = [...running].sort((a, b) => a - b);
  if (winner === 'timeout') {
    for (const r of hung) children[r]?.kill('SIGKILL');
    await done;
  }
  if (storeDir !== undefined) rmSync(storeDir, { recursive: true, force: true });
  if (winner === 'timeout') throw new WorldTimeoutError(hung, outputs, timeoutMs);
  return { codes, signals, outputs, port };
}

/** What both kinds of world start from: the rank command, and per-rank output, exit code and signal. */
function worldState(opts: WorldOptions) {
  const script = isAbsolute(opts.script) ? opts.script : resolve(REPO_ROOT, opts.script);
  const [cmd, argv] = scriptCommand(script, opts.args);
  return {
    cmd, argv,
    verbose: process.env.FLOTILLA_TEST_VERBOSE === '1',
    outputs: new Array<string>(opts.nproc).fill(''),
    codes: new Array<number | null>(opts.nproc).fill(null),
    signals: new Array<NodeJS.Signals | null>(opts.nproc).fill(null),
  };
}

/** runWorld for backend 'mpi': one mpirun, its output and exits split by rank. */
async function runMpiWorld(opts: WorldOptions, timeoutMs: number): Promise<WorldResult> {
  const { nproc } = opts;
  if (opts.rankEnv || opts.onSpawn) throw new Error("runWorld: rankEnv and onSpawn are not available with backend 'mpi'");
  const { cmd, argv, verbose, outputs, codes, signals } = worldState(opts);
  const exited = new Set<number>();
  let mpirunOut = '';
  let timer: NodeJS.Timeout | undefined;
  let job: ChildProcess | undefined;
  const closed = new Promise<{ code: number | null; startError: string | undefined }>((res) => {
    job = spawnMpiJob({
      nproc, cmd, args: argv, cwd: REPO_ROOT, env: { ...process.env, ...opts.env },
      onLine: (rank, _stream, line) => {
        if (rank < 0 || rank >= nproc) mpirunOut += `${line}\n`;
        else outputs[rank] += `${line}\n`;
        if (verbose) process.stderr.write(`[${rank < 0 ? 'mpirun' : `rank ${rank}`}] ${line}\n`);
      },
      onRankExit: (rank, code, signal) => {
        codes[rank] = code;
        signals[rank] = signal;
        exited.add(rank);
      },
      onClose: (code, _signal, startError) => res({ code, startError }),
    });
  });
  const timedOut = new Promise<'timeout'>((res) => {
    timer = setTimeout(() => res('timeout'), timeoutMs);
  });
  const winner = await Promise.race([closed, timedOut]);
  clearTimeout(timer);
  if (winner === 'timeout') {
    const hung = Array.from({ length: nproc }, (_, r) => r).filter((r) => !exited.has(r));
    job?.kill('SIGTERM');
    const killer = setTimeout(() => job?.kill('SIGKILL'), 5000);
    await closed;
    clearTimeout(killer);
    throw new WorldTimeoutError(hung, outputs, timeoutMs);
  }
  const { code, startError } = winner;
  // A rank mpirun could not start (or mpirun itself failing) leaves no exit line: say so in its output.
  for (let r = 0; r < nproc; r++) {
    if (!exited.has(r)) {
      codes[r] = code === 0 ? 1 : code;
      outputs[r] += `\n[runWorld] mpirun reported no exit for rank ${r} (mpirun exit ${code}${startError ? `, ${startError}` : ''}):\n${mpirunOut}`;
    }
  }
  return { codes, signals, outputs, port: 0 };
}

export const RESULT_PREFIX = 'FLOTILLA_RESULT ';

/** Every result line each rank printed with emitResult(), in order. */
export function parseAllResults<T = unknown>(outputs: string[]): T[][] {
  return outputs.map((out) =>
    out.split('\n').filter((l) => l.startsWith(RESULT_PREFIX)).map((l) => JSON.parse(l.slice(RESULT_PREFIX.length)) as T));
}

/** The last result each rank printed with emitResult(); throws naming a rank that printed none. */
export function parseResults<T = unknown>(outputs: string[]): T[] {
  return parseAllResults<T>(outputs).map((rs, rank) => {
    if (rs.length === 0) throw new Error(`rank ${rank} printed no result line; its output ends:\n${tail(outputs[rank] ?? '', 30)}`);
    return rs[rs.length - 1]!;
  });
}

/** A readable dump of every rank's output, for assertion messages. */
export function describeWorld(r: Pick<WorldResult, 'codes' | 'outputs'> & { signals?: (string | null)[] }): string {
  return r.outputs
    .map((o, i) => `--- rank ${i} exit ${r.codes[i]}${r.signals?.[i] ? ` (${r.signals[i]})` : ''}:\n${tail(o, 40)}`)
    .join('\n');
}
