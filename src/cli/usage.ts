// The one error class for a bad command line: every command throws it, main() prints its message
// and exits 2. A module of its own so commands need not import main.ts (which imports them).

/** Bad command-line usage: one message, exit code 2. */
export class UsageError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'UsageError';
  }
}
