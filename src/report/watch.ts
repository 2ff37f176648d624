// Rank 0 of `flotilla train` writes RUN/report.html when the run ends, however it ends: at the end
// of train() (a finished run, a run stopped by Ctrl-C, a failed one), or from the process's exit
// when it is leaving without returning (a second Ctrl-C, process.exit). Kept apart from the report
// code so that the other ranks never load the charting library.
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
  process.on('exit', onExit);
  return {
    finish: () => loading.then((m) => write(m), (e: unknown) => write(undefined, e)),
  };
}
