// Hugging Face directories, both ways: config.json plus model.safetensors (or shards
// model-0000K-of-0000N.safetensors with model.safetensors.index.json), as transformers'
// save_pretrained writes them. What is model-specific (the config fields, the tensor names, a
// transposed layout) is the model's HfFormat beside it (src/models/*_hf.ts, found through the
// registry); this file is the generic part.
//
// Reading goes through placements ([Note: placement] in src/parallel/placement.ts) like a
// checkpoint: a rank reads only the byte ranges of the elements it holds, so fine-tuning a large
// model under ZeRO-3 or tensor parallelism never materialises it whole. A transposed tensor (GPT-2's
// Conv1D) is read as the columns its rows need; a stacked one (a Mixtral expert's Linear, one slice of
// a grouped expert stack) is read slice by slice, so an expert-parallel rank reads only its experts.
// Writing goes to a temporary directory renamed into place, so a failed export leaves nothing behind.
import { copyFileSync, existsSync, mkdirSync, readdirSync, readFileSync, renameSync, rmdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';
import { randomBytes } from 'node:crypto';
import { Tensor, cat, getDefaultDtype, noGrad, setDefaultDtype, tidy, zeros } from '../tensor/index.js';
import { defaultMoEConfig } from '../nn/moe_config.js';
import { native } from '../tensor/native.js';
import { dtypeCode, elementSize, isFloating, type DType } from '../tensor/dtype.js';
import type { Module } from '../nn/module.js';
import { placementsOf, wholeRuns, type ParamPlacement } from '../parallel/placement.js';
import { modelArchs, modelSpec, type ModelSpec } from '../models/registry.js';
import type { HfFormat, HfTensor } from '../models/spec.js';
import { configSchema, type ModelConfig } from '../config/schema.js';
import { readSafetensorsHeader, saveSafetensors } from './safetensors.js';
import { CheckpointError, isObj, readJsonObject } from './format.js';
import { consolidate } from './export.js';
import { RangeReader } from './range_reader.js';

export const HF_CONFIG = 'config.json';
export const HF_SINGLE = 'model.safetensors';
export const HF_INDEX = 'model.safetensors.index.json';
export const HF_TOKENIZER = 'tokenizer.json';

/** Whether `path` is a directory holding a Hugging Face config.json. */
export function isHfDir(path: string): boolean {
  return existsSync(path) && statSync(path).isDirectory() && existsSync(join(path, HF_CONFIG));
}

/** Where one stored tensor's bytes are. */
interface Stored {
  file: string;
  dtype: DType;
  shape: number[];
  /** Absolute byte offset of its first element in the file. */
  byte: number;
}

/** A Hugging Face directory, checked against the model it describes (nothing read but headers). */
export interface HfDir {
  dir: string;
  /** config.json as written. */
  config: Record<string, unknown>;
  spec: ModelSpec;
  format: HfFormat;
  /** The [model] section it describes (every field, defaults where the architecture has no say). */
  model: ModelConfig;
  /** The [model] fields config.json determines. */
  determined: Record<string, unknown>;
  /** Stored tensors by transformers' name. */
  stored: Map<string, Stored>;
  /** What each of the model's parameters is stored as, by flotilla name (several: a stack's slices, in order). */
  tensors: Map<string, HfTensor[]>;
  /** tokenizer.json, when the directory has one. */
  tokenizer?: string;
}


/** The [model] section's defaults. */
function modelDefaults(): ModelConfig {
  const out: Record<string, unknown> = {};
  for (const [k, f] of Object.entries(configSchema.model.fields)) out[k] = (f as { default: unknown }).default;
  return out as unknown as ModelConfig;
}

/** Every Hugging Face format of every registered architecture, with its spec. */
function hfFormats(): { spec: ModelSpec; format: HfFormat }[] {
  return modelArchs().map(modelSpec).flatMap((spec) => [spec.hf, ...(spec.hfFamilies ?? [])].filter((f) => f !== undefined).map((format) => ({ spec, format })));
}

/** The model_types an architecture reads, with their transformers class. */
function typesOf(f: HfFormat): Readonly<Record<string, string>> {
  return f.modelTypes ?? { [f.modelType]: f.architecture };
}

function supported(): string {
  return hfFormats().flatMap(({ format }) => Object.entries(typesOf(format)).map(([t, a]) => `${a} (model_type "${t}")`)).join(', ');
}

/** The format a model of `spec` with config `cfg` is written in: the first of its formats that can hold it. */
export function hfFormatFor(spec: ModelSpec, cfg: Record<string, unknown>): HfFormat | undefined {
  return [spec.hf, ...(spec.hfFamilies ?? [])].find((f) => f !== undefined && f.misfit?.(cfg) === undefined);
}

/** Why none of the spec's formats holds this config, one reason per format. */
function misfits(spec: ModelSpec, cfg: Record<string, unknown>): string {
  return [spec.hf, ...(spec.hfFamilies ?? [])].filter((f) => f !== undefined).map((f) => `${f.architecture}: ${f.misfit?.(cfg)}`).join('; ');
}

/** The registered architecture and format a config.json describes. */
function formatOf(path: string, config: Record<string, unknown>): { spec: ModelSpec; format: HfFormat } {
  const type = config.model_type;
  const archs = config.architectures;
  const found = hfFormats().find(({ format }) => typeof type === 'string' && Object.hasOwn(typesOf(format), type));
  if (!found) throw new CheckpointError(`${path}: model_type ${JSON.stringify(type)} is not supported; flotilla reads ${supported()}`);
  if (archs !== undefined) {
    const first = Array.isArray(archs) ? archs[0] : undefined;
    const want = typesOf(found.format)[type as string];
    if (first !== want) {
      throw new CheckpointError(`${path}: architectures = ${JSON.stringify(archs)} is not supported; for model_type "${type}" flotilla reads ${want}`);
    }
  }
  return found;
}

/** The shape of the flotilla parameter an entry is (a slice of, when stacked). */
function paramShape(t: HfTensor): number[] {
  const one = t.transpose ? [t.shape[1]!, t.shape[0]!] : t.shape;
  return t.stack ? [t.stack.count, ...one] : one;
}

/** Headers of the directory's safetensors files: every stored tensor by (canonical) name. */
function readStored(dir: string, format: HfFormat): Map<string, Stored> {
  const single = join(dir, HF_SINGLE), indexPath = join(dir, HF_INDEX);
  let files: string[];
  let weightMap: Record<string, string> | undefined;
  if (existsSync(indexPath)) {
    let idx: unknown;
    try {
      idx = JSON.parse(readFileSync(indexPath, 'utf8'));
    } catch (e) {
      throw new CheckpointError(`${indexPath} is not valid JSON (${(e as Error).message})`);
    }
    if (!isObj(idx) || !isObj(idx.weight_map)) throw new CheckpointError(`${indexPath} has no "weight_map" object; it is not a transformers shard index`);
    weightMap = {};
    for (const [name, f] of Object.entries(idx.weight_map)) {
      if (typeof f !== 'string' || f !== basename(f) || !f.endsWith('.safetensors')) {
        throw new CheckpointError(`${indexPath}: weight_map puts '${name}' in ${JSON.stringify(f)}, which is not a .safetensors file of this directory`);
      }
      weightMap[name] = f;
    }
    files = [...new Set(Object.values(weightMap))].sort();
  } else if (existsSync(single)) {
    files = [HF_SINGLE];
  } else {
    const bin = existsSync(join(dir, 'pytorch_model.bin')) || existsSync(join(dir, 'pytorch_model.bin.index.json'));
    throw new CheckpointError(
      `${dir} has neither ${HF_SINGLE} nor ${HF_INDEX}` +
        (bin ? ': its weights are pickled (pytorch_model.bin), which flotilla does not read; convert them to safetensors (save_pretrained(dir, safe_serialization=True))' : '; a Hugging Face model directory holds its weights in safetensors files'),
    );
  }
  const stored = new Map<string, Stored>();
  for (const f of files) {
    const path = join(dir, f);
    if (!existsSync(path)) throw new CheckpointError(`${dir} is missing ${f} (listed in ${HF_INDEX}); the download is incomplete`);
    const h = readSafetensorsHeader(path);
    for (const [raw, e] of Object.entries(h.tensors)) {
      if (weightMap && weightMap[raw] !== f) {
        throw new CheckpointError(`${path} holds '${raw}', which ${HF_INDEX} places ${weightMap[raw] ? `in ${weightMap[raw]}` : 'nowhere'}; the index does not describe the files`);
      }
      const name = format.canonicalName?.(raw) ?? raw;
      if (stored.has(name)) throw new CheckpointError(`${dir} stores '${name}' twice (${stored.get(name)!.file} and ${f})`);
      stored.set(name, { file: f, dtype: e.dtype, shape: e.shape, byte: h.dataStart + e.dataOffsets[0] });
    }
  }
  if (weightMap) {
    for (const [name, f] of Object.entries(weightMap)) {
      if (!stored.has(format.canonicalName?.(name) ?? name)) throw new CheckpointError(`${HF_INDEX} places '${name}' in ${f}, which does not hold it; the files are incomplete`);
    }
  }
  return stored;
}

/**
 * Reads a Hugging Face directory's config.json and safetensors headers and checks every tensor the
 * model needs is there with the shape its config implies, and nothing unexpected is. No tensor data is read.
 */
export function readHfDir(path: string): HfDir {
  const dir = resolve(path);
  const cfgPath = join(dir, HF_CONFIG);
  if (!existsSync(dir)) throw new CheckpointError(`${path} does not exist`);
  if (!existsSync(cfgPath)) throw new CheckpointError(`${path} has no ${HF_CONFIG}: it is not a Hugging Face model directory`);
  const config = readJsonObject(cfgPath);
  const { spec, format } = formatOf(cfgPath, config);
  let determined: Record<string, unknown>;
  try {
    determined = format.fromConfig(config);
  } catch (e) {
    throw new CheckpointError(`${dir}/${(e as Error).message}`);
  }
  const model = { ...modelDefaults(), ...determined } as ModelConfig;
  const stored = readStored(dir, format);
  const expected = format.tensors(model).filter((t) => !t.zeros);
  const tensors = new Map<string, HfTensor[]>();
  for (const t of expected) tensors.set(t.name, [...(tensors.get(t.name) ?? []), t]);
  const byHf = new Set(expected.map((t) => t.hf));
  for (const t of expected) {
    const s = stored.get(t.hf);
    if (!s) {
      throw new CheckpointError(`${dir} has no tensor '${t.hf}'; a ${format.architecture} with this ${HF_CONFIG} stores it as [${t.shape.join(', ')}]${t.hf === 'lm_head.weight' ? ' (or set tie_word_embeddings = true when the head shares the embedding)' : ''}`);
    }
    if (s.shape.length !== t.shape.length || s.shape.some((d, i) => d !== t.shape[i])) {
      throw new CheckpointError(`${dir}: tensor '${t.hf}' is [${s.shape.join(', ')}], but ${HF_CONFIG} implies [${t.shape.join(', ')}]; the config and the weights disagree`);
    }
    if (!isFloating(s.dtype)) throw new CheckpointError(`${dir}: tensor '${t.hf}' is ${s.dtype}; flotilla reads float32, bfloat16, float16 or float64 weights`);
  }
  for (const name of stored.keys()) {
    if (byHf.has(name) || format.ignored?.test(name)) continue;
    // A tied head some savers store anyway: transformers ties it to the embedding, so does flotilla.
    if (model.tieEmbeddings && name === 'lm_head.weight') continue;
    throw new CheckpointError(`${dir} holds tensor '${name}', which a ${format.architecture} with this ${HF_CONFIG} does not have; the config and the weights disagree`);
  }
  const tok = join(dir, HF_TOKENIZER);
  return { dir, config, spec, format, model, determined, stored, tensors, ...(existsSync(tok) ? { tokenizer: tok } : {}) };
}


/**
 * Elements [a, a + n) of flotilla's flattened tensor, read from its stored form: a plain byte range,
 * or, for a transposed [I, O] tensor, the columns of the rows [O, I] these elements lie in.
 */
function readElements(reader: RangeReader, s: Stored, t: HfTensor, a: number, n: number): Tensor {
  const es = elementSize(s.dtype);
  const code = dtypeCode(s.dtype);
  if (!t.transpose) return new Tensor(native.fromBuffer(reader.read(s.file, s.byte + a * es, n * es), [n], code));
  const [I, O] = s.shape as [number, number];
  const o0 = Math.floor(a / I), o1 = Math.floor((a + n - 1) / I) + 1, cols = o1 - o0;
  let buf: Buffer;
  if (cols === O) buf = reader.read(s.file, s.byte, I * O * es);
  else {
    buf = Buffer.allocUnsafe(I * cols * es);
    for (let i = 0; i < I; i++) reader.read(s.file, s.byte + (i * O + o0) * es, cols * es, buf, i * cols * es);
  }
  const block = new Tensor(native.fromBuffer(buf, [I, cols], code)); // [in, the rows' outputs]
  return block.t().contiguous().view(-1).narrow(0, a - o0 * I, n);
}

/**
 * Copies into a placement the elements it holds, run by run of the whole tensor (a ZeRO-3 range, a
 * tensor-parallel slice), each read by `read(first whole-tensor element, count)`.
 */
export function fillHeld(p: ParamPlacement, read: (whole: number, n: number) => Tensor): void {
  if (p.held.numel === 0) return;
  const values = p.values();
  for (const r of wholeRuns(p, p.held)) {
    tidy(() => {
      const src = read(r.whole, r.numel);
      noGrad(() => values.narrow(0, r.local - p.held.offset, r.numel).copy_(src));
    });
  }
}

/**
 * fillHeld for a stack whose slice j (`per` elements: elements [j per, (j + 1) per) of the whole)
 * is stored as its own tensor: `readSlice(j, offset, n)` reads n elements of slice j from `offset`.
 */
export function fillHeldStack(p: ParamPlacement, per: number, readSlice: (j: number, offset: number, n: number) => Tensor): void {
  fillHeld(p, (whole, n) => {
    const pieces: Tensor[] = [];
    for (let a = whole; a < whole + n;) {
      const j = Math.floor(a / per), m = Math.min(whole + n, (j + 1) * per) - a;
      pieces.push(readSlice(j, a - j * per, m));
      a += m;
    }
    return pieces.length === 1 ? pieces[0]! : cat(pieces, 0);
  });
}

/**
 * Fills this rank's parameters from the directory: for each placement, the runs of the whole
 * tensor it holds, each read by byte range. Placements name parameters by whole-model name.
 */
export function loadHfWeights(h: HfDir, placements: readonly ParamPlacement[]): void {
  const reader = new RangeReader(h.dir);
  try {
    for (const p of placements) {
      const parts = h.tensors.get(p.name);
      if (!parts) throw new CheckpointError(`${h.dir}: this model has a parameter '${p.name}' that a ${h.format.architecture} does not store; it is a different model`);
      const t = parts[0]!;
      const want = paramShape(t);
      if (want.length !== p.shape.length || want.some((d, i) => d !== p.shape[i]) || (t.stack && parts.length !== t.stack.count)) {
        throw new CheckpointError(`${h.dir}: '${t.hf}' holds [${want.join(', ')}] for parameter '${p.name}', which is [${p.shape.join(', ')}] in this model; it comes from a different model config`);
      }
      if (!t.stack) {
        const s = h.stored.get(t.hf)!;
        fillHeld(p, (whole, n) => readElements(reader, s, t, whole, n));
        continue;
      }
      const per = t.shape.reduce((a, b) => a * b, 1);
      fillHeldStack(p, per, (j, offset, n) => readElements(reader, h.stored.get(parts[j]!.hf)!, parts[j]!, offset, n));
    }
  } finally {
    reader.close();
  }
}

/** The [model] fields where a run's config and a directory's disagree (dropout is the run's). */
export function configDifferences(run: Record<string, unknown>, h: HfDir): string[] {
  const out: string[] = [];
  if (run.arch !== h.spec.arch) return [`model.arch is ${JSON.stringify(run.arch)} here, the directory holds a ${h.format.architecture} (arch "${h.spec.arch}")`];
  // Derived fields (0 = from the others) compare by their resolved values.
  const mine = (h.format.resolve?.(run) ?? run) as Record<string, unknown>;
  const theirs = (h.format.resolve?.(h.model) ?? h.model) as Record<string, unknown>;
  for (const k of Object.keys(h.determined)) {
    if (k === 'dropout') continue;
    if (k === 'moe') {
      // The fields the directory's routing determines; the balance settings are the run's.
      const a = (mine.moe ?? defaultMoEConfig) as unknown as Record<string, unknown>, b = theirs.moe as Record<string, unknown>;
      // (By value: moe.denseLayers is a list.)
      for (const f of Object.keys(h.determined.moe as object)) if (JSON.stringify(a[f]) !== JSON.stringify(b[f])) out.push(`moe.${f} is ${JSON.stringify(a[f])} here and ${JSON.stringify(b[f])} for ${HF_CONFIG}`);
      continue;
    }
    if (mine[k] !== theirs[k]) out.push(`model.${k} is ${JSON.stringify(run[k])} here and ${JSON.stringify(theirs[k])} in ${HF_CONFIG}`);
  }
  return out;
}

/**
 * train.initFrom of a Hugging Face directory: the run's [model] must be the model the directory
 * holds (named field by field); then each rank reads the ranges it holds.
 */
export function initFromHf(dir: string, placements: readonly ParamPlacement[], runModel: Record<string, unknown> | undefined, numParams?: number): HfDir {
  const h = readHfDir(dir);
  if (runModel) {
    const diff = configDifferences(runModel, h);
    if (diff.length > 0) {
      const line = ([k, v]: [string, unknown]) => `${k} = ${typeof v === 'string' ? JSON.stringify(v) : v}`;
      const set = Object.entries(h.determined).filter(([k]) => k !== 'dropout' && k !== 'moe').map(line);
      const moe = h.determined.moe ? `\n[moe]\n${Object.entries(h.determined.moe as object).map(line).join('\n')}` : '';
      throw new CheckpointError(
        `train.initFrom: ${dir} holds a ${h.format.architecture} that is not this run's model: ${diff.join('; ')}. ` +
          `Set the [model] section to the directory's model:\n[model]\n${set.join('\n')}${moe}`,
      );
    }
  }
  if (numParams !== undefined) {
    const total = h.spec.numParams(h.model);
    if (total !== numParams) throw new CheckpointError(`train.initFrom: ${dir} holds ${total.toLocaleString('en-US')} parameters, this model has ${numParams.toLocaleString('en-US')}: it comes from a different model config`);
  }
  loadHfWeights(h, placements);
  return h;
}

/** Loads a Hugging Face directory's weights into placements of a model built from its own config (generate). */
export function loadHfInto(dir: string, placements: readonly ParamPlacement[], numParams?: number): void {
  initFromHf(dir, placements, undefined, numParams);
}

/** A model read from a Hugging Face directory: `model.call(ids)` gives `{ logits }` (B, T, vocab). */
export interface Pretrained {
  model: Module & { forward(idx: Tensor): { logits: Tensor } };
  /** Its [model] section (arch included), as a run's config would hold it. */
  config: ModelConfig;
  /** The directory's tokenizer.json, when it has one. */
  tokenizer?: string;
}

/**
 * Loads a Hugging Face directory (LlamaForCausalLM, GPT2LMHeadModel, or any registered
 * architecture's format) as a flotilla model in `dtype` (default float32), in eval mode.
 */
export function loadPretrained(dir: string, opts: { dtype?: DType } = {}): Pretrained {
  const h = readHfDir(dir);
  const dtype = opts.dtype ?? 'float32';
  if (!isFloating(dtype)) throw new Error(`loadPretrained: dtype ${dtype} is not a floating dtype; use float32, bfloat16, float16 or float64`);
  const prev = getDefaultDtype();
  setDefaultDtype(dtype);
  let model: Module;
  try {
    model = h.spec.build(h.model, { initSeed: 0 });
  } finally {
    setDefaultDtype(prev);
  }
  try {
    loadHfWeights(h, placementsOf(model.namedParameters()));
  } catch (e) {
    model.dispose();
    throw e;
  }
  model.eval();
  return { model: model as Pretrained['model'], config: h.model, ...(h.tokenizer ? { tokenizer: h.tokenizer } : {}) };
}

export interface SaveHfOptions {
  /** Stored dtype (default float32). */
  dtype?: 'float32' | 'bfloat16' | 'float16';
  /** Largest shard: bytes, or "2GB", "500MB", "1GiB" (default "5GB", as transformers). Above it, shards and an index. */
  maxShardSize?: number | string;
  /** A tokenizer.json to copy in, with the TOKENIZER_COMPANIONS beside it. */
  tokenizer?: string;
}

/** Files of a Hugging Face directory that go with its tokenizer.json: special tokens and the chat template. */
export const TOKENIZER_COMPANIONS = ['tokenizer_config.json', 'special_tokens_map.json', 'chat_template.jinja'] as const;

/**
 * Copies a tokenizer.json into dir as HF_TOKENIZER, with the TOKENIZER_COMPANIONS beside it: a model
 * directory's tokenizer travels with what describes it (special tokens, the chat template).
 */
export function copyTokenizer(tokenizerJson: string, dir: string): void {
  copyFileSync(tokenizerJson, join(dir, HF_TOKENIZER));
  for (const f of TOKENIZER_COMPANIONS) {
    const p = join(dirname(tokenizerJson), f);
    if (existsSync(p)) copyFileSync(p, join(dir, f));
  }
}

const UNITS: Record<string, number> = { b: 1, kb: 1e3, mb: 1e6, gb: 1e9, tb: 1e12, kib: 2 ** 10, mib: 2 ** 20, gib: 2 ** 30, tib: 2 ** 40 };

/** Bytes of a size such as "2GB" (decimal units, as transformers), "512MiB" or 1000000. */
export function parseSize(v: number | string, what = 'max shard size'): number {
  if (typeof v === 'number') {
    if (!Number.isFinite(v) || v <= 0) throw new Error(`${what}: ${v} is not a positive number of bytes`);
    return Math.floor(v);
  }
  const m = /^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$/i.exec(v);
  if (!m || Number(m[1]) <= 0) throw new Error(`${what}: ${JSON.stringify(v)} is not a size; write e.g. 2GB, 500MB, 1GiB or a number of bytes`);
  return Math.floor(Number(m[1]) * UNITS[(m[2] ?? 'b').toLowerCase()]!);
}

/** A directory we may write into: absent, or empty. */
function checkOutDir(dir: string): void {
  if (!existsSync(dir)) return;
  if (!statSync(dir).isDirectory()) throw new CheckpointError(`${dir} exists and is not a directory; choose a new directory name (nothing was written)`);
  if (readdirSync(dir).length > 0) throw new CheckpointError(`${dir} exists and is not empty; choose a new directory or empty it first (nothing was written)`);
}

/** What writeHfDir wrote. */
export interface HfWriteReport {
  dir: string;
  architecture: string;
  tensors: number;
  bytes: number;
  files: string[];
}

/**
 * Writes a model of `spec` with config `cfg` as a Hugging Face directory, from its parameters by
 * flotilla name (`params`; a tied head is absent). The directory appears whole or not at all.
 */
export function writeHfDir(dir: string, spec: ModelSpec, cfg: Record<string, unknown>, params: Record<string, Tensor>, opts: SaveHfOptions = {}): HfWriteReport {
  if (!spec.hf) throw new CheckpointError(`model.arch = "${spec.arch}" has no Hugging Face form; flotilla writes ${supported()}`);
  const format = hfFormatFor(spec, cfg);
  if (!format) throw new CheckpointError(`this model has no Hugging Face form (${misfits(spec, cfg)}); export it as one file instead: flotilla export CHECKPOINT out.safetensors`);
  const out = resolve(dir);
  checkOutDir(out);
  const dtype = opts.dtype ?? 'float32';
  if (!['float32', 'bfloat16', 'float16'].includes(dtype)) throw new Error(`savePretrained: dtype ${dtype} is not float32, bfloat16 or float16`);
  const max = parseSize(opts.maxShardSize ?? '5GB');
  if (opts.tokenizer !== undefined && !existsSync(opts.tokenizer)) throw new CheckpointError(`tokenizer ${opts.tokenizer} does not exist`);
  const entries = format.tensors(cfg);
  const es = elementSize(dtype);
  for (const t of entries) {
    if (t.zeros) continue;
    const p = params[t.name];
    if (!p) throw new Error(`internal: the model has no parameter '${t.name}' for '${t.hf}'`);
    const want = paramShape(t);
    if (p.shape.join(',') !== want.join(',')) throw new CheckpointError(`parameter '${t.name}' is [${p.shape.join(', ')}], its config implies [${want.join(', ')}]`);
  }
  // Shards as transformers cuts them: in order, a new one when the next tensor would pass the limit.
  const shards: HfTensor[][] = [[]];
  let size = 0, total = 0;
  for (const t of entries) {
    const bytes = t.shape.reduce((a, b) => a * b, 1) * es;
    if (size + bytes > max && shards[shards.length - 1]!.length > 0) {
      shards.push([]);
      size = 0;
    }
    shards[shards.length - 1]!.push(t);
    size += bytes;
    total += bytes;
  }
  const n = shards.length;
  const pad = (k: number) => String(k).padStart(5, '0');
  const fileOf = (k: number) => (n === 1 ? HF_SINGLE : `model-${pad(k + 1)}-of-${pad(n)}.safetensors`);
  const tmp = join(dirname(out), `.${basename(out)}.tmp-${process.pid}-${randomBytes(4).toString('hex')}`);
  mkdirSync(tmp, { recursive: true });
  try {
    const weightMap: Record<string, string> = {};
    shards.forEach((shard, k) => {
      tidy(() => {
        const tensors: Record<string, Tensor> = {};
        for (const t of shard) {
          const whole = t.zeros ? zeros(t.shape, { dtype }) : params[t.name]!.detach();
          const src = t.stack ? whole.select(0, t.stack.index) : whole;
          const laid = t.transpose ? src.t().contiguous() : src;
          tensors[t.hf] = laid.dtype === dtype ? laid : laid.to(dtype);
          weightMap[t.hf] = fileOf(k);
        }
        saveSafetensors(join(tmp, fileOf(k)), tensors, { format: 'pt' });
      });
    });
    if (n > 1) {
      const sorted = Object.fromEntries(Object.keys(weightMap).sort().map((k) => [k, weightMap[k]!]));
      writeFileSync(join(tmp, HF_INDEX), `${JSON.stringify({ metadata: { total_size: total }, weight_map: sorted }, null, 2)}\n`);
    }
    writeFileSync(join(tmp, HF_CONFIG), `${JSON.stringify({ ...format.toConfig(cfg), torch_dtype: dtype }, null, 2)}\n`);
    if (opts.tokenizer !== undefined) copyTokenizer(opts.tokenizer, tmp);
    if (existsSync(out)) rmdirSync(out); // empty (checked above)
    renameSync(tmp, out);
  } catch (e) {
    rmSync(tmp, { recursive: true, force: true });
    throw e;
  }
  const written = format.toConfig(cfg).architectures;
  return { dir: out, architecture: Array.isArray(written) && typeof written[0] === 'string' ? written[0] : format.architecture, tensors: entries.length, bytes: total, files: shards.map((_, k) => fileOf(k)) };
}

/**
 * Writes a whole model (built on this process) as a Hugging Face directory that transformers and
 * loadPretrained read: config.json, safetensors with transformers' names (a tied head not stored),
 * sharded with an index above maxShardSize, and opts.tokenizer as tokenizer.json.
 */
export function savePretrained(model: Module, dir: string, opts: SaveHfOptions = {}): HfWriteReport {
  for (const spec of modelArchs().map(modelSpec).filter((s) => s.hf !== undefined)) {
    const cfg = spec.hf!.configOf(model);
    if (cfg !== undefined) return writeHfDir(dir, spec, cfg as Record<string, unknown>, Object.fromEntries(model.namedParameters()), opts);
  }
  throw new CheckpointError(`savePretrained: ${model.constructor.name} is not a model flotilla writes in Hugging Face form; it writes ${supported()}`);
}

/**
 * `flotilla export CKPT DIR --format hf`: a checkpoint's parameters (any layout, read in one
 * process) as a Hugging Face directory, with the run's tokenizer.json when it trained with one.
 */
export function exportCheckpointHf(arg: string, out: string, opts: Omit<SaveHfOptions, 'tokenizer'> = {}): HfWriteReport & { step: number } {
  checkOutDir(resolve(out));
  const { meta, tensors } = consolidate(arg);
  try {
    const experts = Number(meta.config.moe?.experts ?? 0);
    const model = { ...modelDefaults(), ...(meta.config.model ?? {}), ...(experts > 0 ? { moe: { ...defaultMoEConfig, ...meta.config.moe } } : {}) } as ModelConfig;
    const spec = modelSpec(model.arch);
    if (experts > 0 && !hfFormatFor(spec, model as unknown as Record<string, unknown>)) {
      const why = spec.hf ? ` (${misfits(spec, model as unknown as Record<string, unknown>)})` : '';
      throw new CheckpointError(`${arg} holds a mixture-of-experts model (moe.experts = ${experts}), which has no Hugging Face form in flotilla${why}; export it as one file instead: flotilla export ${arg} out.safetensors`);
    }
    const tok = (meta.config.data as { tokenizer?: unknown } | undefined)?.tokenizer;
    const tokenizer = typeof tok === 'string' && tok.endsWith('.json') && existsSync(tok) ? tok : undefined;
    const r = writeHfDir(out, spec, model as unknown as Record<string, unknown>, tensors, { ...opts, ...(tokenizer ? { tokenizer } : {}) });
    return { ...r, step: meta.step };
  } finally {
    for (const t of Object.values(tensors)) t.dispose();
  }
}

/**
 * The tokenizer to sample from a directory with: its tokenizer.json, else GPT-2's BPE for a
 * GPT-2-sized vocabulary, else bytes for a vocabulary of at most 256 ids (a byte-level flotilla run).
 */
export function hfTokenizerSpec(p: { tokenizer?: string; config: ModelConfig }, dir: string): string {
  if (p.tokenizer) return p.tokenizer;
  if (p.config.arch === 'gpt' && p.config.vocabSize === 50257) return 'gpt2';
  if (p.config.vocabSize <= 256) return 'byte';
  throw new CheckpointError(`${dir} has no ${HF_TOKENIZER}, and its ${p.config.vocabSize}-id vocabulary is not bytes or GPT-2's; put the model's ${HF_TOKENIZER} in the directory`);
}
