// The training job config: one TOML section per component, every field typed, documented and
// defaulted; `--section.field=value` overrides from the command line; validation that names the
// field and the fix. The resolved config is saved with each run (configToToml).
import { readFileSync, existsSync, statSync, readdirSync, mkdirSync } from 'node:fs';
import { dirname, isAbsolute, join, resolve } from 'node:path';
import { parse as parseToml } from 'smol-toml';
import type { GPTConfig } from '../models/gpt.js';
import { checkDataConfig, type SourceEntry } from '../data/sources.js';
import { MOBY_DICK } from '../data/corpus.js';
import { tokenizerIdentity } from '../data/tokenizer.js';
import { layoutProblems, dataParallelDegree, type ParallelConfig } from '../parallel/layout.js';

// The layout type and its rules live with the layouts (src/parallel/layout.ts).
export type { ParallelConfig } from '../parallel/layout.js';

/** The [model] section is the GPT's own config (src/models/gpt.ts). */
export type ModelConfig = GPTConfig;

export interface DataConfig {
  source: string;
  /** Weighted sources (blended); when non-empty, data.source is not used. */
  sources: SourceEntry[];
  tokenizer: string;
  valSource: string;
  seqLen: number;
  globalBatch: number;
  microBatches: number;
  valFraction: number;
  prefetch: number;
}

export interface OptimConfig {
  lr: number;
  minLr: number;
  schedule: 'cosine' | 'constant';
  warmupSteps: number;
  beta1: number;
  beta2: number;
  eps: number;
  weightDecay: number;
  gradClip: number;
}

export interface TrainConfig {
  name: string;
  runDir: string;
  steps: number;
  seed: number;
  evalEvery: number;
  evalBatches: number;
  threads: number;
  initFrom: string;
  /** "fp32" or "bf16-mixed" (float32 master weights and gradients, bf16 matmuls: src/nn/precision.ts). */
  precision: 'fp32' | 'bf16-mixed';
  /** Recompute each transformer block's forward in backward: "none", "full" or "selective". */
  activationCheckpoint: 'none' | 'full' | 'selective';
}

export interface CheckpointConfig {
  /** Save every this many steps (0 = never; the run still saves on Ctrl-C). */
  every: number;
  /** Checkpoints kept (the oldest are deleted once a newer one is complete). */
  keep: number;
  /** Where checkpoints go ("" = <run dir>/checkpoints). */
  dir: string;
  /** Write in the background while training continues. */
  async: boolean;
}

export interface LogConfig {
  every: number;
  progress: 'auto' | 'bar' | 'plain' | 'off';
  metrics: string;
}

export interface FlotillaConfig {
  model: ModelConfig;
  data: DataConfig;
  optim: OptimConfig;
  train: TrainConfig;
  parallel: ParallelConfig;
  checkpoint: CheckpointConfig;
  log: LogConfig;
}

type KindOf<T> = T extends boolean ? 'bool' : T extends number ? 'int' | 'float' : T extends readonly unknown[] ? 'sources' : 'string';

interface Field<T> {
  doc: string;
  kind: KindOf<T>;
  default: T;
  /** Allowed values (strings). */
  choices?: readonly T[];
  /** Inclusive bounds (numbers). */
  min?: number;
  max?: number;
  /** Exclusive bounds (numbers). */
  above?: number;
  below?: number;
}

type Schema<C> = { [S in keyof C]: { doc: string; fields: { [F in keyof C[S]]: Field<C[S][F]> } } };

