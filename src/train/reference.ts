// The reference model of DPO ([Note: DPO criterion] in dpo.ts): each sequence's log-probability
// under the frozen starting point, written onto the micro-batch (mb.seqs.ref) before the step.
//
// [Note: DPO reference] Three sources, one interface:
//   adapters   (LoRA) the policy itself, forward only, with every adapter of every part off:
//              the base weights, with no second copy of them;
//   copy       (no LoRA) a second model built and loaded as the policy was at step 0, every
//              parameter frozen, placed by the same layout (sharded under ZeRO-3; no gradients,
//              buckets or optimizer state);
//   precompute the values of either, computed once before step 0 over the run's own micro-batches
//              and kept by pair id in RUN/reference/logps.f64 (reused on resume when its key matches).
// Each goes through the layout's forward-only pass (ParallelModel.forwardOnly), whose values are
// read where the criterion is (the last pipeline stage) with the criterion's own log-probability
// code, so the reference and the policy run the same path: with dropout off (DPO turns it off)
// the first step's log-ratios are exactly 0 and its loss is ln 2.
import { closeSync, existsSync, mkdirSync, openSync, readFileSync, renameSync, rmSync, writeFileSync, writeSync } from 'node:fs';
import { join } from 'node:path';
import { noGrad, tensor, type Tensor } from '../tensor/index.js';
import { withAdaptersDisabled } from '../nn/lora.js';
import type { Module } from '../nn/module.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { MicroBatch, ParallelModel, StageValue } from '../parallel/parallel_model.js';
import type { PipelineModel } from '../parallel/pipeline/model.js';
import { readSequenceLogps, tableOf } from './dpo.js';

/** Where each micro-batch's reference log-probabilities come from (filled onto mb.seqs.ref). */
export interface ReferenceSource {
  /** Fills mb.seqs.ref of every micro-batch of this rank's step (a collective: every rank calls it). */
  logps(mbs: MicroBatch[]): void;
  /** One line for the run's header. */
  describe(): string;
  dispose(): void;
}

/** Reads one micro-batch's values from the model's output (on the ranks that hold the criterion). */
export type ReadFn = (output: StageValue, mb: MicroBatch) => Float64Array;
type ForwardOnly = (mbs: MicroBatch[], read: ReadFn) => Float64Array[];

/**
 * Each sequence's summed log-probability, read as the DPO criterion reads the policy's (cp: the
 * ring, whose ranks each sum their chunks; under loss parallelism the layout runs the read with
 * its vocab-parallel cross-entropy).
 */
export function sequenceReader(g: { cp?: ProcessGroup | undefined }): ReadFn {
  return (out, mb) => readSequenceLogps(out, mb, g.cp);
}

function forwardOnlyOf(model: ParallelModel): ForwardOnly {
  return model.forwardOnly.bind(model);
}

/**
 * Puts each micro-batch's values onto its table. A rank that holds no criterion (a pipeline stage
 * before the last) gets none and needs none.
 */
function fill(mbs: MicroBatch[], values: Float64Array[]): void {
  mbs.forEach((mb, i) => {
    const seqs = tableOf(mb), v = values[i];
    if (v && v.length === seqs.nSeq) seqs.ref = v;
  });
}

/** dpo.reference = "adapters": the policy with the LoRA adapters of every part off. */
export function adaptersReference(model: ParallelModel, read: ReadFn): ReferenceSource {
  const forwardOnly = forwardOnlyOf(model);
  return {
    logps(mbs) {
      const off = model.parts.reduceRight<() => Float64Array[]>((fn, part) => () => withAdaptersDisabled(part, fn), () => forwardOnly(mbs, read));
      fill(mbs, noGrad(off));
    },
    describe: () => 'the policy with its LoRA adapters off',
    dispose() {},
  };
}

/** dpo.reference = "copy": a frozen model placed by the same layout (it is disposed with the source). */
export function modelReference(model: ParallelModel, read: ReadFn, what: string): ReferenceSource {
  const forwardOnly = forwardOnlyOf(model);
  for (const part of model.parts) part.eval();
  return {
    logps(mbs) {
      fill(mbs, noGrad(() => forwardOnly(mbs, read)));
    },
    describe: () => what,
    dispose: () => model.dispose(),
  };
}

/** Freezes every parameter of a model as built (a pipeline's stages as they are built): the reference copy. */
export function frozen<T extends Module | PipelineModel>(built: T): T {
  const freeze = (m: Module): Module => {
    for (const [, p] of m.namedParameters()) p.requiresGrad = false;
    return m;
  };
  if (!('stage' in built)) return freeze(built as Module) as T;
  const pm = built as PipelineModel;
  const staged = Object.create(pm) as PipelineModel;
  staged.stage = (i: number, n: number) => freeze(pm.stage(i, n));
  return staged as T;
}

// ---- precompute: one pass before step 0, kept in the run directory

