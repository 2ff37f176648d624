// The on-disk form of a distributed checkpoint, and the checks every reader runs before trusting it.
//
//   checkpoints/
//     step-000300/
//       meta.json                 what the run was (step, layout, config, data position, RNG), the
//                                 parameter table, every file's size and SHA-256, and the piece index
//       rank-00000.safetensors    rank 0's pieces: 1-D runs of flattened parameters and optimizer state
//       rank-00001.safetensors    ...
//     latest                      the name of the newest complete checkpoint ("step-000300")
//     .tmp-step-000400/           a save in progress (removed at the next start if the run died)
//
// A piece is (name, kind, offset, numel) of a flattened full tensor; pieces of one tensor never
// overlap and together cover it (checked at load), so loading under any layout is intersecting the
// ranges a rank needs with the ranges on disk and reading those bytes. A tensor-parallel slice (the
// columns of a row-parallel weight: one short run per row) is one strided piece: `runs.count` runs
// of numel / count elements, `runs.stride` elements apart in the tensor and end to end in the file;
// readMeta expands it into its runs, so every reader sees plain pieces.
import { existsSync, readdirSync, readFileSync, statSync } from 'node:fs';
import { basename, join, resolve } from 'node:path';
import { DTYPES as DTYPE_NAMES, type DType, elementSize } from '../tensor/dtype.js';
import { ACCUMULATE_FLAVOURS, PARALLEL_DEFAULTS, resolveAccumulate, type AccumulateFlavour, type Layout, type ZeroStage } from '../parallel/layout.js';
import { SCHEDULE_NAMES, type ScheduleName } from '../parallel/pipeline/schedule.js';
import type { LoaderState } from '../data/loader.js';

export const CHECKPOINT_FORMAT = 'flotilla.checkpoint.v1';
export const META_FILE = 'meta.json';
export const LATEST_FILE = 'latest';
/** meta.json is refused unread above this size (a real one is a few hundred KiB per thousand parameters). */
const MAX_META_BYTES = 256 * 2 ** 20;

/** One run of elements in a rank's file. */
export interface Piece {
  file: string;
  /** 'param' for parameter values, else the optimizer state key ('exp_avg', 'exp_avg_sq', ...). */
  kind: string;
  name: string;
  /** Elements [offset, offset + numel) of the flattened tensor. */
  offset: number;
  numel: number;
  dtype: DType;
  /** Absolute byte offset of the first element in the file. */
  byte: number;
  /** A strided piece (tensor-parallel slices): count runs of numel / count elements, stride elements apart from offset. */
  runs?: { count: number; stride: number };
}

/**
 * The layout a checkpoint was saved under: the resolved Layout (src/parallel/layout.ts, every degree
 * given), the world size and its one-line description.
 */
export type SavedLayout = Required<Layout> & { worldSize: number; description: string };

export interface ParamInfo {
  shape: number[];
  dtype: DType;
}

export interface CheckpointMeta {
  format: typeof CHECKPOINT_FORMAT;
  /** Optimizer steps completed when it was saved (training resumes at this step). */
  step: number;
  savedAt: string;
  /** The layout that saved it (loading may use another). */
  layout: SavedLayout;
  /** The resolved config of the run (sections and fields as in the TOML). */
  config: Record<string, Record<string, unknown>>;
  /** Data loader position in the global sample order. */
  /** The loader's position (src/data/loader.ts); an example loader adds what its rows depend on. */
  data: LoaderState;
  /** Random state: dropout draws are seeded per step from (seed, step), so the seed and the step are all of it. */
  rng: { kind: 'seed-per-step'; seed: number };
  /** Learning-rate schedule position (the step it continues from). */
  schedule: { step: number };
  /** Mixture of experts with balance = "bias": each MoE block's selection bias (state outside the gradient), by block name. */
  moe?: { expertBias: Record<string, number[]> };
  /**
   * A LoRA run's frozen base (train.initFrom), which its checkpoints do not hold: where it was and
   * each of its files' size and SHA-256, checked when the run resumes.
   */
  base?: BaseIdentity;
  /** Every parameter of the whole model (of a LoRA run: the adapters only). */
  params: Record<string, ParamInfo>;
  /** Optimizer: its name, update count, and each parameter's own update count. */
  optimizer: { name: string; stepCount: number; paramSteps: Record<string, number> } | undefined;
  files: Record<string, { bytes: number; sha256: string }>;
  pieces: Piece[];
  /**
   * Saved without shared storage ([Note: checkpoint replicas] in checkpoint.ts): each of `hosts`
   * directories holds the files of its own `ranksPerHost` ranks and a copy of the previous host's.
   */
  storage?: { hosts: number; ranksPerHost: number; replicas: number };
}

