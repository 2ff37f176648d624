// The launcher's restart decisions as one state machine: where this host stands in the job (the
// meeting, its attempts, the hosts still in it) and, for each thing that happens to an attempt, what
// the launcher does next: run another attempt in the same meeting, meet again (a shrink, a grow, a
// host joining), or exit with a code. Pure: launcher.ts runs the ranks and the heartbeat, and turns
// what it sees into the events here ([Note: elastic shrink], [Note: elastic grow] in launcher.ts).
import type { Grow } from './heartbeat.js';
import { describeFailure, signalCode, type Outcome } from './supervisor.js';

/** What does not change while the job runs: the command line's numbers. */
export interface RestartLimits {
  nproc: number;
  /** --nnodes (MAX of MIN:MAX). */
  maxNodes: number;
  /** MIN of --nnodes MIN:MAX (default MAX): the job may shrink while at least this many hosts remain. */
  minNodes: number;
  maxRestarts: number;
}

/** The hosts still in an elastic job. */
export interface Membership {
  /** Their node ranks at the first meeting, in order. */
  ids: number[];
  /** Their addresses (the first meeting's roster), in the same order. */
  addrs: string[];
}

export interface RestartState {
  /** The attempt that runs next, or runs now. */
  attempt: number;
  /** The meeting's first attempt (its generation): 0 for the job's first meeting. */
  first: number;
  /** This host's node rank at the first meeting. */
  me: number;
  /** The meeting: how many hosts, this host's node rank in it, and node 0's address (the command line's in the first). */
  nnodes: number;
  nodeRank: number;
  masterAddr: string;
  /** The hosts still in the job, once known (the first meeting's roster, then what is left of it). */
  members?: Membership;
  /** What the last meeting was, for rank 0's [elastic] line (FLOTILLA_ELASTIC). */
  elastic?: string;
}

export type RestartEvent =
  /** An attempt ended: its ranks all exited 0 (and none stopped for a host that joins), were interrupted, or failed. */
  | { on: 'ended'; outcome: Outcome }
  /** A host was lost (the heartbeat named it): at the end of the attempt (started), or before it started. */
  | { on: 'lost'; why: string; node: number | undefined; started: boolean }
  /** The ranks stopped at a checkpoint for a host that joins, and node 0 named the next meeting. */
  | { on: 'regrouped'; grow: Grow }
  /** The ranks stopped for a host that joins, but node 0 never named the next meeting. */
  | { on: 'regroupUnheard'; lost?: string }
  /** This host asked a running job to take it in, and node 0 named the meeting it joins. */
  | { on: 'joined'; grow: Grow };

export type RestartAction =
  /** Run attempt state.attempt in the current meeting. */
  | { do: 'run' }
  /** Meet (start the heartbeat) as state says; patient: this host joins a running job and waits for the others to save. */
  | { do: 'meet'; patient: boolean }
  | { do: 'exit'; code: number };

export interface Transition {
  state: RestartState;
  act: RestartAction;
  /** The launcher's line about it, if any. */
  say?: string;
}

/** The state before the first meeting. */
export function initialState(o: { nnodes: number; nodeRank: number; masterAddr: string }): RestartState {
  return { attempt: 0, first: 0, me: o.nodeRank, nnodes: o.nnodes, nodeRank: o.nodeRank, masterAddr: o.masterAddr };
}

/** Whether the job may lose a host of this meeting and go on. */
export function canShrink(s: RestartState, l: RestartLimits): boolean {
  return l.minNodes < s.nnodes;
}

/** The [elastic] words for a meeting that took a host in. */
function joinedWords(g: Grow, nproc: number): string {
  return `first-meeting node ${g.ids[g.ids.length - 1]} joined at ${g.addrs[g.addrs.length - 1]}; continuing on ${g.ids.length} host(s), ` +
    `${g.ids.length * nproc} rank(s) (first-meeting nodes ${g.ids.join(', ')}; node 0 at ${g.addrs[0]})`;
}

const ranks = (n: number): string => `${n} local rank${n > 1 ? 's' : ''}`;
const exit = (s: RestartState, code: number, say?: string): Transition => ({ state: s, act: { do: 'exit', code }, ...(say !== undefined ? { say } : {}) });

/** The meeting a grow names, with this host placed in it. */
function growMeeting(s: RestartState, g: Grow, nodeRank: number, l: RestartLimits): RestartState {
  return {
    ...s, attempt: g.generation, first: g.generation, members: { ids: g.ids, addrs: g.addrs },
    nnodes: g.ids.length, nodeRank, masterAddr: g.addrs[0]!, elastic: joinedWords(g, l.nproc),
  };
}

