// Slurm's variables that both a rank (env.ts) and `flotilla train` on a node (src/launch/slurm.ts)
// read: the job's hosts (SLURM_JOB_NODELIST in Slurm's hostlist syntax) and the port a job meets on.
// No imports: env.ts reads these while it reads the launch contract.

type Env = Record<string, string | undefined>;

/**
 * Expands a Slurm hostlist ("node[01-03,07],gpu-a[1-2]", "r[1-2]-n[08-10]") into host names in
 * `scontrol show hostnames` order: comma-separated expressions, each bracket group a list of
 * numbers and ranges, zero-padded to the width of a range's first number, several groups expanded
 * with the leftmost varying slowest. Throws a plain Error naming the malformed part.
 */
export function expandHostlist(list: string): string[] {
  const out: string[] = [];
  for (const expr of splitTopLevel(list.trim())) {
    if (expr === '') throw new Error(`hostlist ${JSON.stringify(list)} has an empty entry`);
    out.push(...expandOne(expr, list));
  }
  return out;
}

/** Splits at the commas outside brackets. */
function splitTopLevel(s: string): string[] {
  const parts: string[] = [];
  let depth = 0, start = 0;
  for (let i = 0; i < s.length; i++) {
    const c = s[i];
    if (c === '[') depth++;
    else if (c === ']') depth--;
    else if (c === ',' && depth === 0) {
      parts.push(s.slice(start, i));
      start = i + 1;
    }
    if (depth < 0 || depth > 1) throw new Error(`hostlist ${JSON.stringify(s)} has unbalanced brackets`);
  }
  if (depth !== 0) throw new Error(`hostlist ${JSON.stringify(s)} has unbalanced brackets`);
  parts.push(s.slice(start));
  return parts;
}

function expandOne(expr: string, list: string): string[] {
  const open = expr.indexOf('[');
  if (open < 0) return [expr];
  const close = expr.indexOf(']', open);
  const prefix = expr.slice(0, open);
  const rest = expandOne(expr.slice(close + 1), list);
  const out: string[] = [];
  for (const n of expandRanges(expr.slice(open + 1, close), list)) for (const r of rest) out.push(`${prefix}${n}${r}`);
  return out;
}

function expandRanges(body: string, list: string): string[] {
  const out: string[] = [];
  for (const part of body.split(',')) {
    const m = /^(\d+)(?:-(\d+))?$/.exec(part.trim());
    if (!m) throw new Error(`hostlist ${JSON.stringify(list)}: [${body}] holds ${JSON.stringify(part)}, not a number or a range lo-hi`);
    const lo = Number(m[1]), hi = m[2] === undefined ? lo : Number(m[2]);
    if (hi < lo) throw new Error(`hostlist ${JSON.stringify(list)}: the range ${part} runs backwards`);
    const width = m[1]!.length; // "01-10" pads to 2; "9-010" does not (scontrol's rule)
    for (let i = lo; i <= hi; i++) out.push(String(i).padStart(width, '0'));
  }
  return out;
}

// [Note: slurm port] The rendezvous port of a job: 20000 + 10 x (SLURM_JOB_ID mod 1000), so jobs
// sharing a node use different ports, each job owns ten (its restarts' store ports and the
// heartbeat's above them, launcher.ts), and all lie below Linux's ephemeral range (32768-60999)
// where the kernel picks outgoing ports. MASTER_PORT, when set, wins.
export const SLURM_PORT_BASE = 20000;

/** The master port of Slurm job `jobId` ([Note: slurm port]). */
export function slurmPort(jobId: number): number {
  return SLURM_PORT_BASE + 10 * (jobId % 1000);
}

/** Whether this job was requeued (SLURM_RESTART_COUNT > 0): it resumes from its newest checkpoint. */
export function slurmRestarted(env: Env = process.env): boolean {
  const n = Number(env.SLURM_RESTART_COUNT?.trim() || 0);
  return Number.isInteger(n) && n > 0;
}

/** Whether this process runs in a Slurm job (a SIGTERM then is scancel or preemption: save and stop). */
export function inSlurmJob(env: Env = process.env): boolean {
  return (env.SLURM_JOB_ID?.trim() ?? '') !== '';
}
