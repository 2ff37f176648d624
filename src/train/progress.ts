// Console progress for rank 0: a cli-progress bar on a terminal (step, loss, val loss, tokens/s,
// MFU, ETA), plain log lines otherwise (CI, the launcher's pipes, files), or nothing.
import { MultiBar, type SingleBar } from 'cli-progress';
import { openSync } from 'node:fs';
import { WriteStream } from 'node:tty';
import type { StepMetrics } from './metrics.js';
import { launcherEnv } from '../distributed/launcher_env.js';

export type ProgressMode = 'bar' | 'plain' | 'off';

/**
 * "auto" becomes a bar on a terminal and plain lines elsewhere. A rank under `flotilla run` writes
 * into the launcher's pipe, so the launcher names its own terminal, if its stdout is one
 * (FLOTILLA_LAUNCHER_TTY=/dev/pts/N, '0' when not); rank 0 then draws the bar straight on that
 * terminal (see barStream), also under mpirun, whose ranks have no controlling terminal.
 */
export function resolveProgressMode(
  mode: ProgressMode | 'auto',
  isTTY = Boolean(process.stdout.isTTY) || (launcherTerminal() !== undefined && barStream() !== undefined),
): ProgressMode {
  return mode === 'auto' ? (isTTY ? 'bar' : 'plain') : mode;
}

let ttyStream: NodeJS.WriteStream | undefined | null = null;

/** The launcher's terminal: a device path, or '1' for this process's controlling terminal. */
function launcherTerminal(): string | undefined {
  const t = launcherEnv().terminal;
  if (t === '1') return '/dev/tty';
  return t !== undefined && /^\/dev\/(pts\/\d+|tty\w*)$/.test(t) ? t : undefined;
}

/** Where the bar is drawn: stdout when it is a terminal, else the launcher's terminal if any. */
export function barStream(): NodeJS.WriteStream | undefined {
  if (process.stdout.isTTY) return process.stdout;
  if (ttyStream === null) {
    try {
      ttyStream = new WriteStream(openSync(launcherTerminal() ?? '/dev/tty', 'w'));
    } catch {
      ttyStream = undefined;
    }
  }
  return ttyStream;
}

export type ProgressUpdate = Pick<StepMetrics, 'step' | 'loss' | 'lr' | 'tokensPerSec' | 'gradNorm' | 'valLoss' | 'mfu'>;

function fmt(v: number | undefined, digits = 4): string {
  return v === undefined || !Number.isFinite(v) ? '-' : v.toFixed(digits);
}

function rate(v: number): string {
  return Math.round(v).toLocaleString('en-US');
}

/** The MFU as a percentage (two decimals below 1%: a small model on a CPU). */
function pct(v: number | undefined): string {
  return v === undefined || !Number.isFinite(v) ? '-' : `${(100 * v).toFixed(100 * v < 1 ? 2 : 1)}%`;
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
        format: 'step {value}/{total} |{bar}| loss {loss} | val {val} | {tps} tok/s | MFU {mfu} | eta {eta_formatted}',
        barsize: 24,
        hideCursor: false, // an interrupted run must not leave the terminal without a cursor
        stream: barStream() ?? process.stdout,
        fps: 5,
      });
      this.bar = this.multi.create(total, 0, { loss: '-', val: '-', tps: '-', mfu: '-' });
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
      this.bar.update(u.step, { loss: fmt(u.loss), val: fmt(this.lastVal), tps: rate(u.tokensPerSec), mfu: pct(u.mfu) });
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
        if (u.mfu !== undefined) parts.push(`MFU ${pct(u.mfu)}`);
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