/** What the kept values were computed from: a different key computes them again. */
export interface ReferenceKey {
  /** The dataset (its prepared key) and how its rows were cut. */
  data: string;
  /** The reference's weights: train.initFrom's identity, or the seed. */
  base: string;
  reference: string;
}

export const REFERENCE_DIR = 'reference';
const LOGPS = 'logps.f64';
const KEY = 'reference.json';

/** Per pair: the reference log-probabilities of its chosen and its rejected response, NaN where not computed. */
export class PairTable {
  constructor(readonly values: Float64Array) {}
  static empty(pairs: number): PairTable {
    return new PairTable(new Float64Array(2 * pairs).fill(NaN));
  }
  get pairs(): number {
    return this.values.length / 2;
  }
  /** Records the values of a micro-batch's pairs (its table's ref). */
  record(mb: MicroBatch): void {
    const s = tableOf(mb);
    if (!s.ref) return;
    s.pairIds.forEach((id, i) => {
      this.values[2 * id] = s.ref![s.chosen[i]!]!;
      this.values[2 * id + 1] = s.ref![s.rejected[i]!]!;
    });
  }
  /** Fills a micro-batch's table from the pairs' kept values. */
  apply(mb: MicroBatch): void {
    const s = tableOf(mb);
    const ref = new Float64Array(s.nSeq).fill(NaN);
    s.pairIds.forEach((id, i) => {
      const c = this.values[2 * id]!, r = this.values[2 * id + 1]!;
      if (Number.isNaN(c) || Number.isNaN(r)) throw new Error(`DPO: pair ${id} has no precomputed reference log-probability; delete the run's ${REFERENCE_DIR} directory to compute them again`);
      ref[s.chosen[i]!] = c;
      ref[s.rejected[i]!] = r;
    });
    s.ref = ref;
  }
  /**
   * Every rank's pairs in every rank's table: a sum over `group` where each pair was recorded by
   * exactly one rank (`mine`: this rank contributes), NaN for a pair none recorded.
   */
  gather(group: ProcessGroup, mine: boolean): PairTable {
    const n = this.values.length;
    const have = new Float64Array(n), vals = new Float64Array(n);
    if (mine) for (let i = 0; i < n; i++) if (!Number.isNaN(this.values[i]!)) (have[i] = 1), (vals[i] = this.values[i]!);
    const both = noGrad(() => {
      const t: Tensor = tensor(Float64Array.from([...vals, ...have]));
      if (group.size > 1) group.allReduce(t, 'sum').wait();
      return t.toArray() as Float64Array;
    });
    const out = new Float64Array(n);
    for (let i = 0; i < n; i++) out[i] = both[n + i]! > 0 ? both[i]! / both[n + i]! : NaN;
    return new PairTable(out);
  }
}

/** The kept table of a run directory when its key is this run's, else undefined. */
export function readPairTable(runDir: string, key: ReferenceKey, pairs: number, file = LOGPS): PairTable | undefined {
  const dir = join(runDir, REFERENCE_DIR);
  if (!existsSync(join(dir, KEY)) || !existsSync(join(dir, file))) return undefined;
  let kept: ReferenceKey;
  try {
    kept = JSON.parse(readFileSync(join(dir, KEY), 'utf8')) as ReferenceKey;
  } catch {
    return undefined;
  }
  if (kept.data !== key.data || kept.base !== key.base || kept.reference !== key.reference) return undefined;
  const buf = readFileSync(join(dir, file));
  if (buf.byteLength !== 16 * pairs) return undefined;
  return new PairTable(new Float64Array(buf.buffer.slice(buf.byteOffset, buf.byteOffset + buf.byteLength)));
}

/**
 * Writes a table; the key goes last (`last`: after the run's last table), so that tables without
 * their key, or with another run's, are never read.
 */
export function writePairTable(runDir: string, key: ReferenceKey, table: PairTable, file = LOGPS, last = true): void {
  const dir = join(runDir, REFERENCE_DIR);
  mkdirSync(dir, { recursive: true });
  if (existsSync(join(dir, KEY)) && file === LOGPS) rmSync(join(dir, KEY)); // stale until every table is written again
  const tmp = join(dir, `${file}.tmp`);
  const fd = openSync(tmp, 'w');
  try {
    writeSync(fd, new Uint8Array(table.values.buffer, table.values.byteOffset, table.values.byteLength));
  } finally {
    closeSync(fd);
  }
  renameSync(tmp, join(dir, file));
  if (!last) return;
  writeFileSync(join(dir, `${KEY}.tmp`), JSON.stringify(key));
  renameSync(join(dir, `${KEY}.tmp`), join(dir, KEY));
}

/** dpo.precompute: the kept values of every pair (no model at all during training). */
export function precomputedReference(table: PairTable, what: string): ReferenceSource {
  return {
    logps(mbs) {
      for (const mb of mbs) table.apply(mb);
    },
    describe: () => what,
    dispose() {},
  };
}

// ---- the run's reference: live each step, or precomputed before step 0