/** A failed attempt: run again, or exit. */
function failed(s: RestartState, outcome: Exclude<Outcome, { kind: 'ok' | 'interrupted' }>, l: RestartLimits): Transition {
  const what = outcome.kind === 'peer' ? outcome.why : describeFailure(outcome);
  if (outcome.kind === 'peer' && outcome.fatal) {
    // A host lost: the launcher reports a job that can shrink as 'lost'; this one cannot.
    return canShrink(s, l) ? lost(s, { why: what, node: undefined, started: true }, l) : exit(s, 1, `failed: ${what}`);
  }
  const next = { ...s, attempt: s.attempt + 1 };
  // The first attempt of a meeting after a shrink or a grow is retried once, as the meeting itself
  // was: what the lost host left behind may take a moment to go ([Note: elastic shrink]).
  if (s.first > 0 && s.attempt === s.first) {
    return { state: next, act: { do: 'run' }, say: `${what}; restarting all ${ranks(l.nproc)} (the first attempt after the hosts met again)` };
  }
  if (s.attempt < l.maxRestarts) {
    return { state: next, act: { do: 'run' }, say: `${what}; restarting all ${ranks(l.nproc)} (restart ${s.attempt + 1} of ${l.maxRestarts})` };
  }
  if (outcome.kind === 'peer') return exit(s, 1, `failed: ${what}`);
  const after = l.maxRestarts > 0 ? ` (after ${l.maxRestarts} restart${l.maxRestarts > 1 ? 's' : ''})` : '';
  const code = outcome.signal ? signalCode(outcome.signal) : outcome.code !== null && outcome.code > 0 && outcome.code < 256 ? outcome.code : 1;
  return exit(s, code, `failed: ${what}${after}`);
}

/** A lost host: shrink ([Note: elastic shrink]) or exit. */
function lost(s: RestartState, e: { why: string; node: number | undefined; started: boolean }, l: RestartLimits): Transition {
  if (!canShrink(s, l)) return exit(s, 1, `failed: ${e.why}`);
  const m = s.members;
  if (m === undefined || e.node === undefined || e.node >= m.ids.length) {
    return exit(s, 1, `failed: ${e.why} (the hosts' addresses were not all known yet, so the others cannot meet again)`);
  }
  const lostId = m.ids[e.node]!;
  const members = { ids: m.ids.filter((_, k) => k !== e.node), addrs: m.addrs.filter((_, k) => k !== e.node) };
  if (members.ids.length < l.minNodes) {
    return exit(s, 1, `failed: ${e.why}; ${members.ids.length} host(s) left, fewer than --nnodes ${l.minNodes}:${l.maxNodes} allows`);
  }
  const nnodes = members.ids.length;
  const nodeRank = members.ids.indexOf(s.me);
  const masterAddr = nnodes === 1 ? '127.0.0.1' : members.addrs[0]!;
  const first = e.started ? s.attempt + 1 : s.attempt;
  const elastic = `lost node ${lostId} (${e.why}); continuing on ${nnodes} host(s), ${nnodes * l.nproc} rank(s) (first-meeting nodes ${members.ids.join(', ')}; node 0 at ${masterAddr})`;
  return {
    state: { ...s, attempt: first, first, members, nnodes, nodeRank, masterAddr, elastic },
    act: { do: 'meet', patient: false },
    say: `[elastic] ${elastic}; this host is node ${nodeRank} now; restarting its ${l.nproc} rank(s) from the latest checkpoint`,
  };
}

/** What the launcher does after `e`. */
export function nextStep(s: RestartState, e: RestartEvent, l: RestartLimits): Transition {
  switch (e.on) {
    case 'ended':
      if (e.outcome.kind === 'ok') return exit(s, 0);
      if (e.outcome.kind === 'interrupted') return exit(s, signalCode(e.outcome.signal));
      return failed(s, e.outcome, l);
    case 'lost':
      return lost(s, e, l);
    case 'regrouped': {
      const next = growMeeting(s, e.grow, e.grow.ids.indexOf(s.me), l);
      return { state: next, act: { do: 'meet', patient: false }, say: `[elastic] ${next.elastic}; this host is node ${next.nodeRank} now; restarting its ${l.nproc} rank(s) from the checkpoint just saved` };
    }
    case 'regroupUnheard':
      return exit(s, 1, `failed: the ranks stopped at a checkpoint for a host that joins, but node 0 never named the next meeting${e.lost !== undefined ? ` (${e.lost})` : ''}`);
    case 'joined': {
      const next = growMeeting(s, e.grow, e.grow.ids.length - 1, l);
      return { state: next, act: { do: 'meet', patient: true }, say: `[elastic] joined a running job: this host is node ${next.nodeRank} of ${next.nnodes}; its ranks start once the others have saved` };
    }
  }
}

/** The state once the first meeting's roster (every host's address, node 0 first) is heard; later meetings' members are its survivors. */
export function heardRoster(s: RestartState, addrs: readonly string[] | undefined): RestartState {
  return s.members === undefined && addrs !== undefined ? { ...s, members: { ids: addrs.map((_, k) => k), addrs: [...addrs] } } : s;
}
