// The loader of example datasets (chat, completion, preference): whole examples in rows, with the
// loss on their trained targets only. The same public surface as DataLoader (src/data/loader.ts),
// so the trainer does not branch.
//
// [Note: example rows]
// Each epoch is planned from the units' lengths alone (src/data/packing.ts: a shuffle by
// (train.seed, epoch), then first-fit packing or one unit a row; a preference pair that a cut to
// the row would leave with a response of no trained target is left out of every epoch, counted
// with the dropped units, so DPO never compares an empty response), and the run's rows form one
// stream across epochs: step s reads global rows [s * G, (s + 1) * G), cut between data-parallel
// ranks and micro-batches exactly as [Note: global batch partition] cuts samples. So the rows a
// (step, micro) reads are a function of the step, the seed and the data: a resume needs the
// step counter only, mid-epoch or not, and verifyDataPartition checks the same ids.
//
// A document e[0..n) with trained bits m[0..n) (m[k]: token k is a trained target) placed at
// offset p of a row gives x[p + k] = e[k], y[p + k] = m[k + 1] ? e[k + 1] : IGNORE_INDEX for
// k < n - 1 and y[p + n - 1] = IGNORE_INDEX: nothing predicts across documents. Padding takes
// x = the end-of-text id, y = IGNORE_INDEX, and is one trailing document. Positions count within
// each document. When some row of a micro-batch holds more than one document (packing, a
// preference pair), the batch carries a DocumentLayout so attention stays within documents; a row
// of one document and its padding needs none (causality already hides the padding that follows).
import { type Tensor, tensor } from '../tensor/index.js';
import { documentLayout } from '../nn/documents.js';
import { IGNORE_INDEX, type MicroBatch, type SequenceTable } from '../parallel/parallel_model.js';
import { BatchCursor, type GeometryOptions } from './batch_cursor.js';
import { ExampleCorpus, ExampleRows, PLANES, planesOf, type ExampleRowsSpec, type RowPlanes } from './examples.js';
import { checkSeed, type Batch, type ExampleState, type LoaderState, type TrainLoader } from './loader.js';
import type { PrefetchSource } from './prefetch.js';

export interface ExampleLoaderOptions extends GeometryOptions {
  sources: ExampleCorpus[];
  seed?: number;
  /** Several examples a row (default false: one a row, padded). */
  pack?: boolean;
  overflow?: 'truncate' | 'drop';
  /** Passes the run makes (0: train.steps decides); recorded in the state. */
  epochs?: number;
  /** false: the units in order, every epoch alike (validation). Default true. */
  shuffle?: boolean;
  /** The id padding takes in x (the tokenizer's end-of-text). */
  padId: number;
  /** Batches a worker thread prepares ahead (0: inline). */
  prefetch?: number;
  /** Identity of the units read, checked on resume (default: the corpora's names and ranges). */
  datasetKey?: string;
}

/** A micro-batch of examples. `positions`/`docIds` are the documents' (B x T) layout on the CPU. */
export interface ExampleBatch extends MicroBatch {
  x: Tensor;
  y: Tensor;
  positions: Int32Array;
  docIds: Int32Array;
}

export class ExampleLoader extends BatchCursor<ExampleBatch> implements TrainLoader {
  readonly sources: ExampleCorpus[];
  readonly pairs: boolean;
  readonly pack: boolean;
  readonly overflow: 'truncate' | 'drop';
  readonly epochs: number;
  readonly datasetKey: string;
  private rows: ExampleRows;
  private seedValue: number;
  private readonly slot: Int32Array;

