// The one error class for a bad command line: every command throws it, main() prints its message
// and exits 2. A module of its own so commands need not import main.ts (which imports them).

/**
 * Bad command-line usage: one message, exit code 2. `help`: the command line asked for the
 * command's help (flotilla run -h), which its command prints to stdout with exit code 0.
 */
export class UsageError extends Error {
  constructor(message: string, readonly help = false) {
    super(message);
    this.name = 'UsageError';
  }
}

/** @deprecated `flotilla run`'s usage errors are UsageErrors; this is the same class under its old name. */
export const RunUsageError = UsageError;
/** @deprecated Use UsageError. */
export type RunUsageError = UsageError;

/**
 * `--nnodes M` or `--nnodes MIN:MAX` (flotilla run and flotilla train): the hosts to start on, and
 * while how many of them the job carries on (minNodes only when below nnodes). `error` makes the
 * command's own error of a message.
 */
export function parseNnodes(raw: string, error: (message: string) => Error): { nnodes: number; minNodes?: number } {
  const m = /^\s*(?:(\d+)\s*:\s*)?(\d+)\s*$/.exec(raw);
  if (!m) throw error(`--nnodes ${JSON.stringify(raw)}: expected a number of hosts M, or MIN:MAX`);
  const nnodes = Number(m[2]);
  const minNodes = m[1] === undefined ? nnodes : Number(m[1]);
  if (nnodes < 1 || minNodes < 1) throw error(`--nnodes ${raw.trim()}: hosts must be at least 1`);
  if (minNodes > nnodes) throw error(`--nnodes ${raw.trim()}: MIN must not exceed MAX`);
  return { nnodes, ...(minNodes < nnodes ? { minNodes } : {}) };
}
