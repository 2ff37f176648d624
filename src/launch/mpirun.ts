// Starting ranks through Open MPI's mpirun (`flotilla run --backend mpi`, and the test harness).
//
// mpirun runs every rank as `sh -c '{ <rank command>; echo FLOTILLA_RANK_EXIT $?; } | cat'`, with
// --tag-output, so this side learns each rank's output and exit status from mpirun's one output
// stream: lines tagged `[job,rank]<stdout>:` are the rank's, FLOTILLA_RANK_EXIT lines report its
// exit (128 + n when signal n ended it). --enable-recovery keeps mpirun from killing every rank the
// moment one dies: the caller decides (the launcher stops the rest; the harness lets survivors report).
//
// Spinning: a rank waiting in a blocking MPI call busy-polls (Open MPI's progress loop) on the
// communicator's thread, beside the rank's own compute thread and the other ranks'. With
// mpi_yield_when_idle=1 the poll yields the core to runnable threads: on 2 ranks x 2 cores the
// exposed communication of a DDP step fell from 35-49 ms to 14-19 ms (bench/ddp.ts setup, measured
// alternately), and oversubscribed waiters leave the core to the rank that computes
// (bench/oversubscribe.ts). So it is always set (an OMPI_MCA_mpi_yield_when_idle in the environment
// wins). With more ranks than cores mpirun refuses to start unless told (--oversubscribe). Ranks are not bound to cores (--bind-to none), as
// with `flotilla run` on Gloo: a rank's intra-op, MPI and runtime threads share whatever is free.
// Running as root, Open MPI needs OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM); they are set for root only.
// This module loads no native addon (the test harness uses it).
//
// [Note: MPI listeners] A job on one host must listen on nothing but loopback. Left alone, Open MPI's
// TCP transport listens in every rank on every interface (0.0.0.0:1024, [::]:1024, ...) and mpirun's
// out-of-band channel does too. So the ranks move data over shared memory only (btl self,vader: no
// TCP transport is loaded) and the out-of-band channel is told to use lo. That is not enough for
// mpirun itself: Open MPI 4.1 binds its out-of-band listener to INADDR_ANY whatever
// oob_tcp_if_include says (checked with 4.1.4: 0.0.0.0 and [::]). So mpirun, and the ranks it starts,
// run in a network namespace of their own that has only a loopback interface (`unshare --net`, with
// --map-root-user when not root), where "every interface" is loopback; shared memory, files and
// signals are unchanged, but the ranks cannot reach other hosts. FLOTILLA_MPI_NETNS=0 keeps the
// host's network (then mpirun listens on every interface); where no namespace can be made (no
// unshare or ip, or user namespaces disabled) the launcher says so once and runs without one.
// MCA settings already in the environment (OMPI_MCA_btl, OMPI_MCA_oob_tcp_if_include) win.
//
// [Note: MPI session directories] mpirun keeps its session files under <tmp>/ompi.<host>.<uid>,
// shared by every job of the user on the host. Two mpiruns starting at the same moment race to make
// that directory and the loser stops with "mkdir ... File exists" (seen with two test files at once;
// two `flotilla run --backend mpi` on one host could meet it too). So each job gets a directory of
// its own (orte_tmpdir_base), made before mpirun starts and removed when it ends; an
// OMPI_MCA_orte_tmpdir_base in the environment wins.
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { availableParallelism, constants as osConstants, tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Readable } from 'node:stream';
import { MPI_INSTALL_HINT, onPath } from '../distributed/mpi_install.js';
import { processTree } from './heartbeat.js';
import type { Supervisor, SupervisorIO } from './supervisor.js';

export const RANK_EXIT = 'FLOTILLA_RANK_EXIT';

