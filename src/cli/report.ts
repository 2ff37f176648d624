// `flotilla report RUN [RUN...] [--out FILE]`: writes the runs' report page (RUN/report.html of the
// first run unless --out says otherwise) and prints its path.
import { relative } from 'node:path';
import { UsageError } from './usage.js';

const REPORT_USAGE = 'usage: flotilla report RUN [RUN...] [--out FILE]  (e.g. flotilla report runs/gpt-tiny)';

interface ReportArgs {
  runs: string[];
  out?: string;
}


function parseReportArgs(args: readonly string[]): ReportArgs {
  const runs: string[] = [];
  let out: string | undefined;
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === '--out' || a.startsWith('--out=')) {
      out = a === '--out' ? args[++i] : a.slice('--out='.length);
      if (out === undefined || out === '') throw new UsageError(`--out needs a file name; ${REPORT_USAGE}`);
    } else if (a.startsWith('-')) {
      throw new UsageError(`unknown option ${a}; ${REPORT_USAGE}`);
    } else {
      runs.push(a);
    }
  }
  if (runs.length === 0) throw new UsageError(`give the run directory; ${REPORT_USAGE}`);
  return { runs, ...(out !== undefined ? { out } : {}) };
}

/** Runs the command; resolves to the exit code (2 for a directory that is not a run: nothing written). */
export async function reportCommand(args: readonly string[], print: (line: string) => void): Promise<number> {
  if (args.includes('--help') || args.includes('-h')) {
    print(REPORT_USAGE);
    return 0;
  }
  const { writeReport, ReportError } = await import('../report/index.js');
  try {
    const a = parseReportArgs(args);
    const path = writeReport(a.runs, a.out !== undefined ? { out: a.out } : {});
    const rel = relative(process.cwd(), path);
    print(`report: ${rel.startsWith('..') || rel === '' ? path : rel}`);
    return 0;
  } catch (e) {
    if (e instanceof ReportError || e instanceof UsageError) {
      process.stderr.write(`flotilla report: ${e.message}\n`);
      return 2;
    }
    throw e;
  }
}
