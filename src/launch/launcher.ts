// `flotilla run`: start N ranks of a script on this host with the launch contract set
// (src/distributed/env.ts). The command line is parsed in src/cli/run.ts; this file runs the
// attempts: ports, rendezvous files, the heartbeat between nodes, and what restarts.ts decides
// after each (another attempt, another meeting of the hosts, or the exit code). Ranks
// start directly (direct.ts, Gloo) or through mpirun (mpirun.ts); either way one supervisor
// (supervisor.ts) watches them.
//
// Every rank gets RANK = node_rank * N + local_rank, WORLD_SIZE = M * N, LOCAL_RANK,
// LOCAL_WORLD_SIZE = N, GROUP_RANK = node_rank, MASTER_ADDR, MASTER_PORT, and the launcher's own
// variables (src/distributed/launcher_env.ts: FLOTILLA_RESTART_COUNT, FLOTILLA_MAX_RESTARTS, ...).
// .ts scripts run under tsx, .js under node, and anything else is executed as it is (so
// `flotilla run --nproc 2 python3 peer.py` works too).
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
// Stalls: a rank whose collective times out tells the launcher so in a status file
// (FLOTILLA_STATUS_FILE; see src/distributed/launcher_channel.ts). When the failures are all such
// timeouts, the launcher waits a moment for the others to time out too and names the rank(s) still
// running that never timed out (the one everybody waited for), not the first rank that gave up.
//
// The terminal: a rank's stdout is the launcher's pipe, so when the launcher's stdout is a terminal
// it names that terminal in FLOTILLA_LAUNCHER_TTY and rank 0 draws its progress bar there
// (src/train/progress.ts), under both backends (mpirun's ranks have no controlling terminal).
//
// Liveness (heartbeat.ts): the launchers of a multi-node job keep a heartbeat, so a lost node (its
// host or link gone, its launcher killed) is found within 30 s (FLOTILLA_HEARTBEAT_TIMEOUT_MS), and
// a node whose ranks fail tells the others at once: every launcher then stops its ranks and exits
// non-zero naming the node and its ranks. On every node, a rank that stays stopped (SIGSTOP, a
// debugger) for that long is treated as hung and ends the job like a rank that failed.
//
// --backend mpi: the ranks start through Open MPI's mpirun instead (mpirun.ts),
// which sets OMPI_COMM_WORLD_* in place of RANK/WORLD_SIZE; output prefixes, signal forwarding,
// stopping the others when one fails, restarts and exit codes are the same. One node only.
//
// Ports: on one node without --master-port each attempt picks a free port (so a restarted group
// never meets a store left over from the one it replaces). With --master-port on one node every
// attempt reuses it (the old ranks are all gone by then). With several nodes, which cannot agree on a
// free port, attempt k uses --master-port + k (default 29500 + k) on every node; each node's launcher
// restarts its ranks when they fail, and a failure on one node makes the ranks on the others fail
// within the process-group timeout, so all nodes restart together.
import { mkdtempSync, readlinkSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { createServer } from 'node:net';
import { join } from 'node:path';
import { DEFAULT_MASTER_PORT, isLoopback } from '../distributed/env.js';
import { runDirect } from './direct.js';
import { runMpirun } from './mpirun.js';
import { heartbeatConfig, NodeLink, type Grow, type HeartbeatConfig } from './heartbeat.js';
import { canShrink, heardRoster, initialState, nextStep, type RestartAction, type RestartEvent, type RestartLimits, type RestartState } from './restarts.js';
import { regrouped } from '../distributed/launcher_channel.js';
import { jobIdentity, launcherVars } from '../distributed/launcher_env.js';
import { Supervisor, type Outcome, type SupervisorIO } from './supervisor.js';

export interface RunOptions {
  nproc: number;
  nnodes: number;
  /**
   * Hosts the job may shrink to (--nnodes MIN:MAX; default nnodes): when a host is lost and at least
   * this many remain, the others stop their ranks, meet again without it and start them on the
   * smaller world ([Note: elastic shrink]).
   */
  minNodes?: number;
  nodeRank: number;
  masterAddr: string;
  /**
   * An elastic job's list of addresses (--master-addr A,B,C; masterAddr is the first): where this
   * host looks for the job's node 0 when it starts, in turn ([Note: master address list]).
   */
  masterAddrs?: string[];
  /** Undefined: pick a free port (one node) or use the default (several). */
  masterPort: number | undefined;
  maxRestarts: number;
  /** 'mpi': the ranks start through mpirun (mpirun.ts) and use the MPI backend. */
  backend: 'gloo' | 'mpi';
  script: string;
  scriptArgs: string[];
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

/** The launcher's defaults filled in. */
export function launcherIO(ioOpts: LauncherIO = {}): SupervisorIO {
  const envGrace = Number(process.env.FLOTILLA_KILL_GRACE_MS || NaN);
  return {
    stdout: ioOpts.stdout ?? process.stdout,
    stderr: ioOpts.stderr ?? process.stderr,
    handleSignals: ioOpts.handleSignals ?? true,
    graceMs: ioOpts.graceMs ?? (Number.isFinite(envGrace) && envGrace >= 0 ? envGrace : 5000),
  };
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

/** The terminal this launcher's stdout is (its device path), or '0': what FLOTILLA_LAUNCHER_TTY says. */
export function launcherTerminal(): string {
  if (!process.stdout.isTTY) return '0';
  try {
    const dev = readlinkSync('/proc/self/fd/1');
    return dev.startsWith('/dev/') ? dev : '0';
  } catch {
    return '0';
  }
}

/** What an attempt hears from outside its ranks, and tells outside. */
interface AttemptControl {
  /** Set while an attempt runs: stops its ranks because of another node. */
  abort?: (why: string, fatal: boolean) => void;
  /** Called once when this node's ranks fail (so the other nodes can stop theirs now). */
  onLocalFailure: (what: string) => void;
  heartbeat: HeartbeatConfig;
  /** After a shrink: what happened, for the ranks' [elastic] line (FLOTILLA_ELASTIC). */
  elastic?: string;
  /** The attempt running now. */
  attempt?: number;
  /** An elastic job: the world size of its first meeting (FLOTILLA_ELASTIC_WORLD, [Note: elastic micro-batches]). */
  firstWorld?: number;
  /** The job's identity, the same on every host ([Note: run lock]). */
  job: string;
}

/** The file whose presence asks attempt k's ranks to stop at their next checkpoint (a host joins). */
const regroupFile = (dir: string, attempt: number): string => join(dir, `regroup.${attempt}`);

/** Runs one attempt: every local rank, until all have exited. */
async function runAttempt(o: RunOptions, attempt: number, port: number, io: SupervisorIO, dir: string, ctl: AttemptControl): Promise<Outcome> {
  const statusFile = join(dir, `status.${attempt}`);
  const [cmd, args] = commandFor(o.script, o.scriptArgs);
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    ...launcherVars({
      attempt, maxRestarts: o.maxRestarts, job: ctl.job, statusFile, regroupFile: regroupFile(dir, attempt),
      terminal: launcherTerminal(), // rank 0 may draw a progress bar on it
      ...(ctl.elastic !== undefined ? { elastic: ctl.elastic } : {}), ...(ctl.firstWorld !== undefined ? { firstWorld: ctl.firstWorld } : {}),
    }),
  };
  const ranks = Array.from({ length: o.nproc }, (_, local) => o.nodeRank * o.nproc + local);
  const sup = new Supervisor({ io, ranks, heartbeat: ctl.heartbeat, statusFile, onLocalFailure: ctl.onLocalFailure });
  ctl.abort = (why, fatal) => sup.abort(why, fatal);
  try {
    if (o.backend === 'mpi') await runMpirun({ nproc: o.nproc, cmd, args, env }, io, sup);
    else {
      if (o.nnodes === 1) env.FLOTILLA_STORE_FILE = join(dir, `store.${attempt}`);
      else delete env.FLOTILLA_STORE_FILE;
      await runDirect({ nproc: o.nproc, nodeRank: o.nodeRank, worldSize: o.nnodes * o.nproc, cmd, args, env, masterAddr: o.masterAddr, masterPort: port }, io, sup);
    }
  } finally {
    ctl.abort = undefined;
  }
  return sup.finish();
}

/**
 * Runs the ranks, restarts the group up to --max-restarts times after a failure, and resolves to
 * the exit code: 0 when every rank exited 0; the failing rank's exit code (128 + signal number if it
 * was killed); 128 + the signal when the launcher was interrupted; 2 for a bad environment.
 */
export async function launch(o: RunOptions, ioOpts: LauncherIO = {}): Promise<number> {
  const io = launcherIO(ioOpts);
  const say = (msg: string): void => void io.stderr.write(`flotilla run: ${msg}\n`);
  let heartbeat: HeartbeatConfig;
  try {
    heartbeat = heartbeatConfig();
  } catch (e) {
    say((e as Error).message);
    return 2;
  }
  if (o.nnodes > 1 && !(o.masterAddrs ?? [o.masterAddr]).every(isLoopback) && !process.env.FLOTILLA_JOB_SECRET) {
    say(
      `--nnodes ${o.nnodes} with --master-addr ${o.masterAddr}: set FLOTILLA_JOB_SECRET to the same random value on every node ` +
        '(e.g. `export FLOTILLA_JOB_SECRET=$(openssl rand -hex 32)`, then copy it); the rendezvous store admits only ranks that know it',
    );
    return 2;
  }
  // Rendezvous files (one node) and status files in a directory only this user can enter (mkdtemp makes it 0700).
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-'));
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
    return await attempts(o, io, dir, heartbeat);
  } finally {
    if (watchParent) clearInterval(watchParent);
    rmSync(dir, { recursive: true, force: true });
  }
}

/** The heartbeat port of a multi-node job: FLOTILLA_HEARTBEAT_PORT, else just above the store ports of the restarts. */
export function heartbeatPort(o: RunOptions): number {
  const raw = process.env.FLOTILLA_HEARTBEAT_PORT?.trim();
  if (raw) return Number(raw);
  return (o.masterPort ?? DEFAULT_MASTER_PORT) + o.maxRestarts + 1;
}

/**
 * The store port of attempt k on several nodes: --master-port + k, stepping over the heartbeat's
 * (an elastic job's meetings go on counting attempts past the restarts).
 */
function storePort(o: RunOptions, attempt: number, hbPort: number): number {
  const p = (o.masterPort ?? DEFAULT_MASTER_PORT) + attempt;
  return p >= hbPort ? p + 1 : p;
}

// [Note: elastic shrink] With --nnodes MIN:MAX, a lost host (found by the heartbeat, as above) does
// not end the job while at least MIN hosts remain: every survivor stops its ranks, and they meet
// again without it. Node ranks are renumbered in the order of the old ones, so the new node 0 is
// the lowest surviving node, at the address node 0 saw it connect from at the first meeting (the
// roster); a surviving node 0 stays where it was. Store ports go on counting attempts, the heartbeat
// keeps its port (on the new node 0). The ranks start on the smaller world as a restarted group:
// `flotilla train` derives the layout again and resumes from the newest checkpoint, and
// FLOTILLA_ELASTIC tells rank 0 what happened for its [elastic] line. No host is special after the start.
// A meeting's first attempt that fails is retried once, not counted against --max-restarts, as the
// meeting itself is not: what the lost host left behind may take a moment to go. The new rank 0 takes
// over the run directory's lock its job's earlier rank 0 left ([Note: run lock]).
//
// [Note: elastic grow] A host started with the job's command while it runs on fewer than MAX hosts
// (a lost one restarted, or a new one with a --node-rank not in the job) proves the secret to node 0
// as a first meeting's node would. Node 0 tells every launcher, and it, the next meeting: the hosts
// in the job and the new one last, and its generation. Each launcher creates its attempt's
// FLOTILLA_REGROUP_FILE; the ranks see it at a step boundary, agree (one all-reduce), save at their
// next scheduled checkpoint, say so in the status file and exit 0; the launchers then meet again,
// larger, and the ranks resume from that checkpoint (the new host receives its files). Node 0 tells
// the next meeting also to a node that reaches this one after the host asked, and each launcher
// says goodbye on the heartbeat once its ranks have stopped for it, so its connection closing is
// the meeting ending, not a lost host ([Note: grow told to every node] in heartbeat.ts). A job down
// to one host keeps node 0's heartbeat listening at its address of the first meeting (its ranks meet
// on loopback), so a host can still ask it.

/** What the heartbeat of one meeting heard: a host lost, a host that joins (the next meeting). */
interface Heard {
  lost?: { why: string; node: number | undefined };
  grow?: Grow;
}

/** The attempts of the job, meeting after meeting, as the restart state machine (restarts.ts) decides. */
async function attempts(o: RunOptions, io: SupervisorIO, dir: string, heartbeat: HeartbeatConfig): Promise<number> {
  const say = (msg: string): void => void io.stderr.write(`flotilla run: ${msg}\n`);
  const hbPort = heartbeatPort(o);
  const limits: RestartLimits = { nproc: o.nproc, maxNodes: o.nnodes, minNodes: o.minNodes ?? o.nnodes, maxRestarts: o.maxRestarts };
  const job = jobIdentity({ nnodes: o.nnodes, masterAddr: o.masterAddr, masterPort: o.masterPort, secret: process.env.FLOTILLA_JOB_SECRET ?? '' });
  let s = initialState(o);
  let act: RestartAction = { do: 'meet', patient: false };
  const apply = (e: RestartEvent): RestartAction => {
    const t = nextStep(s, e, limits);
    if (t.say !== undefined) say(t.say);
    s = t.state;
    return t.act;
  };
  for (;;) {
    if (act.do === 'exit') return act.code;
    const patient = act.do === 'meet' && act.patient;
    const here = s;
    const cur: RunOptions = here.first === 0 ? o : { ...o, nnodes: here.nnodes, nodeRank: here.nodeRank, masterAddr: here.masterAddr, masterPort: o.masterPort ?? DEFAULT_MASTER_PORT };
    const ctl: AttemptControl = {
      heartbeat, job, onLocalFailure: () => undefined, ...(here.elastic !== undefined ? { elastic: here.elastic } : {}),
      ...(limits.minNodes < o.nnodes ? { firstWorld: o.nnodes * o.nproc } : {}),
    };
    const heard: Heard = {};
    let link: NodeLink | undefined;
    // Down to one host below MAX: its heartbeat still listens, where the others knew it, for a host that asks.
    const alone = here.nnodes === 1 && here.members !== undefined && o.nnodes > 1;
    if (here.nnodes > 1 || alone) {
      try {
        link = await startLink(cur, here, { patient, alone, heartbeat, hbPort, limits, ctl, heard, dir, say });
      } catch (e) {
        say((e as Error).message);
        return 1;
      }
      if (link.grow !== undefined) {
        // This host joined a running job: it comes in at the meeting node 0 announced.
        const g = link.grow;
        await link.close();
        act = apply({ on: 'joined', grow: g });
        continue;
      }
      const l = link;
      ctl.onLocalFailure = (what) => l.announceFailure(`node ${cur.nodeRank}: ${what}`);
    }
    try {
      act = { do: 'run' };
      while (act.do === 'run') {
        const e = await runOne(cur, s, io, dir, ctl, heard, link, hbPort, limits);
        if (typeof e === 'number') return e;
        s = heardRoster(s, link?.roster);
        act = apply(e);
      }
    } finally {
      await link?.close();
    }
  }
}

/** Starts a meeting's heartbeat (heartbeat.ts); what it hears goes into `heard` and the attempt running. */
function startLink(
  cur: RunOptions, here: RestartState,
  m: { patient: boolean; alone: boolean; heartbeat: HeartbeatConfig; hbPort: number; limits: RestartLimits; ctl: AttemptControl; heard: Heard; dir: string; say: (msg: string) => void },
): Promise<NodeLink> {
  const { ctl, heard, say } = m;
  const regroup = (g: Grow): void => {
    heard.grow = g;
    if (ctl.attempt !== undefined) writeFileSync(regroupFile(m.dir, ctl.attempt), '');
    say(`[elastic] first-meeting node ${g.ids[g.ids.length - 1]} (${g.addrs[g.addrs.length - 1]}) joins: the ranks stop at their next checkpoint and the job meets again on ${g.ids.length} hosts`);
  };
  const members = here.members;
  return NodeLink.start({
    nodeRank: cur.nodeRank, nnodes: cur.nnodes, nproc: cur.nproc, host: m.alone ? members!.addrs[0]! : cur.masterAddr, port: m.hbPort,
    secret: process.env.FLOTILLA_JOB_SECRET ?? '', config: m.heartbeat,
    joinTimeoutMs: Number(process.env.FLOTILLA_TIMEOUT_MS?.trim() || 300_000), generation: here.first,
    ...(here.first === 0 && cur.masterAddrs ? { hosts: cur.masterAddrs } : {}), patient: m.patient,
    onPeerDown: (why, fatal, node) => {
      if (fatal) heard.lost = { why, node };
      if (ctl.abort) ctl.abort(why, fatal);
      else if (fatal && !canShrink(here, m.limits)) say(why);
    },
    onGrow: regroup,
    ...(cur.nodeRank === 0 && members !== undefined ? {
      onAsk: (node: number, addr: string): Grow | string => {
        if (heard.grow !== undefined) return 'another host is joining; start this one again after it has';
        if (cur.nnodes >= m.limits.maxNodes) return `the job runs on ${cur.nnodes} hosts, its --nnodes maximum`;
        if (members.ids.includes(node)) return `node ${node} of the first meeting is in the job; give a joining host the --node-rank it had, or one not in the job`;
        const g: Grow = { addrs: [...members.addrs, addr], ids: [...members.ids, node], generation: (ctl.attempt ?? here.first) + 1 };
        regroup(g);
        return g;
      },
    } : {}),
  });
}

/**
 * Runs attempt s.attempt of a meeting, unless a host was lost already, and says what happened as the
 * state machine's event; a number is an exit code (no free port).
 */
async function runOne(
  o: RunOptions, s: RestartState, io: SupervisorIO, dir: string, ctl: AttemptControl, heard: Heard, link: NodeLink | undefined, hbPort: number, limits: RestartLimits,
): Promise<RestartEvent | number> {
  const attempt = s.attempt;
  const lost = (): Heard['lost'] => heard.lost; // set by the heartbeat meanwhile
  const lostEvent = (started: boolean): RestartEvent => ({ on: 'lost', ...lost()!, started });
  if (lost() !== undefined) return lostEvent(false);
  let port: number;
  if (o.nnodes > 1 || s.first > 0) port = storePort(o, attempt, hbPort);
  else if (o.masterPort !== undefined) port = o.masterPort;
  else {
    try {
      port = await freePort(o.masterAddr);
    } catch (e) {
      io.stderr.write(`flotilla run: could not find a free port on --master-addr ${o.masterAddr} (${(e as Error).message}); is it an address of this host? Pass --master-port\n`);
      return 1;
    }
  }
  ctl.attempt = attempt;
  if (heard.grow !== undefined) writeFileSync(regroupFile(dir, attempt), ''); // a host asked to join between attempts
  const outcome = await runAttempt(o, attempt, port, io, dir, ctl);
  const wait = async (ms: number, done: () => boolean): Promise<void> => {
    for (const until = Date.now() + ms; !done() && Date.now() < until;) await new Promise((r) => setTimeout(r, 100));
  };
  // The ranks stopped at a checkpoint for a host that joins: not done, meet again. They stop so
  // only when some launcher was told of the next meeting, and node 0 tells every one; should this
  // one not have heard yet, it waits a heartbeat timeout for it rather than end the run.
  if (outcome.kind === 'ok' && regrouped(join(dir, `status.${attempt}`))) {
    await wait(ctl.heartbeat.timeoutMs, () => heard.grow !== undefined || lost() !== undefined);
    if (heard.grow === undefined) return { on: 'regroupUnheard', ...(lost() !== undefined ? { lost: lost()!.why } : {}) };
    link?.announceDone(); // its connection closing now is the meeting ending, not a lost host
    return { on: 'regrouped', grow: heard.grow };
  }
  if (outcome.kind === 'ok') link?.announceDone();
  if (outcome.kind === 'ok' || outcome.kind === 'interrupted' || !canShrink(s, limits)) return { on: 'ended', outcome };
  // Elastic: ranks that lost a peer host often fail (a broken connection) before the heartbeat
  // names the host; give it the time it takes to, then shrink instead of failing.
  await wait(ctl.heartbeat.timeoutMs + 2 * ctl.heartbeat.intervalMs, () => lost() !== undefined);
  return lost() !== undefined ? lostEvent(true) : { on: 'ended', outcome };
}