/** The variables a launcher must not pass down: under mpirun the rank comes from OMPI_COMM_WORLD_*. */
const CONTRACT_VARS = ['RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'FLOTILLA_LAUNCHER_PID', 'FLOTILLA_STORE_FILE'];

/** mpirun's own noise when a rank leaves early under --enable-recovery (nothing is wrong). */
const NOISE = /PMIX ERROR: BAD-PARAM in file .*pmix_event_notification\.c/;

export interface MpiJobOptions {
  nproc: number;
  cmd: string;
  args: string[];
  env?: Record<string, string | undefined>;
  cwd?: string;
  /** A line a rank wrote (stream 'stdout' or 'stderr'), or mpirun's own line (rank -1). */
  onLine: (rank: number, stream: 'stdout' | 'stderr', line: string) => void;
  /** A rank ended: its exit code, or the signal that ended it. */
  onRankExit: (rank: number, code: number | null, signal: NodeJS.Signals | null) => void;
  /** mpirun itself ended (after every rank). */
  onClose: (code: number | null, signal: NodeJS.Signals | null, startError: string | undefined) => void;
}

function signalName(n: number): NodeJS.Signals | null {
  for (const [name, num] of Object.entries(osConstants.signals)) if (num === n) return name as NodeJS.Signals;
  return null;
}

/** mpirun's arguments for nproc local ranks of cmd. */
export function mpirunArgs(nproc: number, cmd: string, args: string[], env: Record<string, string | undefined> = process.env): string[] {
  const out = ['-np', String(nproc), '--tag-output', '--enable-recovery', '--bind-to', 'none'];
  if (nproc > availableParallelism()) out.push('--oversubscribe');
  if (env.OMPI_MCA_mpi_yield_when_idle === undefined) out.push('--mca', 'mpi_yield_when_idle', '1');
  // One host: shared memory between ranks, out-of-band on loopback ([Note: MPI listeners]).
  if (env.OMPI_MCA_btl === undefined) out.push('--mca', 'btl', 'self,vader');
  if (env.OMPI_MCA_oob_tcp_if_include === undefined && env.OMPI_MCA_oob_tcp_if_exclude === undefined) out.push('--mca', 'oob_tcp_if_include', 'lo');
  // The rank's stdout goes through a pipe (`| cat`): mpirun would give it a pseudo-terminal, and a
  // rank that believes it writes to a terminal colours its output and draws its progress bar into
  // mpirun's stream. Rank 0 draws it on the launcher's terminal instead (FLOTILLA_LAUNCHER_TTY).
  out.push('sh', '-c', `{ "$@"; echo "${RANK_EXIT} $?"; } | cat`, 'sh', cmd, ...args);
  return out;
}

/** The environment mpirun gets: the caller's, minus the torchrun-style contract, plus what MPI needs. */
export function mpirunEnv(base: Record<string, string | undefined>): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = { ...base, FLOTILLA_BACKEND: 'mpi' };
  for (const v of CONTRACT_VARS) delete env[v];
  if (process.getuid?.() === 0) {
    env.OMPI_ALLOW_RUN_AS_ROOT = '1';
    env.OMPI_ALLOW_RUN_AS_ROOT_CONFIRM = '1';
  }
  return env;
}

/** An executable on PATH or in the system directories (ip lives in /usr/sbin). */
function systemTool(name: string): string | undefined {
  const found = onPath(name);
  if (found !== undefined) return found;
  for (const dir of ['/usr/sbin', '/sbin', '/usr/bin', '/bin']) {
    const p = join(dir, name);
    if (existsSync(p)) return p;
  }
  return undefined;
}

let netnsProbe: { prefix: string[]; asRoot: boolean } | string | undefined;

/**
 * The command prefix that runs mpirun in a network namespace with only loopback, up
 * ([Note: MPI listeners]), or why there is none. Probed once per process.
 */
export function loopbackNamespace(env: Record<string, string | undefined> = process.env): { prefix: string[]; asRoot: boolean } | string {
  if (env.FLOTILLA_MPI_NETNS?.trim() === '0') return 'FLOTILLA_MPI_NETNS=0';
  if (netnsProbe !== undefined) return netnsProbe;
  const unshare = process.platform === 'linux' ? systemTool('unshare') : undefined;
  const ip = systemTool('ip');
  if (unshare === undefined || ip === undefined) {
    netnsProbe = `${unshare === undefined ? 'unshare (util-linux)' : 'ip (iproute2)'} is not installed`;
    return netnsProbe;
  }
  const root = process.getuid?.() === 0;
  const prefix = [unshare, '--net', ...(root ? [] : ['--map-root-user']), '--', 'sh', '-c', `${JSON.stringify(ip)} link set lo up && exec "$@"`, 'sh'];
  const probe = spawnSync(prefix[0]!, [...prefix.slice(1), 'true'], { stdio: ['ignore', 'ignore', 'pipe'], timeout: 10_000, encoding: 'utf8' });
  netnsProbe = probe.status === 0
    ? { prefix, asRoot: !root }
    : `a network namespace could not be made (${(probe.stderr || probe.error?.message || `exit ${probe.status}`).trim().split('\n')[0]})`;
  return netnsProbe;
}