/** The files of a frozen base a LoRA checkpoint trained on. */
export interface BaseIdentity {
  path: string;
  files: { name: string; bytes: number; sha256: string }[];
}

/** A checkpoint that cannot be used: one message naming the file and the problem. */
export class CheckpointError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'CheckpointError';
  }
}

export function stepDirName(step: number): string {
  return `step-${String(step).padStart(6, '0')}`;
}

/** A plain JSON object (not an array, not null). */
export const isObj = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);

/** A JSON file that must hold one object (config.json, adapter_config.json): one error naming the file otherwise. */
export function readJsonObject(path: string): Record<string, unknown> {
  let v: unknown;
  try {
    v = JSON.parse(readFileSync(path, 'utf8'));
  } catch (e) {
    throw new CheckpointError(`${path} is not valid JSON (${(e as Error).message})`);
  }
  if (!isObj(v)) throw new CheckpointError(`${path} is not a JSON object`);
  return v;
}

const isCount = (v: unknown): v is number => typeof v === 'number' && Number.isSafeInteger(v) && v >= 0;
const DTYPES = new Set<string>(DTYPE_NAMES);

/**
 * Reads and checks meta.json of a checkpoint directory: the structure, that every piece lies inside
 * its parameter and its file, that the pieces of each tensor do not overlap, and that every file is
 * present with the recorded size. Checksums are verified by the reader of each file (verifyFiles).
 * `partial`: one host's directory of a checkpoint saved without shared storage (meta.storage) may
 * lack the files other hosts hold; those present must still have their recorded size.
 */
