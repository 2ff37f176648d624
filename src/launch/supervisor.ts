// One attempt's rank supervisor, the same for both ways of starting ranks (direct.ts: each rank a
// child of the launcher; mpirun.ts: the ranks under mpirun). The backend starts the processes and
// reports each rank's exit; the supervisor decides what that means and stops the rest:
//
// - a rank that exits non-zero or is killed stops the others (SIGTERM, then SIGKILL after the grace
//   period) and is named;
// - a rank that exits after a collective timed out (it says so in the status file, see
//   src/distributed/launcher_channel.ts) gave up waiting for a peer: the supervisor waits a moment for
//   the others to time out too and names the rank(s) still running that did not, the one everybody
//   waited for;
// - a rank stopped (SIGSTOP, a debugger) for the heartbeat timeout is hung (heartbeat.ts) and killed;
// - SIGINT/SIGTERM to the launcher go to the ranks (a second one kills them); a SIGINT reaches the
//   ranks' own processes so that flotilla ranks save a checkpoint and stop after their step, and a run
//   whose ranks all stopped cleanly after it succeeded; in a Slurm job SIGUSR1 (the time limit is
//   near) and SIGTERM (scancel, preemption) do the same, and repeated ones are forwarded too, since
//   Slurm kills what is left itself ([Note: slurm stop] in src/train/checkpointing.ts);
// - another node's failure (the heartbeat) stops this node's ranks.
import { constants as osConstants } from 'node:os';
import { timedOutRanks } from '../distributed/launcher_channel.js';
import { inSlurmJob } from '../distributed/slurm_vars.js';
import { watchStopped, type HeartbeatConfig } from './heartbeat.js';

export interface SupervisorIO {
  /** Where rank stdout lines go. */
  stdout: { write(s: string): unknown };
  /** Where rank stderr lines and the launcher's own messages go. */
  stderr: { write(s: string): unknown };
  /** Forward SIGINT/SIGTERM received by this process to the ranks. */
  handleSignals: boolean;
  /** How long stopped ranks get between SIGTERM and SIGKILL. */
  graceMs: number;
}

/** The processes of one attempt, as its backend started them. */
export interface RankProcesses {
  /** Sends a signal to every rank still running (SIGKILL: to everything the backend started). */
  signal(signal: NodeJS.Signals): void;
  /** The ranks' own processes (not wrappers or output pipes), for SIGINT, SIGCONT and the hung-rank watch. */
  pids(): { rank: number; pid: number }[];
}

export type Outcome =
  | { kind: 'ok' }
  | { kind: 'failed'; rank: number; code: number | null; signal: NodeJS.Signals | null; stalled?: { ranks: number[]; timedOut: number[] }; hungMs?: number; what?: string }
  | { kind: 'interrupted'; signal: NodeJS.Signals }
  /** Another node failed (fatal: false) or was lost (fatal: true); this node's ranks were stopped. */
  | { kind: 'peer'; why: string; fatal: boolean };

export type Failure = Extract<Outcome, { kind: 'failed' }>;

export function describeExit(code: number | null, signal: NodeJS.Signals | null): string {
  return signal ? `was killed by ${signal}` : `exited with code ${code}`;
}

export function plural(n: number, word: string): string {
  return `${word}${n > 1 ? 's' : ''}`;
}

/** What the final line says about a failure. */
export function describeFailure(f: Failure): string {
  if (f.what !== undefined) return f.what;
  if (f.hungMs !== undefined) return `rank ${f.rank} hung: stopped for ${f.hungMs} ms (SIGSTOP or a debugger; FLOTILLA_HEARTBEAT_TIMEOUT_MS)`;
  if (f.stalled) {
    const { ranks, timedOut } = f.stalled;
    return `${plural(ranks.length, 'rank')} ${ranks.join(', ')} stalled: ${plural(timedOut.length, 'rank')} ${timedOut.join(', ')} timed out waiting in a collective`;
  }
  return `rank ${f.rank} ${describeExit(f.code, f.signal)}`;
}

export function signalCode(signal: NodeJS.Signals): number {
  return 128 + ((osConstants.signals as Record<string, number>)[signal] ?? 1);
}

/** How long, after the first rank times out, the supervisor waits for the others to time out too. */
const STALL_WINDOW_MS = 3000;

export interface SupervisorOptions {
  io: SupervisorIO;
  /** The global ranks this launcher starts. */
  ranks: number[];
  heartbeat: HeartbeatConfig;
  /** Where the ranks report timed-out collectives (FLOTILLA_STATUS_FILE). */
  statusFile: string;
  /** Called once when this node's ranks fail (so the other nodes can stop theirs now). */
  onLocalFailure: (what: string) => void;
}

