// Per-step metrics as JSON lines (one object per optimizer step), written synchronously so the file
// is complete up to the last finished step even when a run dies.
import { closeSync, existsSync, mkdirSync, openSync, readFileSync, writeFileSync, writeSync } from 'node:fs';
import { dirname } from 'node:path';

export interface StepMetrics {
  /** Optimizer steps completed (1 after the first update). */
  step: number;
  /** Training loss of the global batch: the mean over its trained tokens (the criterion's units), every rank and micro-batch. */
  loss: number;
  /** Trained tokens of the global batch (the language-model objective; DPO counts `pairs`); 0: the step was skipped. */
  trainedTokens?: number;
  /** The criterion's own metrics over the global batch (sum over its units / trainedTokens). */
  criterion?: Record<string, number>;
  /** DPO: preference pairs of the global batch, and the means over them of beta x the chosen and the rejected responses' log-ratios to the reference, their difference and [chosen > rejected]. */
  pairs?: number;
  rewardsChosen?: number;
  rewardsRejected?: number;
  rewardsMargin?: number;
  rewardsAccuracy?: number;
  /** Learning rate used for this step. */
  lr: number;
  /** Tokens of the global batch per second of step time (evaluation excluded). */
  tokensPerSec: number;
  /** Global gradient norm before clipping. */
  gradNorm?: number;
  /** Validation loss, on evaluation steps only. */
  valLoss?: number;
  /** Resident memory of the process writing the row (rank 0's, MiB) after the step. */
  rssMiB?: number;
  /** Model FLOPs per trained token, forward and backward (src/train/flops.ts; the first row of a run). */
  flopsPerToken?: number;
  /** Model TFLOP/s achieved per rank: flopsPerToken x tokensPerSec / ranks / 1e12. */
  tflops?: number;
  /** Model FLOPs utilisation: tflops over the rank's peak ([log] peakTflops, or measured). */
  mfu?: number;
  /** Seconds since the loop started. */
  elapsedS: number;
  /** Mixture of experts: per MoE layer (by module name), assignments routed to each expert over the global batch. */
  expertTokens?: Record<string, number[]>;
  /** Mixture of experts (balance = "aux"): the auxiliary loss summed over MoE layers, mean over micro-batches and ranks (not in `loss`). */
  auxLoss?: number;
  /** Mixture of experts (capacityFactor > 0): assignments dropped by the capacity limit over every layer and the global batch. */
  droppedTokens?: number;
}

export class MetricsWriter {
  private fd: number | undefined;

  /**
   * Truncates `path` (creating its directory); a run directory holds one run's metrics. With
   * `continueAfter` (a resumed run) the file keeps its lines up to that step, drops the ones a
   * killed run wrote after its last checkpoint (they are trained again), and is appended to.
   */
  constructor(readonly path: string, opts: { continueAfter?: number } = {}) {
    mkdirSync(dirname(path), { recursive: true });
    if (opts.continueAfter !== undefined && existsSync(path)) {
      const keep = readFileSync(path, 'utf8').split('\n').filter((l) => {
        if (l.trim() === '') return false;
        try {
          return (JSON.parse(l) as StepMetrics).step <= opts.continueAfter!;
        } catch {
          return false; // a line cut short when the run died
        }
      });
      writeFileSync(path, keep.map((l) => `${l}\n`).join(''));
      this.fd = openSync(path, 'a');
    } else {
      this.fd = openSync(path, 'w');
    }
  }

  write(m: StepMetrics): void {
    if (this.fd === undefined) throw new Error(`MetricsWriter: ${this.path} is closed`);
    writeSync(this.fd, `${JSON.stringify(m)}\n`);
  }

  close(): void {
    if (this.fd !== undefined) {
      closeSync(this.fd);
      this.fd = undefined;
    }
  }
}

/** Reads a metrics file back (tests, plots, loss comparisons). */
export function readMetrics(path: string): StepMetrics[] {
  if (!existsSync(path)) throw new Error(`metrics file ${path} does not exist`);
  return readFileSync(path, 'utf8')
    .split('\n')
    .filter((l) => l.trim() !== '')
    .map((l, i) => {
      try {
        return JSON.parse(l) as StepMetrics;
      } catch {
        throw new Error(`${path}:${i + 1}: not a JSON line`);
      }
    });
}
