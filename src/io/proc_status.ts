// The memory fields of a process's /proc/<pid>/status (Linux): what the memory reports, the
// planner's calibration and measurement, and the memory tests and benchmarks read, in one parser.
import { readFileSync } from 'node:fs';

/**
 * Every `kB` field of /proc/<pid>/status (VmRSS, VmHWM, RssAnon, ...) in bytes; undefined where the
 * file cannot be read (not Linux, or the process has ended).
 */
export function procStatusBytes(pid: number | 'self' = 'self'): Record<string, number> | undefined {
  let text: string;
  try {
    text = readFileSync(`/proc/${pid}/status`, 'utf8');
  } catch {
    return undefined;
  }
  const out: Record<string, number> = {};
  for (const m of text.matchAll(/^(\w+):\s+(\d+) kB$/gm)) out[m[1]!] = Number(m[2]) * 1024;
  return out;
}