/** What the reference reads its batches from: the run's loaders (an example loader's units and epoch steps). */
export interface ReferenceLoader {
  batch(step: number, micro: number): MicroBatch;
  readonly units?: number;
  readonly datasetKey?: string;
  stepsFor?(epochs: number): number;
}

export interface DpoReferenceOptions {
  /** The reference each step when not precomputed, and the one a precompute runs. */
  live: ReferenceSource;
  precompute: boolean;
  world: ProcessGroup;
  /** This rank's values count in the precomputed table (one rank of each tp x cp x pp replica set). */
  contributes: boolean;
  key: ReferenceKey;
  train: ReferenceLoader;
  val: ReferenceLoader;
  microBatches: number;
  evalBatches: number;
  /** Steps the run makes: a precompute covers epoch 0 or these, whichever is fewer. */
  steps: number;
  /** Around each forward-only pass (the run's autocast and kernels). */
  scope<R>(fn: () => R): R;
}

/**
 * The reference of a DPO run ([Note: DPO reference]): with dpo.precompute, before step 0 the
 * reference's values of every pair of epoch 0 (and of the validation batches) are computed in the
 * run's own micro-batches, gathered on every rank and kept in RUN/reference; a resume reads them
 * back when their key matches. The live source (a copy) is then disposed.
 */
export class DpoReference {
  private train: PairTable | undefined;
  private val: PairTable | undefined;
  private live: ReferenceSource | undefined;

  constructor(private readonly o: DpoReferenceOptions) {
    this.live = o.live;
  }

  /** Before step 0 (every rank): the precomputed tables, read back or computed; returns a line for the header. */
  prepare(runDir: string | undefined): string {
    const o = this.o;
    if (!o.precompute) return `reference: ${o.live.describe()}, each step`;
    const trainUnits = o.train.units ?? 0, valUnits = o.val.units ?? 0;
    const kept = o.world.rank === 0 && runDir ? [readPairTable(runDir, o.key, trainUnits, LOGPS), readPairTable(runDir, o.key, valUnits, VAL_LOGPS)] : [];
    const found = sumFlag(o.world, kept.length === 2 && kept.every((t) => t !== undefined));
    let how: string;
    if (found) {
      this.train = broadcastTable(o.world, kept[0], trainUnits);
      this.val = broadcastTable(o.world, kept[1], valUnits);
      how = `read back from ${runDir ?? 'the run directory'}/${REFERENCE_DIR}`;
    } else {
      const epoch = o.train.stepsFor ? o.train.stepsFor(1) : o.steps;
      const steps = Math.min(epoch, o.steps);
      this.train = this.pass(trainUnits, steps, (s, m) => o.train.batch(s, m), o.microBatches);
      this.val = this.pass(valUnits, o.evalBatches, (k, m) => o.val.batch(k, m), o.microBatches);
      if (o.world.rank === 0 && runDir) {
        writePairTable(runDir, o.key, this.train, LOGPS, false);
        writePairTable(runDir, o.key, this.val, VAL_LOGPS, true);
      }
      how = `computed before step 0 over ${steps} step(s) of batches and kept in ${REFERENCE_DIR}/`;
    }
    const what = o.live.describe();
    this.live?.dispose();
    this.live = undefined;
    return `reference: ${what}, ${how}`;
  }

  private pass(units: number, steps: number, batch: (s: number, m: number) => MicroBatch, M: number): PairTable {
    const table = PairTable.empty(units);
    for (let s = 0; s < steps; s++) {
      this.o.scope(() => {
        const mbs = Array.from({ length: M }, (_, m) => batch(s, m));
        this.live!.logps(mbs);
        for (const mb of mbs) table.record(mb);
      });
    }
    return table.gather(this.o.world, this.o.contributes);
  }

  /** A training step's micro-batches, their reference values filled. */
  logps(mbs: MicroBatch[]): MicroBatch[] {
    if (this.train) for (const mb of mbs) this.train.apply(mb);
    else this.live!.logps(mbs);
    return mbs;
  }

  /** An evaluation's micro-batches, their reference values filled. */
  evalLogps(mbs: MicroBatch[]): MicroBatch[] {
    if (this.val) for (const mb of mbs) this.val.apply(mb);
    else this.live!.logps(mbs);
    return mbs;
  }

  dispose(): void {
    this.live?.dispose();
    this.live = undefined;
  }
}

const VAL_LOGPS = 'val_logps.f64';

function sumFlag(world: ProcessGroup, mine: boolean): boolean {
  if (world.size === 1) return mine;
  return noGrad(() => {
    const t = tensor(Float64Array.of(mine ? 1 : 0));
    world.allReduce(t, 'max').wait();
    return t.item() > 0;
  });
}

function broadcastTable(world: ProcessGroup, table: PairTable | undefined, pairs: number): PairTable {
  if (world.size === 1) return table!;
  return noGrad(() => {
    const t = world.rank === 0 ? tensor(table!.values) : tensor(new Float64Array(2 * pairs));
    world.broadcast(t, 0).wait();
    return new PairTable(new Float64Array(t.toArray() as Float64Array));
  });
}
