// Console progress for rank 0: a cli-progress bar on a terminal (step, loss, val loss, tokens/s,
// ETA), plain log lines otherwise (CI, the launcher's pipes, files), or nothing.
import { MultiBar, type SingleBar } from 'cli-progress';
import { openSync } from 'node:fs';
import { WriteStream } from 'node:tty';
import type { StepMetrics } from './metrics.js';

export type ProgressMode = 'bar' | 'plain' | 'off';

/**
 * "auto" becomes a bar on a terminal and plain lines elsewhere. A rank under `flotilla run` writes
 * into the launcher's pipe, so the launcher says whether its own stdout is a terminal
 * (FLOTILLA_LAUNCHER_TTY=1); rank 0 then draws the bar straight on that terminal (see barStream).
 */
export function resolveProgressMode(
  mode: ProgressMode | 'auto',
  isTTY = Boolean(process.stdout.isTTY) || (process.env.FLOTILLA_LAUNCHER_TTY === '1' && barStream() !== undefined),
): ProgressMode {
  return mode === 'auto' ? (isTTY ? 'bar' : 'plain') : mode;
}

let ttyStream: NodeJS.WriteStream | undefined | null = null;

/** Where the bar is drawn: stdout when it is a terminal, else the controlling terminal if any. */
export function barStream(): NodeJS.WriteStream | undefined {
  if (process.stdout.isTTY) return process.stdout;
  if (ttyStream === null) {
    try {
      ttyStream = new WriteStream(openSync('/dev/tty', 'w'));
    } catch {
      ttyStream = undefined;
    }
  }
  return ttyStream;
}

export type ProgressUpdate = Pick<StepMetrics, 'step' | 'loss' | 'lr' | 'tokensPerSec' | 'gradNorm' | 'valLoss'>;

function fmt(v: number | undefined, digits = 4): string {
  return v === undefined || !Number.isFinite(v) ? '-' : v.toFixed(digits);
}

function rate(v: number): string {
  return Math.round(v).toLocaleString('en-US');
}

export class Progress {
  private multi: MultiBar | undefined;
  private bar: SingleBar | undefined;
  private lastVal: number | undefined;

  constructor(
    readonly total: number,
    readonly mode: ProgressMode,
    /** Plain mode prints every this many steps (and on evaluation steps and the last step). */
    readonly every = 10,
    private readonly out: (line: string) => void = (l) => process.stdout.write(`${l}\n`),
  ) {
    if (mode === 'bar') {
      this.multi = new MultiBar({
        format: 'step {value}/{total} |{bar}| loss {loss} | val {val} | {tps} tok/s | eta {eta_formatted}',
        barsize: 24,
        hideCursor: false, // an interrupted run must not leave the terminal without a cursor
        stream: barStream() ?? process.stdout,
        fps: 5,
      });
      this.bar = this.multi.create(total, 0, { loss: '-', val: '-', tps: '-' });
    }
  }

  /** A line that should stay on screen (phase headers, warnings) without breaking the bar. */
  log(line: string): void {
    if (this.mode === 'off') return;
    if (this.multi) this.multi.log(`${line}\n`);
    else this.out(line);
  }

  update(u: ProgressUpdate): void {
    if (u.valLoss !== undefined) this.lastVal = u.valLoss;
    if (this.bar) {
      if (u.valLoss !== undefined) this.log(`step ${u.step}: loss ${fmt(u.loss)}, val loss ${fmt(u.valLoss)}`);
      this.bar.update(u.step, { loss: fmt(u.loss), val: fmt(this.lastVal), tps: rate(u.tokensPerSec) });
      // The training loop is synchronous between steps, so cli-progress's redraw timer rarely gets a
      // turn: draw now (a step takes far longer than a redraw).
      this.multi!.update();
    } else if (this.mode === 'plain') {
      if (u.step % this.every === 0 || u.step === this.total || u.valLoss !== undefined || u.step === 1) {
        const parts = [
          `step ${String(u.step).padStart(String(this.total).length)}/${this.total}`,
          `loss ${fmt(u.loss)}`,
          `val ${fmt(u.valLoss)}`,
          `lr ${u.lr.toExponential(2)}`,
          `${rate(u.tokensPerSec)} tok/s`,
        ];
        if (u.gradNorm !== undefined) parts.push(`gnorm ${fmt(u.gradNorm, 3)}`);
        this.out(parts.join(' | '));
      }
    }
  }

  stop(): void {
    this.multi?.stop();
    this.multi = undefined;
    this.bar = undefined;
  }
}