/** Every section and field, with its documentation and default. */
export const configSchema: Schema<FlotillaConfig> = {
  model: {
    doc: 'The GPT model (src/models/gpt.ts).',
    fields: {
      vocabSize: { kind: 'int', default: 0, min: 0, doc: 'Token ids the model embeds; 0 = the vocabulary of data.tokenizer (256 for bytes). Resolved when the config is read.' },
      blockSize: { kind: 'int', default: 128, min: 1, doc: 'Longest context in tokens (learned positions).' },
      nLayer: { kind: 'int', default: 4, min: 1, doc: 'Transformer blocks.' },
      nHead: { kind: 'int', default: 4, min: 1, doc: 'Attention heads per block; must divide model.nEmbd.' },
      nEmbd: { kind: 'int', default: 128, min: 1, doc: 'Width of the residual stream.' },
      dropout: { kind: 'float', default: 0, min: 0, below: 1, doc: 'Dropout probability in training (0 turns it off).' },
      bias: { kind: 'bool', default: true, doc: 'Biases in Linear and LayerNorm layers.' },
      tieEmbeddings: { kind: 'bool', default: false, doc: 'Share the token embedding with the output head.' },
    },
  },
  data: {
    doc: 'Text, tokenization and batching (src/data). A relative path in a config file is resolved against that file\'s directory, one given on the command line against the current directory; the resolved (and saved) config holds it absolute.',
    fields: {
      source: { kind: 'string', default: 'moby-dick', doc: '"moby-dick" (the demo corpus from npm), a UTF-8 text file, a prepared directory (flotilla prepare) or a nanoGPT-style uint16 .bin; a relative path starts from the config file\'s directory.' },
      sources: {
        kind: 'sources', default: [],
        doc: 'Datasets blended by weight, e.g. [{ path = "data/web", weight = 0.7 }, { path = "data/books", weight = 0.3 }] (on the command line: --data.sources=data/web:0.7,data/books:0.3); [] = data.source alone. Relative paths start from the config file\'s directory.',
      },
      tokenizer: { kind: 'string', default: 'byte', doc: '"byte" (vocabulary 256), "gpt2" (GPT-2\'s BPE) or the path of a tokenizer.json (flotilla tokenizer train), relative to the config file\'s directory; prepared data must have been made with the same one.' },
      valSource: { kind: 'string', default: '', doc: 'Validation data (a prepared directory, .bin or text file; a relative path starts from the config file\'s directory); "" = the last data.valFraction of every training source.' },
      seqLen: { kind: 'int', default: 128, min: 1, doc: 'Tokens per training sample; at most model.blockSize.' },
      globalBatch: {
        kind: 'int', default: 16, min: 1,
        doc: 'Samples per optimizer step over all data-parallel ranks and micro-batches; a multiple of dp x data.microBatches.',
      },
      microBatches: { kind: 'int', default: 1, min: 1, doc: 'Gradient-accumulation micro-batches per step (per rank).' },
      valFraction: { kind: 'float', default: 0.1, above: 0, below: 1, doc: 'Share of each source, taken from its end, held out for validation (when data.valSource is "").' },
      prefetch: { kind: 'int', default: 2, min: 0, doc: 'Batches a worker thread prepares ahead of the training step (0: read inline).' },
    },
  },
  optim: {
    doc: 'AdamW and the learning-rate schedule (src/optim).',
    fields: {
      lr: { kind: 'float', default: 1e-3, above: 0, doc: 'Peak learning rate (reached after the warmup).' },
      minLr: { kind: 'float', default: 1e-4, min: 0, doc: 'Learning rate at the end of the cosine decay; at most optim.lr.' },
      schedule: { kind: 'string', default: 'cosine', choices: ['cosine', 'constant'], doc: '"cosine": linear warmup then cosine decay to optim.minLr; "constant": optim.lr throughout.' },
      warmupSteps: { kind: 'int', default: 20, min: 0, doc: 'Steps of linear warmup from 0 to optim.lr (cosine schedule).' },
      beta1: { kind: 'float', default: 0.9, min: 0, below: 1, doc: 'AdamW first-moment decay.' },
      beta2: { kind: 'float', default: 0.95, min: 0, below: 1, doc: 'AdamW second-moment decay.' },
      eps: { kind: 'float', default: 1e-8, above: 0, doc: 'AdamW denominator epsilon.' },
      weightDecay: { kind: 'float', default: 0.1, min: 0, doc: 'Decoupled weight decay, applied to matrices only (not biases, norms).' },
      gradClip: { kind: 'float', default: 1, min: 0, doc: 'Clip the global gradient norm to this value (0 turns clipping off).' },
    },
  },
  train: {
    doc: 'The training loop (src/train/trainer.ts).',
    fields: {
      name: { kind: 'string', default: 'run', doc: 'Run name; the run directory defaults to runs/<name>.' },
      runDir: { kind: 'string', default: '', doc: 'Where the resolved config and metrics go ("" means runs/<train.name>); outputs are relative to the current directory, wherever the config file is.' },
      steps: { kind: 'int', default: 200, min: 1, doc: 'Optimizer steps to run.' },
      seed: { kind: 'int', default: 1337, min: 0, max: 0xfffffffe, doc: 'Seeds weight init, dropout and batch sampling; the same seed reproduces the run.' },
      evalEvery: { kind: 'int', default: 50, min: 0, doc: 'Validation loss every this many steps and after the last (0: only after the last).' },
      evalBatches: { kind: 'int', default: 4, min: 1, doc: 'Global batches of the validation split per evaluation (the same ones each time).' },
      threads: { kind: 'int', default: 1, min: 1, doc: 'Intra-op CPU threads per rank.' },
      precision: { kind: 'string', default: 'fp32', choices: ['fp32', 'bf16-mixed'], doc: '"bf16-mixed": matmuls in bfloat16 with float32 master parameters, optimizer state and gradient buckets; softmax, norms, GELU and the loss in float32 (the op list is in src/nn/precision.ts). float16 is not supported (it would need loss scaling).' },
      activationCheckpoint: { kind: 'string', default: 'none', choices: ['none', 'full', 'selective'], doc: 'Per transformer block: "full" keeps only the block input and recomputes its forward in backward; "selective" also keeps each Linear\'s output and recomputes LayerNorms, the attention core and GELU; "none" keeps every activation (src/nn/checkpoint.ts).' },
      initFrom: { kind: 'string', default: '', doc: 'Start from the weights of a checkpoint directory or an exported .safetensors file (step 0, fresh optimizer state; fine-tuning); a relative path starts from the config file\'s directory (on the command line, the current directory); "" = random init from train.seed.' },
    },
  },
  parallel: {
    doc: 'How the model is spread over ranks (src/parallel).',
    fields: {
      dp: { kind: 'int', default: -1, min: -1, doc: 'Data-parallel degree; -1 means the world size divided by parallel.pp.' },
      zero: { kind: 'int', default: 0, min: 0, max: 3, doc: 'Sharding: 0 = plain data parallel; 1 = optimizer state sharded (ZeRO-1); 2 = and gradients (ZeRO-2); 3 = and parameters (ZeRO-3 / FSDP).' },
      dpShard: { kind: 'int', default: -1, min: -1, doc: 'Ranks the model state is sharded over when zero >= 1; -1 means dp / dpReplicate.' },
      dpReplicate: { kind: 'int', default: 1, min: 1, doc: 'Replicas of the sharded state when zero >= 1 (hybrid sharding, HSDP, when > 1): the data-parallel rank is replicateRank x dpShard + shardRank.' },
      accumulate: { kind: 'string', default: 'auto', choices: ['auto', 'reduceLast', 'reduceEach', 'reduceScatterEachAllReduceLast'], doc: 'With several micro-batches: "reduceLast" reduces once per step (least communication), "reduceEach" reduces every micro-batch into the gradient shards (least memory; zero >= 2), "reduceScatterEachAllReduceLast" reduce-scatters every micro-batch and all-reduces across replicas once (HSDP); "auto" = reduceEach for zero >= 2, else reduceLast.' },
      reshardAfterForward: { kind: 'bool', default: true, doc: 'ZeRO-3: free each wrapping unit\'s gathered parameters after its forward and gather them again for its backward (false keeps them, trading memory for one all-gather per unit).' },
      bucketSizeMb: { kind: 'float', default: 0, min: 0, doc: 'Gradient bucket size in MiB for the gradient collectives; 0 = the default: 25, or 4 under zero = 2 (a ZeRO-2 rank holds about three buckets of full gradients while it reduces; src/parallel/data_parallel.ts, defaultBucketSizeMb).' },
      reduceDtype: { kind: 'string', default: 'fp32', choices: ['fp32', 'bf16'], doc: 'What gradient collectives move: "fp32", or "bf16" (half the bytes; the float32 buckets are cast for the collective and back). Gradients accumulate in float32 either way.' },
      overlap: { kind: 'bool', default: true, doc: 'Start each bucket\'s all-reduce during backward, as soon as its gradients are final.' },
      backend: { kind: 'string', default: 'auto', choices: ['auto', 'gloo', 'mpi'], doc: 'Collectives: "mpi" (Open MPI, shared memory within a host; ranks start through mpirun), "gloo" (c10d Gloo over TCP), or "auto" = mpi when Open MPI is installed, else gloo.' },
      pp: { kind: 'int', default: 1, min: 1, doc: 'Pipeline-parallel degree: ranks each model replica is split over (must divide the world size); data.microBatches is the pipeline\'s m.' },
      ppSchedule: { kind: 'string', default: '1f1b', choices: ['gpipe', '1f1b', 'interleaved', 'zb'], doc: 'Pipeline schedule: "gpipe", "1f1b", "interleaved" (ppVirtualStages stages per rank) or "zb" (zero bubble: backward split into input and weight gradients).' },
      ppVirtualStages: { kind: 'int', default: 1, min: 1, doc: 'Stages per pipeline rank; more than 1 needs ppSchedule = "interleaved".' },
      tp: { kind: 'int', default: 1, min: 1, doc: 'Tensor-parallel degree: ranks each layer\'s weights are split over (Megatron-style column/row-parallel Linear, vocab-parallel embedding); the innermost mesh dim, so these ranks are neighbours. model.nHead, nEmbd, 4 x nEmbd and vocabSize must divide by it. Tensor-parallel ranks read the same batch.' },
      sequenceParallel: { kind: 'bool', default: false, doc: 'With tp > 1: LayerNorm, dropout and the residual stream are sharded over tokens too (all-gather / reduce-scatter instead of all-reduce); data.seqLen must divide by tp.' },
      lossParallel: { kind: 'bool', default: false, doc: 'With tp > 1: the logits stay sharded over the vocabulary and the loss is the vocab-parallel cross-entropy (never gathers the full logits).' },
    },
  },
  checkpoint: {
    doc: 'Saving and resuming (src/checkpoint): every rank writes what it owns; a checkpoint loads under any layout.',
    fields: {
      every: { kind: 'int', default: 0, min: 0, doc: 'Save a checkpoint every this many steps and after the last (0: only on Ctrl-C).' },
      keep: { kind: 'int', default: 3, min: 1, doc: 'Complete checkpoints kept; older ones are deleted once a newer one is durable.' },
      dir: { kind: 'string', default: '', doc: 'Checkpoint directory ("" means <run dir>/checkpoints).' },
      async: { kind: 'bool', default: false, doc: 'Copy the state in memory and write it on a background thread while training continues (the next save and the end of the run wait for it).' },
    },
  },
  log: {
    doc: 'Console progress and the metrics file (rank 0 only).',
    fields: {
      every: { kind: 'int', default: 10, min: 1, doc: 'Console update every this many steps (the metrics file gets every step).' },
      progress: { kind: 'string', default: 'auto', choices: ['auto', 'bar', 'plain', 'off'], doc: '"bar": a progress bar; "plain": log lines; "auto": bar on a terminal, lines otherwise.' },
      metrics: { kind: 'string', default: 'metrics.jsonl', doc: 'JSON-lines metrics file in the run directory, one line per step ("" turns it off).' },
    },
  },
};

