// Distributed checkpoints: every rank writes the pieces it owns ([Note: placement] in
// src/parallel/placement.ts), rank 0 publishes the checkpoint once every rank's file is durable, and
// any layout loads it back by reading just the byte ranges it needs (format.ts describes the files).
//
// [Note: checkpoint durability]
//   1. Every rank copies its pieces out of the tensors (the only part that blocks training when
//      saving in the background) and writes rank-NNNNN.safetensors into .tmp-step-N/, hashing the
//      bytes as they go and fsync-ing the file.
//   2. All ranks agree that every rank finished (one tiny all-reduce, at a step boundary: in the
//      background mode a later step notices, the next save or the end of the run waits), then
//      gather each other's index of what they wrote (the sidecars; nobody reads another's disk).
//   3. The publisher merges the sidecars into meta.json (fsync), renames .tmp-step-N to step-N
//      (fsync of the parent), and only then moves `latest` and deletes checkpoints beyond `keep`.
// A run killed at any point leaves the previous checkpoint and `latest` intact; a leftover
// .tmp-step-N is removed by the next run that saves into the directory.
//
// [Note: checkpoint replicas] Without shared storage (replicas = 1, several hosts) each host saves
// into a directory of its own: rank r's file is written there and also sent to rank r + L (L ranks
// a host: the same local rank on the next host, around the ring), which writes and fsyncs it too,
// so each host's directory holds its own ranks' files and the previous host's. Every host's first
// rank publishes into its own directory the same meta.json (all files listed), once every file and
// every copy is durable: losing any one host and its disk leaves each file on a survivor.
// `flotilla checkpoint check DIR...` checks the files across the hosts' directories.
import { existsSync, mkdirSync, readdirSync, renameSync, rmSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { Tensor, noGrad, tidy, tensor } from '../tensor/index.js';
import { native } from '../tensor/native.js';
import { dtypeCode, elementSize, type DType } from '../tensor/dtype.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { Optimizer } from '../optim/optimizer.js';
import { wholeRuns, type ElementRange, type ParamPlacement, type Run } from '../parallel/placement.js';
import { layoutFor } from '../parallel/layout.js';
import { encodeSafetensorsHeader, readSafetensorsHeader, type SafetensorsEntry } from './safetensors.js';
import { BackgroundWriter, type WrittenFile } from './writer.js';
import { exchangeReplica, gatherJson } from './replicas.js';
import { fileSha256, fsyncDir, writeDurable } from '../io/durable.js';
import { RangeReader } from './range_reader.js';
import {
  CHECKPOINT_FORMAT, CheckpointError, LATEST_FILE, META_FILE, listCheckpoints, numelOf, readMeta, resolveCheckpoint, stepDirName,
  type CheckpointMeta, type ParamInfo, type Piece,
} from './format.js';

// eslint-disable-next-line @typescript-eslint/no-explicit-any
type AnyOptimizer = Optimizer<any>;

/** What a save records besides the tensors (rank 0 writes it into meta.json). */
export type RunInfo = Pick<CheckpointMeta, 'layout' | 'config' | 'data' | 'rng' | 'schedule' | 'moe' | 'base'>;

/** The state of one rank: where its parameters live, and its optimizer. */
export interface RankState {
  placements: ParamPlacement[];
  optimizer?: AnyOptimizer;
  /** Optimizer name recorded in meta.json (default the class name). */
  optimizerName?: string;
}

interface Sidecar {
  file: string;
  written: WrittenFile;
  /** The copy of another rank's file this rank wrote ([Note: checkpoint replicas]). */
  replica?: WrittenFile;
  params: Record<string, ParamInfo>;
  paramSteps: Record<string, number>;
  stepCount: number | undefined;
  optimizerName: string | undefined;
  pieces: Piece[];
}

const rankFile = (rank: number): string => `rank-${String(rank).padStart(5, '0')}.safetensors`;
const tmpDirName = (step: number): string => `.tmp-${stepDirName(step)}`;

/**
 * [Note: staging buffer] A save copies this rank's pieces into one buffer that lives as long as the
 * Checkpointer, shared with the writer thread (torchtitan stages into pinned memory for the same
 * reason). Reused, its pages are already resident, so the copy that blocks training is a memcpy;
 * a fresh allocation per save faulted in every page first, and cost more than the copy.
 */
class Staging {
  private buf: SharedArrayBuffer | undefined;
  /** A buffer of at least n bytes (grown, never shrunk). */
  get(n: number): SharedArrayBuffer {
    if (!this.buf || this.buf.byteLength < n) this.buf = new SharedArrayBuffer(Math.max(n, Math.ceil((this.buf?.byteLength ?? 0) * 1.25)));
    return this.buf;
  }
}

/**
 * Copies this rank's pieces out of the tensors into the staging buffer, as safetensors bytes
 * (header first), with the index of what they hold. After it returns, training may change the tensors.
 */
function snapshot(state: RankState, rank: number, staging: Staging): { staged: SharedArrayBuffer; length: number; sidecar: Omit<Sidecar, 'written'> } {
  const file = rankFile(rank);
  const params: Record<string, ParamInfo> = {};
  const paramSteps: Record<string, number> = {};
  const entries: { key: string; kind: string; name: string; offset: number; numel: number; dtype: DType; runs?: Piece['runs'] }[] = [];
  return tidy(() => {
    const tensors: Record<string, Tensor> = {};
    for (const p of state.placements) {
      params[p.name] = { shape: [...p.shape], dtype: p.dtype };
      const ps = state.optimizer?.paramState(p.param);
      if (ps) paramSteps[p.name] = ps.step;
      const w = p.writes;
      if (w.numel === 0) continue;
      // Pieces are in whole-parameter offsets: a tensor-parallel slice writes its runs as strided pieces.
      const groups = stridedGroups(wholeRuns(p, w));
      const add = (kind: string, src: Tensor, srcOffset: number) => {
        for (const gr of groups) {
          const key = `${kind}/${p.name}@${gr.whole}`;
          tensors[key] = src.narrow(0, gr.local - srcOffset, gr.numel);
          entries.push({ key, kind, name: p.name, offset: gr.whole, numel: gr.numel, dtype: src.dtype, ...(gr.count > 1 ? { runs: { count: gr.count, stride: gr.stride } } : {}) });
        }
      };
      add('param', p.values(), p.held.offset);
      if (ps) for (const [k, t] of Object.entries(ps.state)) add(k, t, ps.offset);
    }
    // The layout: tensors end to end in insertion order after the header.
    let at = 0;
    const layout: [string, SafetensorsEntry][] = entries.map((e) => {
      const bytes = e.numel * elementSize(e.dtype);
      const entry: [string, SafetensorsEntry] = [e.key, { dtype: e.dtype, shape: [e.numel], dataOffsets: [at, at + bytes] }];
      at += bytes;
      return entry;
    });
    const header = encodeSafetensorsHeader(layout, { format: 'pt', flotilla: CHECKPOINT_FORMAT, rank: String(rank) });
    const length = header.length + at;
    const staged = staging.get(length);
    header.copy(new Uint8Array(staged, 0, header.length));
    const pieces: Piece[] = entries.map((e, i) => {
      const [begin, end] = layout[i]![1].dataOffsets;
      native.copyToBuffer(tensors[e.key]!.handle, new Uint8Array(staged, header.length + begin, end - begin));
      return { file, kind: e.kind, name: e.name, offset: e.offset, numel: e.numel, dtype: e.dtype, byte: header.length + begin, ...(e.runs ? { runs: e.runs } : {}) };
    });
    const stepCount = state.optimizer?.stepCount;
    const optimizerName = state.optimizer ? (state.optimizerName ?? state.optimizer.constructor.name) : undefined;
    return { staged, length, sidecar: { file, params, paramSteps, stepCount, optimizerName, pieces } };
  });
}

interface PendingSave {
  step: number;
  tmp: string;
  settled: Promise<void>;
  done: boolean;
  error?: Error;
  info: RunInfo;
  /** This rank's index of what it wrote (gathered by the publishers). */
  sidecar?: Sidecar;
}

export interface CheckpointerOptions {
  /** The checkpoints directory (step-N directories and `latest` go here). */
  dir: string;
  /** Complete checkpoints kept. */
  keep: number;
  /** Write on a background thread while training continues. */
  async: boolean;
  /** Every rank of the run: agreement that a save is complete is one all-reduce over it. */
  world: ProcessGroup;
  /** Rank 0's log line sink. */
  log?: (line: string) => void;
  /** Ranks per host (LOCAL_WORLD_SIZE; host h holds ranks h*L..h*L+L-1); default: every rank on one host. */
  ranksPerHost?: number;
  /** 1: each host saves into its own directory and keeps a copy of the previous host's files ([Note: checkpoint replicas]). */
  replicas?: 0 | 1;
}

export interface SaveReport {
  step: number;
  /** Milliseconds the caller was blocked (the copy, plus the write when saving in the foreground). */
  blockedMs: number;
  /** Bytes this rank copied for writing. */
  bytes: number;
}

/** Saves checkpoints of one run; every rank owns one and calls it at the same steps. */
export class Checkpointer {
  readonly dir: string;
  private readonly opts: CheckpointerOptions;
  private readonly writer = new BackgroundWriter();
  private readonly staging = new Staging();
  private readonly replicaStaging = new Staging();
  private pending: PendingSave | undefined;
  private readonly ranksPerHost: number;
  /** Whether this save sends each file to the next host ([Note: checkpoint replicas]). */
  private readonly replicated: boolean;
  /** The newest checkpoint this run published (rank 0 knows; others see it after the agreement). */
  lastSaved: string | undefined;

  constructor(opts: CheckpointerOptions) {
    if (!Number.isInteger(opts.keep) || opts.keep < 1) throw new Error(`checkpoint.keep must be a positive integer, got ${opts.keep}`);
    this.opts = opts;
    this.dir = resolve(opts.dir);
    const w = opts.world.size;
    this.ranksPerHost = opts.ranksPerHost ?? w;
    if (!Number.isInteger(this.ranksPerHost) || this.ranksPerHost < 1 || w % this.ranksPerHost !== 0) {
      throw new Error(`internal: ${w} ranks do not split into hosts of ${this.ranksPerHost}`);
    }
    this.replicated = (opts.replicas ?? 0) === 1 && w > this.ranksPerHost;
  }

  /** Whether this rank writes meta.json and moves `latest` (rank 0, or each host's first rank with replicas). */
  private get publisher(): boolean {
    return this.replicated ? this.opts.world.rank % this.ranksPerHost === 0 : this.opts.world.rank === 0;
  }

  /** True while a background save is not yet published. */
  get busy(): boolean {
    return this.pending !== undefined;
  }

  /**
   * Saves the state after `step` optimizer steps. Collective: every rank calls it at the same step.
   * In the background mode it returns once the state is copied; otherwise once the checkpoint is
   * published.
   */
  async save(step: number, state: RankState, runInfo: Partial<RunInfo> = {}): Promise<SaveReport> {
    const t0 = performance.now();
    // What a script that is not the trainer does not say is recorded as unknown, not invented.
    const info: RunInfo = {
      layout: { worldSize: this.opts.world.size, description: 'unspecified', ...layoutFor({}, this.opts.world.size) },
      config: {}, data: { step, micro: 0, seed: 0, globalBatch: 0, seqLen: 0 }, rng: { kind: 'seed-per-step', seed: 0 }, schedule: { step },
      ...runInfo,
    };
    await this.finishPending();
    const world = this.opts.world;
    const tmp = join(this.dir, tmpDirName(step));
    mkdirSync(tmp, { recursive: true });
    const { staged, length, sidecar } = snapshot(state, world.rank, this.staging);
    let bytes = length;
    // The writer thread writes in both modes; a blocking save just waits for it below.
    const written = this.writer.write(join(tmp, sidecar.file), staged, length);
    let replica: Promise<WrittenFile | undefined> = Promise.resolve(undefined);
    if (this.replicated) {
      const r = exchangeReplica(world, staged, length, this.ranksPerHost, this.replicaStaging);
      bytes += r.length;
      replica = this.writer.write(join(tmp, rankFile(r.from)), r.staged, r.length).then((f) => ({ ...f, path: rankFile(r.from) }));
    }
    const p: PendingSave = { step, tmp, done: false, info, settled: Promise.resolve() };
    p.settled = Promise.all([written, replica]).then(
      ([w, rw]) => {
        p.sidecar = { ...sidecar, written: { ...w, path: sidecar.file }, ...(rw ? { replica: rw } : {}) };
        p.done = true;
      },
      (e: Error) => {
        p.error = e;
        p.done = true;
      },
    );
    this.pending = p;
    if (!this.opts.async) await this.finishPending();
    return { step, blockedMs: performance.now() - t0, bytes };
  }

  /**
   * Publishes a background save once every rank's file is written; call at every step boundary
   * (collective while a save is pending: one small all-reduce; nothing otherwise).
   */
  poll(): void {
    if (this.pending) this.agreeAndPublish(false);
  }

  /** Waits for a save in flight and publishes it (collective). Call before exiting. */
  async finishPending(): Promise<void> {
    const p = this.pending;
    if (!p) return;
    await p.settled;
    this.agreeAndPublish(true);
  }

  /** Stops the writer thread (after finishPending). */
  async close(): Promise<void> {
    await this.writer.close();
  }

  private agreeAndPublish(waited: boolean): void {
    const p = this.pending!;
    const world = this.opts.world;
    const flags = tensor([p.error ? 1 : 0, p.done ? 0 : 1], { dtype: 'float64' });
    let failed: number, notDone: number;
    try {
      if (world.size > 1) world.allReduce(flags, 'max').wait();
      [failed, notDone] = flags.toNumbers() as [number, number];
    } finally {
      flags.dispose();
    }
    if (failed > 0) {
      this.pending = undefined;
      if (this.replicated && p.error && /EEXIST/.test(p.error.message)) {
        throw new CheckpointError(
          `saving checkpoint ${stepDirName(p.step)} failed: two hosts write into the same directory ${this.dir}; with [checkpoint] replicas = 1 ` +
            'each host needs a directory of its own (its local disk): set [checkpoint] dir to a local path, or --checkpoint.replicas=0 on a shared filesystem. The previous checkpoint is intact',
        );
      }
      throw new CheckpointError(
        `saving checkpoint ${stepDirName(p.step)} failed${p.error ? `: ${p.error.message}` : ' on another rank (see its output)'}; ` +
          `the previous checkpoint is intact. Check free space and permissions in ${this.dir}`,
      );
    }
    if (notDone > 0) {
      if (waited) throw new Error('internal: a checkpoint write settled but is not done');
      return;
    }
    this.pending = undefined;
    const name = stepDirName(p.step);
    const sidecars = gatherJson<Sidecar>(world, p.sidecar!);
    if (this.publisher) this.publish(p, sidecars);
    if (world.rank === 0) this.opts.log?.(`[checkpoint] saved ${join(this.dir, name)}${this.replicated ? ` (each host's own directory; every file also on the next host)` : ''}`);
    this.lastSaved = join(this.dir, name);
  }

  /** The publisher: merge the sidecars into meta.json, then make the checkpoint visible and prune. */
  private publish(p: PendingSave, sidecars: readonly Sidecar[]): void {
    const params: Record<string, ParamInfo> = {};
    const paramSteps: Record<string, number> = {};
    const files: CheckpointMeta['files'] = {};
    const pieces: Piece[] = [];
    let stepCount: number | undefined;
    let optimizerName: string | undefined;
    for (const sc of sidecars) {
      Object.assign(params, sc.params);
      Object.assign(paramSteps, sc.paramSteps);
      files[sc.file] = { bytes: sc.written.bytes, sha256: sc.written.sha256 };
      pieces.push(...sc.pieces);
      stepCount ??= sc.stepCount;
      optimizerName ??= sc.optimizerName;
    }
    // Every element of every parameter written exactly once: a layout that wrote a range twice
    // or not at all is a bug to stop at, not a checkpoint to publish.
    const covered = new Map<string, number>();
    for (const pc of pieces) if (pc.kind === 'param') covered.set(pc.name, (covered.get(pc.name) ?? 0) + pc.numel);
    for (const [name, info] of Object.entries(params)) {
      if ((covered.get(name) ?? 0) !== numelOf(info.shape)) {
        throw new Error(`internal: checkpoint ${stepDirName(p.step)} holds ${covered.get(name) ?? 0} of the ${numelOf(info.shape)} elements of '${name}'`);
      }
    }
    // A copy that differs from what its rank wrote is not a replica: stop before publishing it.
    for (const sc of sidecars) {
      if (sc.replica && files[sc.replica.path]?.sha256 !== sc.replica.sha256) throw new Error(`internal: the copy of ${sc.replica.path} written beside ${sc.file} differs from the original`);
    }
    const storage = this.replicated ? { storage: { hosts: this.opts.world.size / this.ranksPerHost, ranksPerHost: this.ranksPerHost, replicas: 1 } } : {};
    const meta: CheckpointMeta = {
      format: CHECKPOINT_FORMAT, step: p.step, savedAt: new Date().toISOString(), ...p.info, params,
      optimizer: optimizerName !== undefined ? { name: optimizerName, stepCount: stepCount ?? 0, paramSteps } : undefined,
      files, pieces, ...storage,
    };
    writeDurable(join(p.tmp, META_FILE), `${JSON.stringify(meta)}\n`);
    fsyncDir(p.tmp);
    const final = join(this.dir, stepDirName(p.step));
    let old: string | undefined;
    if (existsSync(final)) {
      old = join(this.dir, `.old-${stepDirName(p.step)}-${process.pid}`);
      renameSync(final, old);
    }
    renameSync(p.tmp, final);
    fsyncDir(this.dir);
    writeDurable(join(this.dir, LATEST_FILE), `${stepDirName(p.step)}\n`);
    fsyncDir(this.dir);
    if (old) rmSync(old, { recursive: true, force: true });
    // Only now, with the new checkpoint durable, do old ones go.
    const complete = listCheckpoints(this.dir);
    for (const c of complete.slice(0, Math.max(0, complete.length - this.opts.keep))) rmSync(join(this.dir, c.name), { recursive: true, force: true });
  }
}

/**
 * Removes the saves an earlier run left unfinished (never a checkpoint, never `latest`). Rank 0
 * calls it once before training starts: no rank can reach a save before rank 0 has passed it.
 */
export function removeInterruptedSaves(dir: string): string[] {
  if (!existsSync(dir)) return [];
  const gone = readdirSync(dir).filter((n) => n.startsWith('.tmp-step-') || n.startsWith('.old-step-'));
  for (const name of gone) rmSync(join(dir, name), { recursive: true, force: true });
  return gone;
}

/** Checks the recorded checksums of the named files (of the whole checkpoint by default). */
export function verifyFiles(dir: string, meta: CheckpointMeta, names: Iterable<string> = Object.keys(meta.files)): void {
  for (const f of names) {
    const want = meta.files[f]!.sha256;
    const have = fileSha256(join(dir, f));
    if (have !== want) throw new CheckpointError(`${join(dir, f)}: checksum mismatch (sha256 ${have.slice(0, 16)}..., ${META_FILE} records ${want.slice(0, 16)}...): the file is corrupt`);
  }
}


/**
 * Fills `target` (a flat view of elements range.offset.. of one tensor) from the pieces on disk
 * that intersect it; every element must be covered.
 */
/**
 * Consecutive local runs as strided groups: runs of equal length a constant stride apart in the
 * whole tensor become one piece (a row-parallel slice is one piece, not one per row).
 */
function stridedGroups(runs: Run[]): { local: number; whole: number; numel: number; count: number; stride: number }[] {
  const out: { local: number; whole: number; numel: number; count: number; stride: number; len: number }[] = [];
  for (const r of runs) {
    const g = out[out.length - 1];
    if (g && r.numel === g.len && g.local + g.numel === r.local && (g.count === 1 ? r.whole > g.whole + g.len - 1 : r.whole === g.whole + g.count * g.stride)) {
      if (g.count === 1) g.stride = r.whole - g.whole;
      g.count += 1;
      g.numel += r.numel;
    } else {
      out.push({ local: r.local, whole: r.whole, numel: r.numel, count: 1, stride: r.numel, len: r.numel });
    }
  }
  return out;
}

/** A run's range in whole-parameter offsets. */
function wholeRange(r: Run): ElementRange {
  return { offset: r.whole, numel: r.numel };
}

/**
 * Fills target, which holds `range` of the parameter's local (tensor-parallel) slice, run by run
 * from the pieces that cover each run's whole-parameter range.
 */
function fillRuns(p: ParamPlacement, target: Tensor, range: ElementRange, pieces: (r: ElementRange) => Piece[], reader: RangeReader, what: string): void {
  for (const r of wholeRuns(p, range)) {
    tidy(() => {
      const t = r.local === range.offset && r.numel === range.numel ? target : target.narrow(0, r.local - range.offset, r.numel);
      fillRange(t, wholeRange(r), pieces(wholeRange(r)), reader, what);
    });
  }
}

function fillRange(target: Tensor, range: ElementRange, pieces: readonly Piece[], reader: RangeReader, what: string): void {
  const lo = range.offset;
  const hi = lo + range.numel;
  let covered = 0;
  for (const pc of pieces) {
    const a = Math.max(lo, pc.offset);
    const b = Math.min(hi, pc.offset + pc.numel);
    if (b <= a) continue;
    const es = elementSize(pc.dtype);
    const bytes = reader.read(pc.file, pc.byte + (a - pc.offset) * es, (b - a) * es);
    tidy(() => {
      const src = new Tensor(native.fromBuffer(bytes, [b - a], dtypeCode(pc.dtype)));
      noGrad(() => target.narrow(0, a - lo, b - a).copy_(src));
    });
    covered += b - a;
  }
  if (covered !== range.numel) {
    throw new CheckpointError(`${what}: the checkpoint holds ${covered} of the ${range.numel} elements [${lo}, ${hi}) this rank needs; it is incomplete`);
  }
}

/** Pieces by (kind, name), sorted by offset. */
function indexPieces(pieces: readonly Piece[]): Map<string, Piece[]> {
  const m = new Map<string, Piece[]>();
  for (const p of pieces) {
    const k = `${p.kind}\u0000${p.name}`;
    if (!m.has(k)) m.set(k, []);
    m.get(k)!.push(p);
  }
  for (const l of m.values()) l.sort((a, b) => a.offset - b.offset);
  return m;
}

export interface LoadOptions {
  /** Also load optimizer state and update counts (resume); without it, weights only (initFrom). */
  optimizer?: AnyOptimizer;
  /** The whole model's parameter count: a checkpoint of another size is refused before reading. */
  numParams?: number;
}

/** Checks that the checkpoint's parameter table matches this rank's parameters (names, shapes). */
function checkModel(where: string, table: Record<string, ParamInfo>, placements: readonly ParamPlacement[], numParams: number | undefined): void {
  const missing: string[] = [];
  for (const p of placements) {
    const info = table[p.name];
    if (!info) {
      missing.push(p.name);
      continue;
    }
    if (info.shape.length !== p.shape.length || info.shape.some((d, i) => d !== p.shape[i])) {
      throw new CheckpointError(
        `${where}: parameter '${p.name}' is [${info.shape.join(', ')}] there and [${p.shape.join(', ')}] in this model; ` +
          'it comes from a different model config (compare the [model] sections)',
      );
    }
  }
  if (missing.length > 0) {
    throw new CheckpointError(
      `${where} has no parameter${missing.length > 1 ? 's' : ''} ${missing.slice(0, 4).map((n) => `'${n}'`).join(', ')}${missing.length > 4 ? `, ... (${missing.length} in all)` : ''}; ` +
        `it holds ${Object.keys(table).slice(0, 4).map((n) => `'${n}'`).join(', ')}...: it comes from a different model`,
    );
  }
  if (numParams !== undefined) {
    const total = Object.values(table).reduce((a, i) => a + numelOf(i.shape), 0);
    if (total !== numParams) {
      throw new CheckpointError(`${where} holds ${total.toLocaleString('en-US')} parameters, this model has ${numParams.toLocaleString('en-US')}: it comes from a different model config`);
    }
  }
}

/**
 * Loads a checkpoint into this rank's parameters (and optimizer state) under any layout: each rank
 * reads only the byte ranges of the pieces its placements need, after verifying the checksums of
 * the files it reads. No collective; every rank may call it at its own pace.
 */
export function loadCheckpoint(dir: string, placements: readonly ParamPlacement[], opts: LoadOptions = {}): CheckpointMeta {
  const meta = readMeta(dir);
  checkModel(`checkpoint ${dir}`, meta.params, placements, opts.numParams);
  const index = indexPieces(meta.pieces);
  const want = (kind: string, name: string, r: ElementRange): Piece[] =>
    r.numel === 0 ? [] : (index.get(`${kind}\u0000${name}`) ?? []).filter((p) => p.offset < r.offset + r.numel && p.offset + p.numel > r.offset);
  const optimizer = opts.optimizer && meta.optimizer ? opts.optimizer : undefined;
  // Which files this rank reads: verify those (in parallel with the other ranks doing theirs).
  const needed = new Set<string>();
  for (const p of placements) {
    for (const r of wholeRuns(p, p.held)) for (const pc of want('param', p.name, wholeRange(r))) needed.add(pc.file);
    if (optimizer) {
      for (const [k, l] of index) {
        if (k.startsWith('param\u0000') || l[0]!.name !== p.name) continue;
        for (const r of wholeRuns(p, p.stateHeld)) for (const pc of want(l[0]!.kind, p.name, wholeRange(r))) needed.add(pc.file);
      }
    }
  }
  verifyFiles(dir, meta, needed);
  const reader = new RangeReader(dir);
  try {
    for (const p of placements) {
      if (p.held.numel > 0) fillRuns(p, p.values(), p.held, (r) => want('param', p.name, r), reader, `parameter '${p.name}'`);
    }
    if (optimizer) {
      for (const p of placements) {
        if (p.stateHeld.numel === 0) continue;
        optimizer.setParamStep(p.param, meta.optimizer!.paramSteps[p.name] ?? 0);
        const ps = optimizer.paramState(p.param, { create: true });
        if (!ps) continue; // not trained by this optimizer (frozen)
        for (const [k, t] of Object.entries(ps.state)) {
          // No state on disk for this parameter: it was saved before its first update.
          if (!index.has(`${k}\u0000${p.name}`)) continue;
          fillRuns(p, t, { offset: ps.offset, numel: ps.numel }, (r) => want(k, p.name, r), reader, `optimizer state '${k}' of '${p.name}'`);
        }
      }
      optimizer.stepCount = meta.optimizer!.stepCount;
    }
  } finally {
    reader.close();
  }
  return meta;
}

/**
 * Loads weights only from a checkpoint directory or a consolidated .safetensors file (an export),
 * for fine-tuning (train.initFrom) and sampling. Each rank reads its own ranges.
 */
export function loadWeights(path: string, placements: readonly ParamPlacement[], numParams?: number): void {
  if (existsSync(path) && statSync(path).isFile()) {
    const header = readSafetensorsHeader(path);
    const table: Record<string, ParamInfo> = {};
    for (const [name, e] of Object.entries(header.tensors)) table[name] = { shape: e.shape, dtype: e.dtype };
    checkModel(path, table, placements, numParams);
    const dir = resolve(path, '..');
    const file = resolve(path).slice(dir.length + 1);
    const reader = new RangeReader(dir);
    try {
      for (const p of placements) {
        const e = header.tensors[p.name]!;
        const piece: Piece = { file, kind: 'param', name: p.name, offset: 0, numel: numelOf(e.shape), dtype: e.dtype, byte: header.dataStart + e.dataOffsets[0] };
        if (p.held.numel > 0) fillRuns(p, p.values(), p.held, () => [piece], reader, `parameter '${p.name}'`);
      }
    } finally {
      reader.close();
    }
    return;
  }
  loadCheckpoint(resolveCheckpoint(path), placements, numParams !== undefined ? { numParams } : {});
}

/** What `flotilla checkpoint check` reports. */
export interface CheckReport {
  /** The checkpoint directories checked (one per host's directory given). */
  dirs: string[];
  step: number;
  files: number;
  bytes: number;
  params: number;
  elements: number;
  /** Files with fewer copies than the checkpoint was saved with (none when every host's directory is given). */
  single: string[];
}

/**
 * Verifies a checkpoint without building a model: meta.json, every file's presence, size and
 * checksum, and that the pieces cover every parameter (and every optimizer state tensor saved).
 * Several arguments are the hosts' directories of one checkpoint saved without shared storage
 * ([Note: checkpoint replicas]): each file must be in at least one of them, and every copy found is checked.
 */
export function checkCheckpoint(args: string | readonly string[]): CheckReport {
  const dirs = (typeof args === 'string' ? [args] : [...args]).map(resolveCheckpoint);
  const metas = dirs.map((d) => readMeta(d, { partial: true })); // missing files are named below, across the directories
  const meta = metas[0]!;
  const dir = dirs[0]!;
  for (const [i, m] of metas.entries()) {
    const same = m.step === meta.step && JSON.stringify(m.files) === JSON.stringify(meta.files);
    if (!same) throw new CheckpointError(`${dirs[i]} (step ${m.step}) is not the same checkpoint as ${dir} (step ${meta.step}): their meta.json list other files; name the same step on every host`);
  }
  const copies = new Map<string, number>();
  for (const d of dirs) {
    const here = Object.keys(meta.files).filter((f) => existsSync(join(d, f)));
    verifyFiles(d, meta, here);
    for (const f of here) {
      readSafetensorsHeader(join(d, f)); // a valid safetensors file (header checked against its size)
      copies.set(f, (copies.get(f) ?? 0) + 1);
    }
  }
  const missing = Object.keys(meta.files).filter((f) => !copies.has(f));
  if (missing.length > 0) {
    throw new CheckpointError(`${dirs.join(', ')}: ${missing.join(', ')} ${missing.length > 1 ? 'are' : 'is'} in none of these directories; the checkpoint is incomplete${meta.storage && dirs.length < meta.storage.hosts ? ` (saved without shared storage on ${meta.storage.hosts} hosts: name every host's directory)` : ''}`);
  }
  const index = indexPieces(meta.pieces);
  for (const [key, list] of index) {
    const [kind, name] = key.split('\u0000') as [string, string];
    const n = numelOf(meta.params[name]!.shape);
    const have = list.reduce((a, p) => a + p.numel, 0);
    if (have !== n) throw new CheckpointError(`${dir}: ${kind} of '${name}' covers ${have} of its ${n} elements; the checkpoint is incomplete`);
  }
  for (const name of Object.keys(meta.params)) {
    if (!index.has(`param\u0000${name}`)) throw new CheckpointError(`${dir}: parameter '${name}' has no pieces; the checkpoint is incomplete`);
  }
  const want = 1 + (meta.storage?.replicas ?? 0);
  return {
    dirs, step: meta.step, files: Object.keys(meta.files).length,
    bytes: Object.values(meta.files).reduce((a, f) => a + f.bytes, 0),
    params: Object.keys(meta.params).length,
    elements: Object.values(meta.params).reduce((a, i) => a + numelOf(i.shape), 0),
    single: [...copies].filter(([, n]) => n < want).map(([f]) => f),
  };
}