/** The command that starts mpirun: under setpriv's parent-death signal, in a loopback-only namespace. */
export function mpirunCommand(o: { nproc: number; cmd: string; args: string[] }, env: Record<string, string | undefined>): { cmd: string; args: string[]; env: NodeJS.ProcessEnv; isolated: boolean; why?: string } {
  let line = ['mpirun', ...mpirunArgs(o.nproc, o.cmd, o.args, env)];
  const childEnv = mpirunEnv(env);
  const ns = loopbackNamespace(env);
  if (typeof ns !== 'string') {
    line = [...ns.prefix, ...line];
    if (ns.asRoot) {
      // Inside the user namespace the launcher's user is root to Open MPI.
      childEnv.OMPI_ALLOW_RUN_AS_ROOT = '1';
      childEnv.OMPI_ALLOW_RUN_AS_ROOT_CONFIRM = '1';
    }
  }
  // Under setpriv's parent-death signal where it exists: mpirun (and so every rank) ends with its launcher.
  const setpriv = process.platform === 'linux' ? onPath('setpriv') : undefined;
  if (setpriv !== undefined) line = [setpriv, '--pdeathsig', 'TERM', '--', ...line];
  return { cmd: line[0]!, args: line.slice(1), env: childEnv, isolated: typeof ns !== 'string', ...(typeof ns === 'string' ? { why: ns } : {}) };
}

let warnedNoNamespace = false;