/** A config the user got wrong: each problem names the field and the fix. */
export class ConfigError extends Error {
  constructor(readonly problems: string[], where?: string) {
    super(
      problems.length === 1
        ? `${where ? `${where}: ` : ''}${problems[0]}`
        : `${where ? `${where}: ` : ''}${problems.length} problems in the config:\n  - ${problems.join('\n  - ')}`,
    );
    this.name = 'ConfigError';
  }
}

type AnyField = Omit<Field<unknown>, 'kind'> & { kind: 'int' | 'float' | 'bool' | 'string' | 'sources' };
type RawConfig = Record<string, Record<string, unknown>>;

const sections = Object.keys(configSchema) as (keyof FlotillaConfig)[];

function fieldsOf(section: string): Record<string, AnyField> | undefined {
  const s = (configSchema as unknown as Record<string, { fields: Record<string, AnyField> }>)[section];
  return s?.fields;
}

function editDistance(a: string, b: string): number {
  const d = Array.from({ length: a.length + 1 }, (_, i) => [i, ...Array<number>(b.length).fill(0)]);
  for (let j = 1; j <= b.length; j++) d[0]![j] = j;
  for (let i = 1; i <= a.length; i++) {
    for (let j = 1; j <= b.length; j++) {
      d[i]![j] = Math.min(d[i - 1]![j]! + 1, d[i]![j - 1]! + 1, d[i - 1]![j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1));
    }
  }
  return d[a.length]![b.length]!;
}

