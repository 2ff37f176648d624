// A rank's line to its launcher. `flotilla run` opens one extra pipe per rank (fd 3) and names it in
// FLOTILLA_STATUS_FD; a rank writes one JSON line per event there. Today the only event is a
// collective that timed out: the launcher uses it to tell the ranks that gave up waiting from the
// rank they waited for, and to name that one (a stalled rank never fails by itself).
//
// The variable is read and removed once, when this module loads, so processes a rank starts do not
// write to whatever their own fd 3 is.
import { fstatSync, writeSync } from 'node:fs';

let statusFd: number | undefined = (() => {
  const raw = process.env.FLOTILLA_STATUS_FD;
  delete process.env.FLOTILLA_STATUS_FD;
  if (raw === undefined || !/^\d+$/.test(raw)) return undefined;
  const fd = Number(raw);
  try {
    const st = fstatSync(fd);
    return st.isFIFO() || st.isSocket() ? fd : undefined; // Node's spawn pipes are socket pairs
  } catch {
    return undefined;
  }
})();

export interface RankEvent {
  event: 'timeout';
  /** The collective and its group, for the launcher's message. */
  op: string;
  group: string;
}

/** Tells the launcher (if any) about an event; never throws. */
export function tellLauncher(e: RankEvent): void {
  if (statusFd === undefined) return;
  try {
    writeSync(statusFd, `${JSON.stringify(e)}\n`);
  } catch {
    statusFd = undefined; // the launcher is gone or closed its end
  }
}