export function readMeta(dir: string, opts: { partial?: boolean } = {}): CheckpointMeta {
  const path = join(dir, META_FILE);
  if (!existsSync(dir)) throw new CheckpointError(`checkpoint ${dir} does not exist`);
  if (!existsSync(path)) {
    throw new CheckpointError(`checkpoint ${dir} has no ${META_FILE}: it is incomplete (a save that did not finish) or not a flotilla checkpoint`);
  }
  const size = statSync(path).size;
  if (size > MAX_META_BYTES) throw new CheckpointError(`${path}: ${size} bytes is larger than any checkpoint index (${MAX_META_BYTES}); the file is corrupt`);
  let m: unknown;
  try {
    m = JSON.parse(readFileSync(path, 'utf8'));
  } catch (e) {
    throw new CheckpointError(`${path} is not valid JSON (${(e as Error).message}); the checkpoint is corrupt`);
  }
  const bad = (why: string): CheckpointError => new CheckpointError(`${path}: ${why}; the checkpoint is corrupt or not a flotilla checkpoint`);
  if (!isObj(m) || m.format !== CHECKPOINT_FORMAT) throw bad(`format is ${isObj(m) ? JSON.stringify(m.format) : 'missing'}, expected "${CHECKPOINT_FORMAT}"`);
  if (!isCount(m.step)) throw bad('step is not a non-negative integer');
  if (!isObj(m.params) || !isObj(m.files) || !Array.isArray(m.pieces) || !isObj(m.config) || !isObj(m.data) || !isObj(m.layout)) {
    throw bad('params, files, pieces, config, data or layout is missing');
  }
  const params = m.params as Record<string, unknown>;
  for (const [name, info] of Object.entries(params)) {
    if (!isObj(info) || !Array.isArray(info.shape) || !info.shape.every(isCount) || info.shape.length > 8 || !DTYPES.has(info.dtype as string)) {
      throw bad(`parameter '${name}' has no valid shape and dtype`);
    }
    if (numelOf(info.shape as number[]) > Number.MAX_SAFE_INTEGER / 16) throw bad(`parameter '${name}' has an absurd shape [${(info.shape as number[]).join(', ')}]`);
  }
  const files = m.files as Record<string, unknown>;
  for (const [f, info] of Object.entries(files)) {
    if (!/^rank-\d{5}\.safetensors$/.test(f)) throw bad(`file name ${JSON.stringify(f)} is not rank-NNNNN.safetensors`);
    if (!isObj(info) || !isCount(info.bytes) || typeof info.sha256 !== 'string' || !/^[0-9a-f]{64}$/.test(info.sha256)) throw bad(`file ${f} has no valid size and sha256`);
    const fp = join(dir, f);
    if (!existsSync(fp) && opts.partial) continue;
    if (!existsSync(fp)) throw new CheckpointError(`checkpoint ${dir} is missing ${f} (listed in ${META_FILE}); the checkpoint is incomplete`);
    const have = statSync(fp).size;
    if (have !== info.bytes) {
      throw new CheckpointError(`${fp} has ${have} bytes, ${META_FILE} records ${info.bytes}: the file is ${have < info.bytes ? 'truncated' : 'changed'}`);
    }
  }
  const byTensor = new Map<string, [number, number][]>();
  m.pieces = expandRuns(m.pieces as unknown[], bad);
  for (const p of m.pieces as unknown[]) {
    if (!isObj(p) || typeof p.file !== 'string' || typeof p.kind !== 'string' || typeof p.name !== 'string' || !isCount(p.offset) || !isCount(p.numel) || !isCount(p.byte) || !DTYPES.has(p.dtype as string)) {
      throw bad(`a piece entry is malformed: ${JSON.stringify(p).slice(0, 200)}`);
    }
    const info = params[p.name] as ParamInfo | undefined;
    if (!info) throw bad(`a piece names parameter '${p.name}', which is not in the parameter table`);
    const file = files[p.file] as { bytes: number } | undefined;
    if (!file) throw bad(`a piece of '${p.name}' is in ${p.file}, which is not in the file table`);
    const n = numelOf(info.shape);
    if (p.offset + p.numel > n) throw bad(`piece [${p.offset}, ${p.offset + p.numel}) of '${p.name}' (${p.kind}) lies outside its ${n} elements`);
    const end = p.byte + p.numel * elementSize(p.dtype as DType);
    if (end > file.bytes) throw bad(`piece of '${p.name}' (${p.kind}) ends at byte ${end}, past the end of ${p.file} (${file.bytes} bytes)`);
    const key = `${p.kind}\u0000${p.name}`;
    if (!byTensor.has(key)) byTensor.set(key, []);
    byTensor.get(key)!.push([p.offset, p.offset + p.numel]);
  }
  for (const [key, ranges] of byTensor) {
    ranges.sort((a, b) => a[0] - b[0]);
    for (let i = 1; i < ranges.length; i++) {
      if (ranges[i]![0] < ranges[i - 1]![1]) {
        const [kind, name] = key.split('\u0000');
        throw bad(`pieces of '${name}' (${kind}) overlap: [${ranges[i - 1]!.join(', ')}) and [${ranges[i]!.join(', ')})`);
      }
    }
  }
  m.layout = savedLayout(m.layout as Record<string, unknown>, m.config as Record<string, Record<string, unknown> | undefined>);
  return m as unknown as CheckpointMeta;
}

/**
 * meta.json's layout as this version records it. Checkpoints written before the whole resolved
 * Layout was recorded hold only worldSize, description, pp, dpReplicate, dpShard, zero, ppSchedule,
 * ppVirtualStages and sometimes tp and cp: the rest is resolved as the run resolved it, from the
 * [parallel] section of their saved config (the defaults for a script that saved none).
 */