export class Supervisor {
  /** Ranks that have not exited yet. */
  readonly running: Set<number>;
  private outcome: Outcome = { kind: 'ok' };
  private stopping = false;
  private cleanExits = true; // every rank exited 0 (an interrupted run whose ranks stopped cleanly succeeded)
  private procs: RankProcesses | undefined;
  private killTimer: NodeJS.Timeout | undefined;
  private stallTimer: NodeJS.Timeout | undefined;
  private firstTimeout: { rank: number; code: number | null; signal: NodeJS.Signals | null } | undefined;
  private readonly stopWatch: () => void;
  private readonly onSignal = (signal: NodeJS.Signals): void => this.signalled(signal);
  private readonly slurm = inSlurmJob();
  private readonly signals: NodeJS.Signals[] = this.slurm ? ['SIGINT', 'SIGTERM', 'SIGUSR1'] : ['SIGINT', 'SIGTERM'];

  /** Whether flotilla ranks answer `signal` with a checkpoint and a clean stop ([Note: slurm stop]). */
  private savesOn(signal: NodeJS.Signals): boolean {
    return signal === 'SIGINT' || (this.slurm && (signal === 'SIGUSR1' || signal === 'SIGTERM'));
  }

  constructor(private readonly o: SupervisorOptions) {
    this.running = new Set(o.ranks);
    this.stopWatch = watchStopped(
      () => this.pids().map((p) => ({ label: String(p.rank), pid: p.pid })),
      o.heartbeat,
      (label, pid, ms) => this.hung(Number(label), pid, ms),
    );
    if (o.io.handleSignals) for (const sig of this.signals) process.on(sig, this.onSignal);
  }

  private say(msg: string): void {
    this.o.io.stderr.write(`flotilla run: ${msg}\n`);
  }

  /** The backend's processes, once started. */
  attach(procs: RankProcesses): void {
    this.procs = procs;
  }

  private pids(): { rank: number; pid: number }[] {
    return (this.procs?.pids() ?? []).filter((p) => this.running.has(p.rank));
  }

  /** Signals every running rank; unless it is SIGKILL, SIGKILL follows after the grace period. */
  private stopAll(signal: NodeJS.Signals): void {
    this.procs?.signal(signal);
    if (signal === 'SIGKILL') return;
    for (const { pid } of this.pids()) kill(pid, 'SIGCONT'); // a stopped rank acts on the signal only once continued
    if (this.killTimer !== undefined) return;
    this.killTimer = setTimeout(() => {
      if (this.running.size > 0) this.say(`rank(s) ${[...this.running].join(', ')} still running after ${this.o.io.graceMs} ms; killing`);
      this.procs?.signal('SIGKILL');
    }, this.o.io.graceMs);
    this.killTimer.unref();
  }

  private fail(f: Failure, stopMessage: string): void {
    this.stopping = true;
    this.outcome = f;
    this.say(stopMessage);
    this.o.onLocalFailure(describeFailure(f));
    this.stopAll('SIGTERM');
  }

  private others(n: number): string {
    return n > 0 ? `the other ${n} ${plural(n, 'rank')}` : '';
  }

  /**
   * A rank ended: exit code or signal, or startError when its process could not be started. Call
   * it once its output is drained, so the launcher's verdict follows the rank's last words.
   */
  rankExited(rank: number, code: number | null, signal: NodeJS.Signals | null, startError?: string): void {
    if (!this.running.delete(rank)) return;
    const failed = code !== 0 || signal !== null || startError !== undefined;
    if (failed) this.cleanExits = false;
    if (failed && !this.stopping) {
      if (startError === undefined && timedOutRanks(this.o.statusFile).has(rank)) {
        // It gave up waiting for a peer: the cause is the rank it waited for. Give the others a
        // moment to time out as well, then name the one(s) still running that did not.
        this.firstTimeout ??= { rank, code, signal };
        this.stallTimer ??= setTimeout(() => this.decideStall(), STALL_WINDOW_MS);
        const timedOut = timedOutRanks(this.o.statusFile);
        if ([...this.running].every((r) => timedOut.has(r))) this.decideStall();
        return;
      }
      const f: Failure = startError !== undefined
        ? { kind: 'failed', rank, code: 127, signal: null, what: `rank ${rank} could not start (${startError})` }
        : { kind: 'failed', rank, code, signal };
      const others = this.others(this.running.size);
      this.fail(f, `${describeFailure(f)}${others ? `; stopping ${others}` : ''}`);
    }
    if (this.stopping || this.running.size === 0) this.decideStall();
  }

