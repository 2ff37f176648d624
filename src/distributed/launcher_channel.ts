// A rank's line to its launcher. `flotilla run` names a file in FLOTILLA_STATUS_FILE (a new one per
// attempt, in a directory only the launcher's user can enter); a rank appends one JSON line per event
// there, with its rank. Events: a collective that timed out (the launcher uses it to tell the ranks
// that gave up waiting from the rank they waited for, and to name that one: a stalled rank never
// fails by itself); and a run that stopped at a checkpoint so an elastic job can meet again with a
// host that joins (`regroup`: exiting 0 then does not mean the run is done). A file, not a pipe, because mpirun passes no extra descriptors to its
// ranks, and because the line is on disk before the rank exits: the launcher, which acts on the
// exit, never misses it.
//
// The other way, FLOTILLA_REGROUP_FILE names a file the launcher of an elastic job creates when a
// host joins: the ranks look for it at each step boundary and stop at their next checkpoint.
//
// The variables (launcher_env.ts) are read and removed once, when this module loads, so processes a
// rank starts do not use them.
import { appendFileSync, existsSync, readFileSync } from 'node:fs';
import { forgetLauncherFiles, launcherEnv } from './launcher_env.js';

const told = launcherEnv();
forgetLauncherFiles();
const regroupFile = told.regroupFile;

/** Whether this rank's launcher asks the run to stop at its next checkpoint (a host joins). */
export function regroupAsked(): boolean {
  return regroupFile !== undefined && existsSync(regroupFile);
}

let target: { file: string; rank: number } | undefined = (() => {
  const rank = Number(process.env.RANK ?? process.env.OMPI_COMM_WORLD_RANK);
  return told.statusFile !== undefined && Number.isInteger(rank) && rank >= 0 ? { file: told.statusFile, rank } : undefined;
})();

export type RankEvent =
  | {
    event: 'timeout';
    /** The collective and its group, for the launcher's message. */
    op: string;
    group: string;
  }
  | { event: 'regroup'; step: number };

/** Tells the launcher (if any) about an event; never throws. */
export function tellLauncher(e: RankEvent): void {
  if (target === undefined) return;
  try {
    appendFileSync(target.file, `${JSON.stringify({ rank: target.rank, ...e })}\n`);
  } catch {
    target = undefined; // the launcher is gone and took its directory along
  }
}

/** The launcher's side: the ranks that reported a timed-out collective in `file`. */
export function timedOutRanks(file: string): Set<number> {
  const out = new Set<number>();
  let text = '';
  try {
    text = readFileSync(file, 'utf8');
  } catch {
    return out; // no rank wrote anything
  }
  for (const line of text.split('\n')) {
    try {
      const v = JSON.parse(line) as { rank?: unknown; event?: unknown };
      if (v.event === 'timeout' && Number.isInteger(v.rank)) out.add(v.rank as number);
    } catch {
      // a line cut short or not ours
    }
  }
  return out;
}

/** The launcher's side: whether a rank stopped for the job to meet again (a `regroup` line in `file`). */
export function regrouped(file: string): boolean {
  try {
    return readFileSync(file, 'utf8').split('\n').some((l) => l.includes('"event":"regroup"'));
  } catch {
    return false;
  }
}
