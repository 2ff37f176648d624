// [Note: measuring progress] A command that measures says what it measures as it goes: which
// measurement, n of m, the time so far and roughly how long the rest takes. Each measurement of a
// series carries a weight proportional to its expected work (its tokens times the blocks it runs),
// and the time left is the pace since the first one finished (the first also pays for starting the
// processes: counting it, a 72-shape series first said 2 hours where 12 minutes were left) times
// the weight left. A line is
// written for the first measurement, the last, and otherwise at most every `everyMs`, so a long
// series says it is alive without a line per forward pass. `flotilla plan` once printed one line
// and then nothing for 18 minutes on a CPU where every bf16 measurement ran 15x slower than float32.

/** What a calibration process writes on stdout after each (depth, point) it measured. */
export const PROGRESS_TAG = 'FLOTILLA_CALIBRATION_PROGRESS ';

/** "850 ms", "42 s", "3 min 20 s", "1 h 05 min". */
export function formatDuration(ms: number): string {
  if (!Number.isFinite(ms) || ms < 0) return '?';
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = Math.round(ms / 1000);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, '0')} s`;
  const m = Math.round(s / 60);
  return `${Math.floor(m / 60)} h ${String(m % 60).padStart(2, '0')} min`;
}

export class Progress {
  private count = 0;
  private doneWeight = 0;
  private lastLine = -Infinity;
  private first?: { t: number; weight: number };
  private readonly start: number;
  private readonly total: number;

  /** weights: one per measurement, in the order they finish. */
  constructor(
    private readonly what: string,
    private readonly weights: readonly number[],
    private readonly log: (line: string) => void,
    private readonly now: () => number = () => performance.now(),
    private readonly everyMs = 5_000,
  ) {
    this.start = now();
    this.total = weights.reduce((a, w) => a + w, 0);
  }

  /** One more measurement finished; label says which. */
  step(label: string): void {
    this.doneWeight += this.weights[this.count] ?? 0;
    this.count++;
    const t = this.now();
    const last = this.count >= this.weights.length;
    if (this.first !== undefined && !last && t - this.lastLine < this.everyMs) return;
    this.lastLine = t;
    const elapsed = t - this.start;
    let left = 'done';
    if (this.first === undefined) {
      this.first = { t, weight: this.doneWeight };
      if (!last) left = 'the time left follows the next one';
    } else if (!last) {
      const pace = (t - this.first.t) / (this.doneWeight - this.first.weight);
      left = Number.isFinite(pace) ? `about ${formatDuration(pace * (this.total - this.doneWeight))} left` : 'time left unknown';
    }
    this.log(`[plan] ${this.what}: measured ${this.count} of ${this.weights.length} (${label}); ${formatDuration(elapsed)} elapsed, ${left}`);
  }
}
