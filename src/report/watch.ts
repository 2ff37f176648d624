// Rank 0 of `flotilla train` writes RUN/report.html when the run ends, however it ends: at the end
// of train() (a finished run, a run stopped early, a failed one); from the process's exit when it
// leaves without returning (process.exit); and on SIGINT/SIGTERM when nothing else handles them
// (the signal would end the process at once: the report is written, then the signal delivered
// again). When another handler takes the signal (a graceful stop), the run's own end writes it.
// Kept apart from the report code so that the other ranks never load the charting library.
import { join, relative } from 'node:path';

export interface RunWatch {
  /** Writes the report now, prints its path and stops watching. Never throws. */
  finish(): Promise<void>;
}

type ReportModule = typeof import('./index.js');

/** print gets the report's path, or one line saying why it could not be written. */
export function watchRun(runDir: string, print: (line: string) => void): RunWatch {
  let mod: ReportModule | undefined;
  // Loaded now, so that an exiting process can still write the report synchronously.
  const loading = import('./index.js').then((m) => (mod = m));
  loading.catch(() => {}); // reported by write()
  let done = false;
  const write = (m: ReportModule | undefined, why?: unknown): void => {
    if (done) return;
    done = true;
    process.off('exit', onExit);
    process.off('SIGINT', onSignal);
    process.off('SIGTERM', onSignal);
    try {
      if (m === undefined) throw why ?? new Error('the report code did not load');
      const path = m.writeReport([runDir]);
      const rel = relative(process.cwd(), path);
      print(rel.startsWith('..') || rel === '' ? path : rel);
    } catch (e) {
      print(`could not write ${join(runDir, 'report.html')}: ${(e as Error)?.message ?? String(e)}`);
    }
  };
  const onExit = (): void => write(mod);
  const onSignal = (signal: NodeJS.Signals): void => {
    if (process.listenerCount(signal) > 1) return; // someone else stops the run; finish() reports
    write(mod);
    process.kill(process.pid, signal); // ends the process as the signal would have
  };
  process.on('exit', onExit);
  process.on('SIGINT', onSignal);
  process.on('SIGTERM', onSignal);
  return {
    finish: () => loading.then((m) => write(m), (e: unknown) => write(undefined, e)),
  };
}