function savedLayout(l: Record<string, unknown>, config: Record<string, Record<string, unknown> | undefined>): SavedLayout {
  const given = config.parallel ?? {};
  const num = (v: unknown, fallback: number): number => (typeof v === 'number' ? v : fallback);
  const pp = num(l.pp, 1), dpReplicate = num(l.dpReplicate, 1), dpShard = num(l.dpShard, num(l.worldSize, 1));
  const zero = (num(l.zero, 0) as ZeroStage), tp = num(l.tp, 1);
  const flavour = (v: unknown): v is AccumulateFlavour | 'auto' => v === 'auto' || ACCUMULATE_FLAVOURS.includes(v as AccumulateFlavour);
  const schedule = [l.schedule, l.ppSchedule, given.ppSchedule].find((v): v is ScheduleName => SCHEDULE_NAMES.includes(v as ScheduleName)) ?? PARALLEL_DEFAULTS.ppSchedule;
  return {
    worldSize: num(l.worldSize, 1), description: typeof l.description === 'string' ? l.description : 'unspecified',
    pp, dp: num(l.dp, dpReplicate * dpShard), dpReplicate, dpShard, zero,
    accumulate: resolveAccumulate(zero, [l.accumulate, given.accumulate].find(flavour) ?? 'auto', { pipeline: pp > 1 }),
    tp, sequenceParallel: typeof l.sequenceParallel === 'boolean' ? l.sequenceParallel : tp > 1 && given.sequenceParallel === true,
    lossParallel: typeof l.lossParallel === 'boolean' ? l.lossParallel : tp > 1 && given.lossParallel === true,
    schedule, virtualStages: num(l.virtualStages, num(l.ppVirtualStages, 1)),
    ep: num(l.ep, num(given.ep, 1)), cp: num(l.cp, num(given.cp, 1)),
  };
}

/** Strided pieces as their runs (plain pieces unchanged). */
function expandRuns(pieces: unknown[], bad: (why: string) => CheckpointError): unknown[] {
  const out: unknown[] = [];
  for (const p of pieces) {
    if (!isObj(p) || p.runs === undefined) {
      out.push(p);
      continue;
    }
    const r = p.runs;
    if (!isObj(r) || !isCount(r.count) || r.count < 1 || !isCount(r.stride) || !isCount(p.numel) || !isCount(p.offset) || !isCount(p.byte) || !DTYPES.has(p.dtype as string) || p.numel % r.count !== 0) {
      throw bad(`a strided piece entry is malformed: ${JSON.stringify(p).slice(0, 200)}`);
    }
    const len = p.numel / r.count;
    if (r.count > 1 && r.stride < len) throw bad(`a strided piece of '${String(p.name)}' has runs of ${len} elements ${r.stride} apart: they overlap`);
    const bytes = len * elementSize(p.dtype as DType);
    const { runs: _, ...plain } = p;
    for (let i = 0; i < r.count; i++) out.push({ ...plain, offset: p.offset + i * r.stride, numel: len, byte: p.byte + i * bytes });
  }
  return out;
}

export function numelOf(shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

/** Complete checkpoints in a directory (those with meta.json), oldest first. */
export function listCheckpoints(dir: string): { name: string; step: number; path: string }[] {
  if (!existsSync(dir)) return [];
  return readdirSync(dir)
    .flatMap((name) => {
      const m = /^step-(\d+)$/.exec(name);
      return m && existsSync(join(dir, name, META_FILE)) ? [{ name, step: Number(m[1]), path: join(dir, name) }] : [];
    })
    .sort((a, b) => a.step - b.step);
}

/**
 * The checkpoint directory an argument names: a step-N directory itself, or a checkpoints
 * directory (or a run directory holding checkpoints/) for its newest complete checkpoint.
 */
export function resolveCheckpoint(arg: string): string {
  const p = resolve(arg);
  if (!existsSync(p)) throw new CheckpointError(`checkpoint ${arg} does not exist`);
  if (statSync(p).isFile()) throw new CheckpointError(`${arg} is a file; a checkpoint is a directory with ${META_FILE} (an exported .safetensors file is for train.initFrom and generate)`);
  if (existsSync(join(p, META_FILE))) return p;
  // A step directory without its index: a save that never finished (readMeta says so).
  if (/^step-\d+$/.test(basename(p)) || readdirSync(p).some((n) => /^rank-\d{5}\.safetensors$/.test(n))) readMeta(p);
  for (const dir of [p, join(p, 'checkpoints')]) {
    const latest = join(dir, LATEST_FILE);
    if (existsSync(latest)) {
      const name = readFileSync(latest, 'utf8').trim();
      if (/^step-\d+$/.test(name) && existsSync(join(dir, name, META_FILE))) return join(dir, name);
    }
    const all = listCheckpoints(dir);
    if (all.length > 0) return all[all.length - 1]!.path;
  }
  throw new CheckpointError(`no complete checkpoint in ${arg} (looked for ${META_FILE}, ${LATEST_FILE} and step-N directories${existsSync(join(p, 'checkpoints')) ? ' here and in checkpoints/' : ''})`);
}