function suggest(name: string, valid: string[]): string {
  const lower = name.toLowerCase();
  const limit = lower.length <= 4 ? 1 : 2;
  const hit = valid.find((v) => v.toLowerCase() === lower) ?? valid.find((v) => editDistance(v.toLowerCase(), lower) <= limit);
  return hit ? ` (did you mean ${hit}?)` : '';
}

function unknownSection(name: string, how: string): string {
  return `unknown section ${how}${suggest(name, sections)}; valid sections: ${sections.join(', ')}`;
}

function unknownField(section: string, name: string, how: string): string {
  const valid = Object.keys(fieldsOf(section)!);
  return `unknown key ${how}${suggest(name, valid)}; valid keys in [${section}]: ${valid.join(', ')}`;
}

/** `path:weight,path:weight` or a JSON array of { path, weight } (the command-line form of data.sources). */
function parseSourcesText(text: string): { value?: SourceEntry[]; problem?: string } {
  const t = text.trim();
  if (t === '' || t === '[]') return { value: [] };
  if (t.startsWith('[')) {
    try {
      return { value: JSON.parse(t) as SourceEntry[] };
    } catch (e) {
      return { problem: `--data.sources is not a JSON array (${(e as Error).message}); write --data.sources=dirA:0.7,dirB:0.3` };
    }
  }
  const out: SourceEntry[] = [];
  for (const part of t.split(',')) {
    const i = part.lastIndexOf(':');
    const weight = i > 0 ? Number(part.slice(i + 1)) : NaN;
    if (!Number.isFinite(weight)) return { problem: `--data.sources entry ${JSON.stringify(part)} needs a weight: write path:weight (e.g. data/web:0.7)` };
    out.push({ path: part.slice(0, i), weight });
  }
  return { value: out };
}

function describe(v: unknown): string {
  return typeof v === 'string' ? JSON.stringify(v) : typeof v === 'object' ? (Array.isArray(v) ? 'an array' : 'a table') : String(v);
}

