// Epoch plans: which units (examples, or preference pairs) go into which rows of seqLen tokens, per
// epoch. Pure functions of (lengths, seed, epoch, options), so every rank, the prefetch worker and
// a resumed run compute the same rows without storing them (see [Note: example rows] in
// example_loader.ts).
import { uniformStream } from './sampler.js';

export interface PackOptions {
  /** Tokens per row. */
  seqLen: number;
  /** Several units a row (first-fit); false: one unit a row, padded. */
  pack: boolean;
  /** A unit longer than seqLen: cut to it, or left out. */
  overflow: 'truncate' | 'drop';
}

export interface EpochPlan {
  rows: number;
  /** Row r holds entries rowStart[r] .. rowStart[r + 1] - 1 (rows + 1 values). */
  rowStart: Int32Array;
  /** Per entry: the unit, and the tokens of it the row takes (its length, or seqLen when truncated). */
  unit: Int32Array;
  take: Int32Array;
  truncated: number;
  /** Units left out: longer than seqLen under overflow = "drop", or named by `leftOut`. */
  dropped: number;
  /** Tokens taken over rows x seqLen. */
  fill: number;
}

/** Keeps one epoch's shuffle apart from the sample streams of the same seed. */
const EPOCH_SALT = 0x2c1b3c6d;
/** Rows first-fit looks into: the most recently opened ones still open. */
const OPEN_ROWS = 16;

/** The units in epoch order: a Fisher-Yates shuffle from the epoch's own stream, or their order when not shuffled. */
export function epochOrder(n: number, seed: number, epoch: number, shuffle = true): Int32Array {
  const order = Int32Array.from({ length: n }, (_, i) => i);
  if (!shuffle || n < 2) return order;
  const u = uniformStream((seed ^ EPOCH_SALT) >>> 0, epoch, n - 1);
  for (let i = n - 1; i >= 1; i--) {
    const j = Math.floor(u[n - 1 - i]! * (i + 1));
    const t = order[i]!;
    order[i] = order[j]!;
    order[j] = t;
  }
  return order;
}

/**
 * The rows of one epoch. With `pack`, each unit goes into the first of the (at most 16) open rows
 * it fits, oldest first, else opens a row (closing the oldest when 16 are open); rows are emitted
 * as they close (full, or pushed out), the rest at the end in the order they opened.
 */
export function planEpoch(lengths: Int32Array, seed: number, epoch: number, o: PackOptions & { shuffle?: boolean; leftOut?: Uint8Array }): EpochPlan {
  const T = o.seqLen;
  if (!(Number.isInteger(T) && T > 0)) throw new Error(`planEpoch: seqLen must be a positive integer, got ${T}`);
  const order = epochOrder(lengths.length, seed, epoch, o.shuffle ?? true);
  const units: number[] = [];
  const takes: number[] = [];
  const starts: number[] = [0];
  let truncated = 0, dropped = 0, used = 0;
  const emit = (row: { units: number[]; takes: number[] }) => {
    units.push(...row.units);
    takes.push(...row.takes);
    starts.push(units.length);
  };
  const open: { units: number[]; takes: number[]; free: number }[] = [];
  for (const u of order) {
    const len = lengths[u]!;
    if (len <= 0) throw new Error(`planEpoch: unit ${u} has ${len} tokens`);
    let take = len;
    if (o.leftOut?.[u]) {
      dropped++;
      continue;
    }
    if (len > T) {
      if (o.overflow === 'drop') {
        dropped++;
        continue;
      }
      truncated++;
      take = T;
    }
    used += take;
    if (!o.pack) {
      emit({ units: [u], takes: [take] });
      continue;
    }
    let row = open.find((r) => r.free >= take);
    if (!row) {
      if (open.length === OPEN_ROWS) emit(open.shift()!);
      row = { units: [], takes: [], free: T };
      open.push(row);
    }
    row.units.push(u);
    row.takes.push(take);
    row.free -= take;
    if (row.free === 0) {
      open.splice(open.indexOf(row), 1);
      emit(row);
    }
  }
  for (const r of open) emit(r);
  const rows = starts.length - 1;
  return {
    rows, rowStart: Int32Array.from(starts), unit: Int32Array.from(units), take: Int32Array.from(takes),
    truncated, dropped, fill: rows === 0 ? 0 : used / (rows * T),
  };
}

/**
 * The run's rows as one stream over epochs: global row g lies in epoch e where cumRows(e) <= g <
 * cumRows(e + 1). Plans are recomputed on demand (the last two kept); row counts are kept per epoch.
 */
export class EpochStream {
  readonly units: number;
  private readonly rowCounts: number[] = [];
  private readonly cumRows: number[] = [0];
  private readonly cache = new Map<number, EpochPlan>();

  constructor(readonly lengths: Int32Array, readonly seed: number, readonly o: PackOptions & { shuffle: boolean; leftOut?: Uint8Array }) {
    this.units = lengths.length;
    if (this.rowsIn(0) === 0) {
      throw new Error(o.leftOut
        ? `no preference pair fits data.seqLen = ${o.seqLen}: each of the ${this.units} pairs is longer, and cutting it would leave a response with no trained token; use a longer data.seqLen`
        : `no example fits data.seqLen = ${o.seqLen} with data.overflow = "drop" (${this.units} examples, every one longer); use a longer data.seqLen or data.overflow = "truncate"`);
    }
  }

  plan(epoch: number): EpochPlan {
    const e = this.o.shuffle ? epoch : 0; // unshuffled epochs are all alike
    let p = this.cache.get(e);
    if (!p) {
      p = planEpoch(this.lengths, this.seed, e, this.o);
      if (this.cache.size >= 2) this.cache.delete(this.cache.keys().next().value!);
      this.cache.set(e, p);
    }
    return p;
  }

  /** Rows of epoch e. Without packing every epoch has the same rows; with it, the epoch is planned. */
  rowsIn(epoch: number): number {
    while (this.rowCounts.length <= epoch) {
      const e = this.rowCounts.length;
      const rows = e > 0 && (!this.o.pack || !this.o.shuffle) ? this.rowCounts[0]! : this.plan(e).rows;
      this.rowCounts.push(rows);
      this.cumRows.push(this.cumRows[e]! + rows);
    }
    return this.rowCounts[epoch]!;
  }

  /** Rows of epochs 0 .. epochs - 1. */
  rowsBefore(epochs: number): number {
    if (epochs > 0) this.rowsIn(epochs - 1);
    return this.cumRows[epochs]!;
  }

  /** The epoch and row within it of global row g. */
  locate(g: number): { epoch: number; row: number; plan: EpochPlan } {
    if (!(Number.isInteger(g) && g >= 0)) throw new Error(`internal: row ${g}`);
    let e = 0;
    if (!this.o.pack || !this.o.shuffle) e = Math.floor(g / this.rowsIn(0));
    else {
      while (this.rowsBefore(e + 1) <= g) e++;
    }
    const row = g - (e === 0 ? 0 : !this.o.pack || !this.o.shuffle ? e * this.rowsIn(0) : this.cumRows[e]!);
    return { epoch: e, row, plan: this.plan(e) };
  }

  /** Optimizer steps of `epochs` epochs: ceil(rows / globalBatch) (the last step's missing rows come from the next epoch). */
  stepsFor(epochs: number, globalBatch: number): number {
    return Math.ceil(this.rowsBefore(epochs) / globalBatch);
  }
}