/** Starts an mpirun job and routes its output and exits per rank. */
export function spawnMpiJob(o: MpiJobOptions): ChildProcess {
  const c = mpirunCommand(o, o.env ?? process.env);
  if (!c.isolated && c.why !== 'FLOTILLA_MPI_NETNS=0' && !warnedNoNamespace) {
    warnedNoNamespace = true;
    o.onLine(-1, 'stderr', `ranks share the host's network: ${c.why}; mpirun's out-of-band listener is open on every interface (see FLOTILLA_MPI_NETNS in the README)`);
  }
  // A session directory of the job's own ([Note: MPI session directories]).
  const sessionDir = c.env.OMPI_MCA_orte_tmpdir_base === undefined ? mkdtempSync(join(tmpdir(), 'flotilla-mpi-')) : undefined;
  if (sessionDir !== undefined) c.env.OMPI_MCA_orte_tmpdir_base = sessionDir;
  // mpirun and its ranks in a process group of their own: a terminal's Ctrl-C reaches the launcher
  // only, which asks the ranks to stop after their step (mpirun would end them at once).
  const child = spawn(c.cmd, c.args, { env: c.env, cwd: o.cwd, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
  const deliver = (rank: number, stream: 'stdout' | 'stderr', line: string): void => {
    if (rank < 0) {
      if (!NOISE.test(line)) o.onLine(-1, stream, line);
      return;
    }
    if (stream === 'stdout' && line.startsWith(`${RANK_EXIT} `)) {
      const status = Number(line.slice(RANK_EXIT.length + 1));
      if (status > 128) o.onRankExit(rank, null, signalName(status - 128));
      else o.onRankExit(rank, status, null);
      return;
    }
    o.onLine(rank, stream, line);
  };
  const outDone = new Promise<void>((res) => splitTagged(child.stdout!, 'stdout', deliver, res));
  const errDone = new Promise<void>((res) => splitTagged(child.stderr!, 'stderr', deliver, res));
  let startError: string | undefined;
  child.on('error', (e) => {
    startError = (e as NodeJS.ErrnoException).code === 'ENOENT' ? `mpirun is not installed (${MPI_INSTALL_HINT})` : e.message;
  });
  child.on('close', (code, signal) => {
    if (sessionDir !== undefined) rmSync(sessionDir, { recursive: true, force: true });
    void Promise.all([outDone, errDone]).then(() => o.onClose(code, signal, startError));
  });
  return child;
}

/**
 * Splits one of mpirun's --tag-output streams into lines per rank. mpirun tags every chunk it
 * forwards (`[job,rank]<stdout>:`) and every line start within it, but a chunk that ends mid-line
 * is continued by a later chunk with its own tag, possibly after other ranks' chunks: so text is
 * collected per rank and stream until its newline. Untagged text is mpirun's own (rank -1).
 */
export function splitTagged(
  input: Readable, via: 'stdout' | 'stderr', deliver: (rank: number, stream: 'stdout' | 'stderr', line: string) => void, done: () => void,
): void {
  const tag = /\[\d+,(\d+)\]<(stdout|stderr|stddiag)>:/g;
  const partial = new Map<string, string>();
  let current: { rank: number; stream: 'stdout' | 'stderr' } | undefined;
  let pending = '';
  const add = (text: string): void => {
    let rest = text;
    while (rest.length > 0) {
      const key = current ? `${current.rank}:${current.stream}` : `-1:${via}`;
      const nl = rest.indexOf('\n');
      if (nl < 0) {
        partial.set(key, (partial.get(key) ?? '') + rest);
        return;
      }
      const line = (partial.get(key) ?? '') + rest.slice(0, nl);
      partial.delete(key);
      deliver(current?.rank ?? -1, current?.stream ?? via, line);
      current = undefined; // the next line starts with a tag if it is a rank's
      rest = rest.slice(nl + 1);
    }
  };
  const consume = (final: boolean): void => {
    tag.lastIndex = 0;
    let at = 0;
    for (let m = tag.exec(pending); m !== null; m = tag.exec(pending)) {
      add(pending.slice(at, m.index));
      current = { rank: Number(m[1]), stream: m[2] === 'stdout' ? 'stdout' : 'stderr' };
      at = m.index + m[0].length;
    }
    // Keep a tail that might be the start of a tag cut by the chunk boundary.
    const lb = pending.lastIndexOf('[');
    const keep = !final && lb >= at && pending.length - lb < 32 && !pending.includes('\n', lb) ? lb : pending.length;
    add(pending.slice(at, keep));
    pending = pending.slice(keep);
  };
  input.setEncoding('utf8');
  input.on('data', (chunk: string) => {
    pending += chunk;
    consume(false);
  });
  input.on('end', () => {
    consume(true);
    for (const [key, text] of partial) {
      const [rank, stream] = key.split(':');
      if (text.length > 0) deliver(Number(rank), stream as 'stdout' | 'stderr', text);
    }
    done();
  });
}

// ---------------------------------------------------------------------------------------------
// `flotilla run --backend mpi`: one attempt of the group

/** The processes below mpirun that belong to a rank (their environment names it), as (rank, pid). */
function rankProcesses(mpirunPid: number | undefined): { rank: number; pid: number }[] {
  if (mpirunPid === undefined) return [];
  const out: { rank: number; pid: number }[] = [];
  for (const pid of processTree(mpirunPid)) {
    if (pid === mpirunPid) continue;
    try {
      const m = /(?:^|\0)OMPI_COMM_WORLD_RANK=(\d+)/.exec(readFileSync(`/proc/${pid}/environ`, 'latin1'));
      // The ranks' own processes: not the shell wrapper and the `cat` that carry their output.
      if (m && !['sh', 'dash', 'bash', 'cat'].includes(readFileSync(`/proc/${pid}/comm`, 'utf8').trim())) out.push({ rank: Number(m[1]), pid });
    } catch {
      // gone, or not ours to read
    }
  }
  return out;
}

/**
 * Runs nproc ranks of cmd under mpirun, output prefixed `[rank k]`, and reports each rank's exit to
 * the supervisor (a SIGTERM goes to mpirun, which passes it on; SIGKILL to every process below it).
 * Resolves once mpirun has ended.
 */
export function runMpirun(o: { nproc: number; cmd: string; args: string[]; env: Record<string, string | undefined> }, io: SupervisorIO, sup: Supervisor): Promise<void> {
  let job: ChildProcess | undefined;
  sup.attach({
    signal: (signal) => {
      if (signal === 'SIGKILL' && job?.pid !== undefined) {
        for (const pid of processTree(job.pid).reverse()) {
          try {
            process.kill(pid, signal);
          } catch {
            // gone meanwhile
          }
        }
      } else job?.kill(signal);
    },
    pids: () => rankProcesses(job?.pid),
  });
  return new Promise<void>((resolve) => {
    job = spawnMpiJob({
      nproc: o.nproc, cmd: o.cmd, args: o.args, env: o.env,
      onLine: (rank, stream, line) => {
        const out = stream === 'stdout' ? io.stdout : io.stderr;
        out.write(rank < 0 ? `flotilla run: mpirun: ${line}\n` : `[rank ${rank}] ${line}\n`);
      },
      onRankExit: (rank, code, signal) => sup.rankExited(rank, code, signal),
      onClose: (code, signal, startError) => {
        if (startError !== undefined) sup.backendFailed(`could not start mpirun: ${startError}`, 127);
        else if (code !== 0 || sup.running.size > 0) {
          sup.backendFailed(`mpirun ended (${signal ?? `exit ${code}`}) before rank(s) ${[...sup.running].join(', ')} reported an exit`, code ?? 1);
        }
        resolve();
      },
    });
  });
}