  constructor(private readonly o: ExampleLoaderOptions) {
    super(o, o.prefetch ?? 0);
    if (o.sources.length === 0) throw new Error('loader: sources is empty; give at least one example dataset');
    const kinds = new Set(o.sources.map((s) => s.pairs));
    if (kinds.size > 1) throw new Error(`loader: preference data cannot be mixed with chat or completion data (${o.sources.map((s) => `${s.name}: ${s.kind}`).join(', ')})`);
    this.sources = o.sources;
    this.pairs = o.sources[0]!.pairs;
    if (this.pairs && this.seqLen < 2) throw new Error(`loader: a preference pair takes two documents of a row; data.seqLen = ${this.seqLen} is too short`);
    this.pack = o.pack ?? false;
    this.overflow = o.overflow ?? 'truncate';
    this.epochs = o.epochs ?? 0;
    this.datasetKey = o.datasetKey ?? o.sources.map((s) => `${s.name}[${s.spec.lo},${s.spec.hi})`).join('+');
    this.seedValue = checkSeed(o.seed ?? 0);
    this.rows = new ExampleRows(this.sources, this.rowsSpec());
    this.slot = new Int32Array(PLANES * this.microBatchSize * this.seqLen);
  }

  /** Plain data a worker thread rebuilds the rows from. */
  rowsSpec(): ExampleRowsSpec {
    return {
      corpora: this.sources.map((s) => s.spec),
      pack: { seqLen: this.seqLen, pack: this.pack, overflow: this.overflow },
      seed: this.seedValue, shuffle: this.o.shuffle ?? true, padId: this.o.padId,
      globalBatch: this.globalBatch, dpRank: this.dpRank, dpSize: this.dpSize, microBatches: this.microBatches,
    };
  }

  get seed(): number {
    return this.seedValue;
  }
  /** Examples (or pairs) the rows are planned from. */
  get units(): number {
    return this.rows.units;
  }

  /** Optimizer steps that make `epochs` passes: ceil(rows / globalBatch). */
  stepsFor(epochs: number): number {
    if (!(Number.isInteger(epochs) && epochs > 0)) throw new Error(`loader: epochs must be a positive integer, got ${epochs}`);
    return this.rows.stream.stepsFor(epochs, this.globalBatch);
  }

  /** The header line: units -> rows per epoch, fill, overflow, and what `steps` makes of the epochs. */
  describe(steps: number): string {
    const p = this.rows.stream.plan(0);
    const n = (v: number) => v.toLocaleString('en-US');
    const what = this.pairs ? 'pairs' : 'examples';
    const tail = this.epochs > 0
      ? `${this.epochs} epoch(s) = ${n(steps)} steps${this.rows.stream.rowsBefore(this.epochs) % this.globalBatch !== 0 ? ' (the last step completed from the next epoch\'s rows)' : ''}`
      : `train.steps = ${n(steps)} steps = ${(steps * this.globalBatch / p.rows).toFixed(2)} epochs`;
    return `${n(this.units)} ${what} -> ${n(p.rows)} rows x ${this.seqLen} per epoch (${this.pack ? 'packed, ' : ''}fill ${(100 * p.fill).toFixed(1)}%); ` +
      `${n(p.truncated)} truncated, ${n(p.dropped)} dropped (overflow = ${this.overflow}${this.rows.untrainedPairs > 0 ? `; ${n(this.rows.untrainedPairs)} of them pairs that a cut to ${this.seqLen} tokens would leave with a response of no trained token` : ''}); ${tail}`;
  }

  protected read(step: number, micro: number): ExampleBatch {
    this.rows.fill(step, micro, planesOf(this.slot, this.microBatchSize * this.seqLen));
    return this.assemble(this.slot);
  }

  protected prefetchSource(): PrefetchSource {
    return { kind: 'examples', spec: this.rowsSpec() };
  }

  protected fromSlot(slot: Int32Array): ExampleBatch {
    return this.assemble(slot);
  }