/** Checks one value against its field; returns a problem or undefined. */
function checkField(key: string, f: AnyField, v: unknown): string | undefined {
  switch (f.kind) {
    case 'bool':
      if (typeof v !== 'boolean') return `${key} must be true or false, got ${describe(v)}`;
      return undefined;
    case 'sources': {
      const fix = `${key} must be an array of { path = "...", weight = number > 0 }`;
      if (!Array.isArray(v)) return `${fix}, got ${describe(v)}`;
      for (const e of v as unknown[]) {
        const r = e as Record<string, unknown>;
        if (e === null || typeof e !== 'object' || typeof r.path !== 'string' || r.path === '') return `${fix}; an entry has no path`;
        if (typeof r.weight !== 'number' || !(r.weight > 0) || !Number.isFinite(r.weight)) return `${fix}; the weight of ${r.path} is ${describe(r.weight)}`;
        const extra = Object.keys(r).filter((k) => k !== 'path' && k !== 'weight');
        if (extra.length > 0) return `${fix}; unknown key ${extra[0]} in the entry for ${r.path}`;
      }
      return undefined;
    }
    case 'string':
      if (typeof v !== 'string') return `${key} must be a string, got ${describe(v)}`;
      if (f.choices && !f.choices.includes(v)) return `${key} must be one of ${f.choices.map((c) => JSON.stringify(c)).join(', ')}, got ${JSON.stringify(v)}`;
      return undefined;
    case 'int':
    case 'float': {
      if (typeof v !== 'number' || !Number.isFinite(v)) return `${key} must be a finite number, got ${describe(v)}`;
      if (f.kind === 'int' && !Number.isInteger(v)) return `${key} must be an integer, got ${v}`;
      if (f.min !== undefined && v < f.min) return `${key} must be >= ${f.min}, got ${v}`;
      if (f.max !== undefined && v > f.max) return `${key} must be <= ${f.max}, got ${v}`;
      if (f.above !== undefined && !(v > f.above)) return `${key} must be > ${f.above}, got ${v}`;
      if (f.below !== undefined && !(v < f.below)) return `${key} must be < ${f.below}, got ${v}`;
      return undefined;
    }
  }
}

/** Parses a command-line value as the field's type. */
function parseCliValue(key: string, f: AnyField, text: string): { value?: unknown; problem?: string } {
  switch (f.kind) {
    case 'bool':
      if (text === 'true' || text === 'false') return { value: text === 'true' };
      return { problem: `--${key} must be true or false, got ${JSON.stringify(text)}` };
    case 'int':
      if (/^[+-]?\d+$/.test(text)) return { value: Number(text) };
      return { problem: `--${key} must be an integer, got ${JSON.stringify(text)}` };
    case 'float': {
      const n = text.trim() === '' ? NaN : Number(text);
      if (Number.isFinite(n)) return { value: n };
      return { problem: `--${key} must be a number, got ${JSON.stringify(text)}` };
    }
    case 'string':
      return { value: text };
    case 'sources':
      return parseSourcesText(text);
  }
}

export function defaultConfig(): FlotillaConfig {
  const c = schemaDefaults();
  c.model.vocabSize = tokenizerIdentity(c.data.tokenizer).vocabSize; // resolved as parseConfig does
  return c;
}

/** Every field's schema default (model.vocabSize still 0, unresolved). */
function schemaDefaults(): FlotillaConfig {
  const out: Record<string, Record<string, unknown>> = {};
  for (const s of sections) {
    out[s] = {};
    for (const [k, f] of Object.entries(fieldsOf(s)!)) out[s]![k] = Array.isArray(f.default) ? [...f.default] : f.default;
  }
  return out as unknown as FlotillaConfig;
}

