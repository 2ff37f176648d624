// A rank's line to its launcher. `flotilla run` names a file in FLOTILLA_STATUS_FILE (a new one per
// attempt, in a directory only the launcher's user can enter); a rank appends one JSON line per event
// there, with its rank. Today the only event is a collective that timed out: the launcher uses it to
// tell the ranks that gave up waiting from the rank they waited for, and to name that one (a stalled
// rank never fails by itself). A file, not a pipe, because mpirun passes no extra descriptors to its
// ranks, and because the line is on disk before the rank exits: the launcher, which acts on the
// exit, never misses it.
//
// The variable is read and removed once, when this module loads, so processes a rank starts do not
// write there.
import { appendFileSync, readFileSync } from 'node:fs';

let target: { file: string; rank: number } | undefined = (() => {
  const file = process.env.FLOTILLA_STATUS_FILE;
  delete process.env.FLOTILLA_STATUS_FILE;
  const rank = Number(process.env.RANK ?? process.env.OMPI_COMM_WORLD_RANK);
  return file && Number.isInteger(rank) && rank >= 0 ? { file, rank } : undefined;
})();

export interface RankEvent {
  event: 'timeout';
  /** The collective and its group, for the launcher's message. */
  op: string;
  group: string;
}

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