  /** Tensors (copies: the native side takes ordinary buffers, and the slot is reused) of one slot's planes. */
  private assemble(slot: Int32Array): ExampleBatch {
    const B = this.microBatchSize, T = this.seqLen;
    const pl = planesOf(slot, B * T);
    const shape = [B, T];
    const x = tensor(pl.x.slice(), { shape, dtype: 'int64' });
    const y = tensor(pl.y.slice(), { shape, dtype: 'int64' });
    const positions = pl.pos.slice();
    const docIds = pl.ids.slice();
    let several = false;
    for (let i = 0; i < B * T && !several; i++) several = pl.unit[i]! >= 0 && pl.ids[i]! > 0;
    const out: ExampleBatch = { x, y, positions, docIds };
    // Kept tensors, not the caller's tidy's: the step that consumes the batch disposes them.
    if (several) out.docs = documentLayout(positions, docIds, B, T);
    if (this.pairs) out.seqs = sequenceTable(pl, B, T);
    return out;
  }

  stateDict(): LoaderState {
    return {
      step: this.stepValue, micro: this.microValue, seed: this.seedValue, globalBatch: this.globalBatch, seqLen: this.seqLen,
      examples: this.exampleState(),
    };
  }

  private exampleState(): ExampleState {
    return { datasetKey: this.datasetKey, pack: this.pack, overflow: this.overflow, epochs: this.epochs };
  }

  /** Restores the cursor and seed; the geometry and the example fields must match the run that saved it. */
  loadStateDict(s: LoaderState): void {
    this.checkState(s, 'rows');
    if (!s.examples) throw new Error('loader state was saved by a run on text (data.format = "text"); this run reads examples: resume with the data.format and data.source of that run');
    const mine = this.exampleState();
    if (s.examples.datasetKey !== mine.datasetKey) {
      throw new Error('loader state was saved by a run on other examples (its datasetKey differs: another data.source, data.sources, data.valFraction or prepared data); resume with the data of that run');
    }
    const names = { pack: 'data.pack', overflow: 'data.overflow', epochs: 'train.epochs' } as const;
    for (const k of ['pack', 'overflow', 'epochs'] as const) {
      if (s.examples[k] !== mine[k]) {
        throw new Error(`loader state was saved with ${names[k]} = ${JSON.stringify(s.examples[k])}; this run has ${JSON.stringify(mine[k])}: resume with the same value to read the same rows`);
      }
    }
    if (checkSeed(s.seed) !== this.seedValue) {
      this.seedValue = s.seed;
      this.rows = new ExampleRows(this.sources, this.rowsSpec());
    }
    this.setPosition(s);
  }
}

/**
 * A preference micro-batch's sequences: each response document in row order; the first document
 * of a pair in its row is the chosen response, the second the rejected one. Targets no sequence
 * trains point at the dump slot nSeq.
 */
export function sequenceTable(pl: RowPlanes, B: number, T: number): SequenceTable {
  const seqOf = new Int32Array(B * T).fill(-1);
  const chosen: number[] = [], rejected: number[] = [], pairIds: number[] = [], lengths: number[] = [];
  let nSeq = 0;
  for (let b = 0; b < B; b++) {
    let lastDoc = -1, seq = -1, openUnit = -1;
    for (let t = 0; t < T; t++) {
      const i = b * T + t;
      const u = pl.unit[i]!;
      if (u < 0) break; // padding ends the row
      if (pl.ids[i] !== lastDoc) {
        lastDoc = pl.ids[i]!;
        seq = nSeq++;
        lengths.push(0);
        if (u !== openUnit) {
          openUnit = u;
          chosen.push(seq);
          pairIds.push(u);
        } else {
          rejected.push(seq);
        }
      }
      if (pl.y[i] !== IGNORE_INDEX) {
        seqOf[i] = seq;
        lengths[seq]!++;
      }
    }
  }
  if (chosen.length !== rejected.length) throw new Error('internal: a preference pair lost a response in its row');
  const index = new Int32Array(B * T);
  for (let i = 0; i < B * T; i++) index[i] = seqOf[i]! >= 0 ? seqOf[i]! : nSeq;
  return {
    index: tensor(index, { shape: [B, T], dtype: 'int64' }), nSeq,
    chosen: Int32Array.from(chosen), rejected: Int32Array.from(rejected), pairIds: Int32Array.from(pairIds), lengths: Int32Array.from(lengths),
  };
}