/** Turns `--section.field=value` / `--section.field value` arguments into raw values. */
export function parseOverrides(args: readonly string[]): { raw: RawConfig; problems: string[] } {
  const raw: RawConfig = {};
  const problems: string[] = [];
  for (let i = 0; i < args.length; i++) {
    const arg = args[i]!;
    const m = /^--([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)(?:=(.*))?$/s.exec(arg);
    if (!m) {
      problems.push(`cannot read override ${JSON.stringify(arg)}; write --section.field=value (e.g. --optim.lr=3e-4)`);
      continue;
    }
    const [, section, name] = m as unknown as [string, string, string];
    let text = m[3];
    if (text === undefined) {
      const nextArg = args[i + 1];
      if (nextArg === undefined || nextArg.startsWith('--')) {
        problems.push(`--${section}.${name} needs a value; write --${section}.${name}=value`);
        continue;
      }
      text = nextArg;
      i++;
    }
    const fields = fieldsOf(section);
    if (!fields) {
      problems.push(unknownSection(section, `--${section}.${name}`));
      continue;
    }
    const f = fields[name];
    if (!f) {
      problems.push(unknownField(section, name, `--${section}.${name}`));
      continue;
    }
    const r = parseCliValue(`${section}.${name}`, f, text);
    if (r.problem) problems.push(r.problem);
    else (raw[section] ??= {})[name] = r.value;
  }
  return { raw, problems };
}

/** Checks the shape of a parsed TOML table (known sections and keys only). */
function checkRaw(table: Record<string, unknown>): { raw: RawConfig; problems: string[] } {
  const raw: RawConfig = {};
  const problems: string[] = [];
  for (const [section, body] of Object.entries(table)) {
    if (!fieldsOf(section)) {
      problems.push(unknownSection(section, body !== null && typeof body === 'object' ? `[${section}]` : `"${section}"`));
      continue;
    }
    if (body === null || typeof body !== 'object' || Array.isArray(body)) {
      problems.push(`"${section}" must be a table ([${section}]), got ${describe(body)}`);
      continue;
    }
    raw[section] = {};
    for (const [name, v] of Object.entries(body as Record<string, unknown>)) {
      if (!fieldsOf(section)![name]) problems.push(unknownField(section, name, `${section}.${name}`));
      else raw[section]![name] = v;
    }
  }
  return { raw, problems };
}

/** Cross-field rules. */
export function validateConfig(c: FlotillaConfig): string[] {
  const p: string[] = [];
  if (c.model.nEmbd % c.model.nHead !== 0) p.push(`model.nEmbd (${c.model.nEmbd}) must be divisible by model.nHead (${c.model.nHead})`);
  if (c.data.seqLen > c.model.blockSize) p.push(`data.seqLen (${c.data.seqLen}) must be <= model.blockSize (${c.model.blockSize}); lower data.seqLen or raise model.blockSize`);
  if (c.optim.minLr > c.optim.lr) p.push(`optim.minLr (${c.optim.minLr}) must be <= optim.lr (${c.optim.lr})`);
  p.push(...layoutProblems(c.parallel));
  p.push(...tensorParallelProblems(c));
  const ppStages = c.parallel.pp * c.parallel.ppVirtualStages;
  if (c.parallel.pp > 1 && c.model.nLayer < ppStages) {
    p.push(`parallel.pp x parallel.ppVirtualStages = ${ppStages} pipeline stages need model.nLayer >= ${ppStages} (got ${c.model.nLayer}); lower parallel.pp or ppVirtualStages, or raise model.nLayer`);
  }
  const parts = c.data.microBatches * (c.parallel.dp > 0 ? c.parallel.dp : 1);
  if (c.data.globalBatch % parts !== 0) {
    const by = c.parallel.dp > 0 ? `parallel.dp x data.microBatches (${c.parallel.dp} x ${c.data.microBatches} = ${parts})` : `data.microBatches (${parts})`;
    p.push(`data.globalBatch (${c.data.globalBatch}) must be a multiple of ${by}`);
  }
  return p;
}

// [Note: config paths] A path a config names to read (the tokenizer, the sources, the validation
// source, the weights to start from) is resolved against the directory of the config file that
// wrote it, so a config and the files beside it work from any directory (an installed package's
// example, `flotilla train /some/where/run.toml`); a path given on the command line is resolved
// against the current directory, as a shell user expects. The resolved config holds them absolute,
// so the run's saved config.toml and its checkpoints still find them on --resume and in
// `flotilla generate` from anywhere. Outputs (train.runDir, checkpoint.dir) stay relative to the
// current directory: a shared config writes its runs where it is run.

/** The input path fields and the values that are names, not paths. */
const INPUT_PATHS: readonly { section: 'data' | 'train'; field: string; names: readonly string[] }[] = [
  { section: 'data', field: 'tokenizer', names: ['byte', 'gpt2'] },
  { section: 'data', field: 'source', names: [MOBY_DICK] },
  { section: 'data', field: 'valSource', names: ['', MOBY_DICK] },
  { section: 'train', field: 'initFrom', names: [''] },
];

/** A relative input path, for messages about the absolute path it became. */
interface PathOrigin {
  resolved: string;
  /** How it was written and what it is relative to, e.g. `data.tokenizer = "bpe.json" in the config file (relative to its directory)`. */
  how: string;
}

/** Relative input paths of each parsed config, so later checks can say where a missing path came from. */
const pathOrigins = new WeakMap<FlotillaConfig, PathOrigin[]>();

/** Makes the input paths absolute ([Note: config paths]); returns where the relative ones came from. */
function resolveInputPaths(cfg: FlotillaConfig, fromCli: RawConfig, fileBase: string | undefined): PathOrigin[] {
  const origins: PathOrigin[] = [];
  // `said` is how the value was written: on the command line, or in the file (or text) as TOML.
  const one = (v: string, names: readonly string[], cli: boolean, said: { cli: string; toml: string }): string => {
    if (names.includes(v) || isAbsolute(v)) return v;
    const resolved = cli || fileBase === undefined ? resolve(v) : resolve(fileBase, v);
    const how = cli ? `${said.cli} (relative to the current directory)`
      : fileBase === undefined ? `${said.toml} (relative to the current directory)`
        : `${said.toml} in the config file (relative to its directory)`;
    origins.push({ resolved, how });
    return resolved;
  };
  for (const { section, field, names } of INPUT_PATHS) {
    const body = cfg[section] as unknown as Record<string, string>;
    const v = body[field]!;
    const key = `${section}.${field}`;
    body[field] = one(v, names, fromCli[section]?.[field] !== undefined, { cli: `--${key}=${v}`, toml: `${key} = ${JSON.stringify(v)}` });
  }
  const cli = fromCli.data?.sources !== undefined;
  cfg.data.sources = cfg.data.sources.map((e) => {
    const said = `the data.sources path ${JSON.stringify(e.path)}`;
    return { path: one(e.path, [MOBY_DICK], cli, { cli: said, toml: said }), weight: e.weight };
  });
  return origins;
}

/** Adds to each problem that names a resolved path the path as written (see [Note: config paths]). */
function explainPaths(c: FlotillaConfig, problems: string[]): string[] {
  const origins = pathOrigins.get(c) ?? [];
  return problems.map((p) => {
    const o = origins.find((x) => p.includes(x.resolved));
    return o ? `${p} [${o.how}]` : p;
  });
}

/**
 * Builds a config from TOML text and command-line overrides (which win), over the defaults.
 * `where` names the source in messages (the file path); `baseDir` is the directory relative paths
 * in the text start from (the config file's; without it, the current directory). Throws
 * ConfigError listing every problem.
 */
export function parseConfig(tomlText: string, overrides: readonly string[] = [], where = 'config', baseDir?: string): FlotillaConfig {
  let table: Record<string, unknown>;
  try {
    table = parseToml(tomlText) as Record<string, unknown>;
  } catch (e) {
    throw new ConfigError([`not valid TOML: ${(e as Error).message}`], where);
  }
  const fromFile = checkRaw(table);
  const fromCli = parseOverrides(overrides);
  const problems = [...fromFile.problems, ...fromCli.problems];
  const cfg = schemaDefaults() as unknown as RawConfig;
  for (const layer of [fromFile.raw, fromCli.raw]) {
    for (const [s, body] of Object.entries(layer)) Object.assign(cfg[s]!, body);
  }
  for (const s of sections) {
    for (const [k, f] of Object.entries(fieldsOf(s)!)) {
      // TOML has no separate float syntax for whole numbers: 1 is accepted where a float is wanted.
      const problem = checkField(`${s}.${k}`, f, cfg[s]![k]);
      if (problem) problems.push(problem);
    }
  }
  if (problems.length === 0) problems.push(...validateConfig(cfg as unknown as FlotillaConfig));
  if (problems.length > 0) throw new ConfigError(problems, where);
  const resolved = cfg as unknown as FlotillaConfig;
  // Also turns the entries of data.sources into plain objects, not TOML tables.
  const origins = resolveInputPaths(resolved, fromCli.raw, baseDir);
  pathOrigins.set(resolved, origins);
  // model.vocabSize = 0 follows data.tokenizer, so the saved config names the size the model has.
  if (resolved.model.vocabSize === 0) {
    const tok = resolved.data.tokenizer;
    const o = origins.find((x) => x.resolved === tok);
    if (o !== undefined && !(existsSync(tok) && statSync(tok).isFile())) {
      const what = existsSync(tok) ? 'a directory, not a tokenizer.json' : 'does not exist';
      throw new ConfigError([`${o.how} is ${tok}, which ${what}; correct the path, or use "byte" or "gpt2"`], where);
    }
    try {
      resolved.model.vocabSize = tokenizerIdentity(tok).vocabSize;
    } catch (e) {
      throw new ConfigError(explainPaths(resolved, [`data.tokenizer: ${(e as Error).message}`]), where);
    }
  }
  return resolved;
}

/** Reads a TOML file and applies overrides; a missing file is a ConfigError naming the path. */
export function loadConfig(path: string, overrides: readonly string[] = []): FlotillaConfig {
  if (!existsSync(path)) throw new ConfigError([`config file ${path} does not exist (try examples/gpt-tiny.toml)`]);
  if (statSync(path).isDirectory()) throw new ConfigError([`config file ${path} is a directory; pass a TOML file (e.g. examples/gpt-tiny.toml)`]);
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (e) {
    throw new ConfigError([`config file ${path} cannot be read (${(e as NodeJS.ErrnoException).code ?? (e as Error).message})`]);
  }
  return parseConfig(text, overrides, path, dirname(resolve(path)));
}

function tomlValue(v: unknown): string {
  if (typeof v === 'string') return JSON.stringify(v); // JSON string escapes are valid TOML basic-string escapes
  if (Array.isArray(v)) return `[${v.map((e: SourceEntry) => `{ path = ${JSON.stringify(e.path)}, weight = ${e.weight} }`).join(', ')}]`;
  return String(v);
}

/** The config as TOML; with docs, each section and field carries its documentation as a comment. */
export function configToToml(c: FlotillaConfig, opts: { docs?: boolean; header?: string } = {}): string {
  const docs = opts.docs ?? true;
  const lines: string[] = [];
  if (opts.header) lines.push(...opts.header.split('\n').map((l) => `# ${l}`), '');
  for (const s of sections) {
    const sec = configSchema[s] as unknown as { doc: string; fields: Record<string, AnyField> };
    if (docs) lines.push(`# ${sec.doc}`);
    lines.push(`[${s}]`);
    for (const [k, f] of Object.entries(sec.fields)) {
      if (docs) lines.push(`# ${f.doc}`);
      lines.push(`${k} = ${tomlValue((c[s] as unknown as Record<string, unknown>)[k])}`);
    }
    lines.push('');
  }
  return lines.join('\n');
}

/**
 * Checks that a valid config can run on `worldSize` ranks: the data-parallel degree, the split of
 * the global batch, and that a data.source file exists. The launcher runs it before starting ranks
 * and every rank runs it before touching anything, so these mistakes cost no process and no file.
 */
export function checkRunnable(c: FlotillaConfig, worldSize: number): string[] {
  const p = layoutProblems(c.parallel, worldSize);
  const dp = dataParallelDegree(c.parallel, worldSize);
  const parts = dp * c.data.microBatches;
  if (c.data.globalBatch % parts !== 0) {
    const lower = Math.floor(c.data.globalBatch / parts) * parts;
    p.push(
      `data.globalBatch=${c.data.globalBatch} does not split over ${dp} data-parallel rank(s) x ${c.data.microBatches} micro-batch(es) = ` +
        `${parts} equal parts; set data.globalBatch to a multiple of ${parts} (e.g. ${lower > 0 ? `${lower} or ` : ''}${lower + parts})`,
    );
  }
  // Again with the vocabulary resolved from the tokenizer (model.vocabSize = 0 when validated).
  p.push(...tensorParallelProblems(c));
  // Sources, manifests, the tokenizer and the vocabulary (src/data/sources.ts); no tokenizing.
  p.push(...explainPaths(c, checkDataConfig(c.data, c.model.vocabSize)));
  return p;
}

/** What parallel.tp splits must divide by it (the GPT's heads, widths and vocabulary; tokens under sequence parallelism). */
function tensorParallelProblems(c: FlotillaConfig): string[] {
  const tp = c.parallel.tp;
  if (!(tp > 1)) return [];
  const m = c.model;
  const checks: [string, number][] = [['model.nHead', m.nHead], ['model.nEmbd', m.nEmbd], ['4 x model.nEmbd (the MLP width)', 4 * m.nEmbd], ['model.vocabSize', m.vocabSize]];
  if (c.parallel.sequenceParallel) checks.push(['data.seqLen (sequence parallelism shards tokens)', c.data.seqLen]);
  return checks
    .filter(([, v]) => v % tp !== 0)
    .map(([what, v]) => `${what} = ${v} does not divide by parallel.tp = ${tp}; choose a tp that divides it${what === 'model.vocabSize' ? ' (or pad the vocabulary: set model.vocabSize to a multiple of tp)' : ''}`);
}

/** The run directory: train.runDir, or runs/<train.name>. */
export function runDirOf(c: FlotillaConfig): string {
  return c.train.runDir !== '' ? c.train.runDir : `runs/${c.train.name}`;
}
/** True when `dir` (or its checkpoints/ subdirectory) holds a safetensors checkpoint. */
function hasCheckpoints(dir: string): boolean {
  for (const d of [dir, join(dir, 'checkpoints')]) {
    try {
      if (readdirSync(d).some((f) => f.endsWith('.safetensors') || (/^step-\d+$/.test(f) && existsSync(join(d, f, 'meta.json'))))) return true;
    } catch {
      // no such directory
    }
  }
  return false;
}

/**
 * Why the run directory cannot be used, or undefined when it can: a new run refuses a directory that
 * already has files (an earlier run's), so nothing is overwritten silently; `resume` accepts one.
 * Changes nothing on disk.
 */
export function runDirProblem(c: FlotillaConfig, opts: { resume?: boolean } = {}): string | undefined {
  const dir = runDirOf(c);
  const which = c.train.runDir !== '' ? `--train.runDir=${c.train.runDir}` : `--train.name=${c.train.name}`;
  if (!existsSync(dir)) return opts.resume ? `cannot resume: the run directory ${dir} does not exist (check ${which})` : undefined;
  if (!statSync(dir).isDirectory()) return `the run directory ${dir} exists and is not a directory; pick another --train.name (or --train.runDir)`;
  if (opts.resume || readdirSync(dir).length === 0) return undefined;
  const fix = c.train.runDir !== ''
    ? 'pick another --train.runDir'
    : `pick another --train.name (e.g. --train.name=${c.train.name}-2)`;
  if (hasCheckpoints(dir)) {
    return `the run directory ${dir} holds checkpoints of an earlier run: resume that run from them, ${fix}, or delete ${dir} to start over`;
  }
  return `the run directory ${dir} already holds an earlier run (${which}); ${fix}, or delete ${dir} to start over`;
}

/**
 * Checks the run directory (runDirProblem) and creates it; throws ConfigError naming the fix.
 * Returns its path. A group restarted by `flotilla run --max-restarts` (FLOTILLA_RESTART_COUNT > 0)
 * reuses the directory its first attempt created.
 */
export function prepareRunDir(c: FlotillaConfig, opts: { resume?: boolean } = {}): string {
  const restarted = Number(process.env.FLOTILLA_RESTART_COUNT ?? 0) > 0;
  const problem = runDirProblem(c, { resume: opts.resume });
  if (problem !== undefined && !(restarted && existsSync(runDirOf(c)))) throw new ConfigError([problem]);
  const dir = runDirOf(c);
  mkdirSync(dir, { recursive: true });
  return dir;
}