  private decideStall(): void {
    if (this.stallTimer) clearTimeout(this.stallTimer);
    this.stallTimer = undefined;
    const first = this.firstTimeout;
    if (first === undefined || this.stopping) return;
    const timedOut = timedOutRanks(this.o.statusFile);
    const suspects = [...this.running].filter((r) => !timedOut.has(r)).sort((a, b) => a - b);
    const gaveUp = [...timedOut].sort((a, b) => a - b);
    if (suspects.length > 0) {
      const f: Failure = { kind: 'failed', rank: suspects[0]!, code: first.code, signal: first.signal, stalled: { ranks: suspects, timedOut: gaveUp } };
      this.fail(f, `${describeFailure(f)}; stopping the other ${this.running.size} ${plural(this.running.size, 'rank')}`);
    } else {
      const f: Failure = { kind: 'failed', rank: first.rank, code: first.code, signal: first.signal };
      this.fail(f, `rank ${first.rank} timed out waiting in a collective; no rank on this node is left to blame (a rank on another node may have stalled)`);
    }
  }

  private hung(rank: number, pid: number, ms: number): void {
    if (this.stopping) return;
    const f: Failure = { kind: 'failed', rank, code: null, signal: null, hungMs: ms };
    const others = this.others(this.running.size - 1);
    kill(pid, 'SIGKILL'); // stopped, it would not act on SIGTERM
    this.fail(f, `${describeFailure(f)}; stopping it${others ? ` and ${others}` : ''}`);
  }

  /** Another node failed or was lost: stop this node's ranks. */
  abort(why: string, fatal: boolean): void {
    if (this.stopping) return;
    this.stopping = true;
    this.outcome = { kind: 'peer', why, fatal };
    this.say(`${why}; stopping the ${this.running.size} ${plural(this.running.size, 'rank')} on this node`);
    this.stopAll('SIGTERM');
  }

  /** The backend itself failed (nothing started, or it ended before every rank reported). */
  backendFailed(what: string, code: number): void {
    this.cleanExits = false;
    if (this.outcome.kind !== 'ok') return;
    const rank = [...this.running][0] ?? this.o.ranks[0]!;
    this.stopping = true;
    this.outcome = { kind: 'failed', rank, code, signal: null, what };
    this.say(what);
  }

  private signalled(signal: NodeJS.Signals): void {
    const slurmStop = signal !== 'SIGINT' && this.savesOn(signal);
    if (slurmStop && (this.outcome.kind === 'interrupted' || this.outcome.kind === 'ok')) {
      // Slurm's stop: to the ranks' own processes, no deadline of ours (Slurm's KillWait or GraceTime is it).
      if (this.outcome.kind === 'ok') this.outcome = { kind: 'interrupted', signal };
      this.stopping = true;
      this.say(`received ${signal}; forwarding it to the ranks (they save a checkpoint after this step)`);
      for (const { pid } of this.pids()) kill(pid, signal);
      return;
    }
    if (this.outcome.kind === 'interrupted') {
      this.say(`second ${signal}: killing the ranks`);
      this.stopAll('SIGKILL');
      return;
    }
    this.outcome = { kind: 'interrupted', signal };
    this.stopping = true;
    const ranks = this.pids();
    if (signal === 'SIGINT' && ranks.length > 0) {
      // A SIGINT asks flotilla ranks to save a checkpoint and stop after their current step: no
      // deadline but a second Ctrl-C. It goes to the ranks themselves (mpirun would end them at once).
      this.say(`received ${signal}; forwarding it to the ranks (Ctrl-C again kills them)`);
      for (const { pid } of ranks) kill(pid, 'SIGINT');
      return;
    }
    this.say(`received ${signal}; forwarding it to the ranks`);
    this.stopAll(signal === 'SIGINT' ? 'SIGTERM' : signal);
  }

  /** Every process of the attempt is gone: removes timers and handlers; the attempt's outcome. */
  finish(): Outcome {
    this.stopWatch();
    if (this.killTimer) clearTimeout(this.killTimer);
    if (this.stallTimer) clearTimeout(this.stallTimer);
    this.stallTimer = undefined;
    if (this.o.io.handleSignals) for (const sig of this.signals) process.off(sig, this.onSignal);
    if (this.outcome.kind === 'interrupted' && this.savesOn(this.outcome.signal) && this.cleanExits && this.running.size === 0) return { kind: 'ok' };
    return this.outcome;
  }
}

function kill(pid: number, signal: NodeJS.Signals): void {
  try {
    process.kill(pid, signal);
  } catch {
    // gone meanwhile
  }
}
