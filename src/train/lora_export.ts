// A LoRA run's checkpoint exported in one process, without the layout it trained under: its
// adapters alone as a PEFT directory (`flotilla export --format peft`), or merged into the base they
// trained on (`--format hf --merge`; the model is rebuilt by loraRunModel, src/train/lora_run.ts).
// A LoRA run's checkpoint holds only the adapters (meta.params); meta.config says how the model was
// built: [model], [lora] (rank, alpha, targets, rsLora) and train.initFrom, the base.
import { existsSync, statSync } from 'node:fs';
import { join } from 'node:path';
import type { Tensor } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import { isExpertLoraParameter, isLoraParameter, mergeLora } from '../nn/lora.js';
import { consolidate, withMoE } from '../checkpoint/export.js';
import { CheckpointError, readMeta, resolveCheckpoint, type CheckpointMeta } from '../checkpoint/format.js';
import { isHfDir, readHfDir, writeHfDir, HF_TOKENIZER, type HfWriteReport, type SaveHfOptions } from '../checkpoint/hf.js';
import { wholeModelSlots, writePeftAdapter, type PeftLora, type PeftWriteReport } from '../checkpoint/peft.js';
import { loraRunModel } from './lora_run.js';

/** The [lora] section of a LoRA run (rank > 0). */
export interface LoraSection extends PeftLora {
  targets: string[];
}

/** A LoRA run's checkpoint: where it is, what it records, how its model is built. */
export interface LoraCheckpoint {
  dir: string;
  meta: CheckpointMeta;
  /** The [model] section (with [moe] when it has experts). */
  model: Record<string, unknown>;
  lora: LoraSection;
  /** train.initFrom: the frozen base (a Hugging Face directory, a checkpoint or an exported file). */
  base: string;
}

/** The run's [lora] section when it trained adapters (rank > 0), else undefined. */
export function loraSectionOf(meta: CheckpointMeta): LoraSection | undefined {
  const l = meta.config.lora;
  if (!l || !(Number(l.rank) > 0)) return undefined;
  const targets = Array.isArray(l.targets) ? l.targets.map(String) : ['all-linear'];
  return { rank: Number(l.rank), alpha: Number(l.alpha ?? 16), dropout: Number(l.dropout ?? 0), rsLora: l.rsLora === true, targets };
}

/**
 * The checkpoint at `arg` when it is a LoRA run's (a checkpoint or run directory whose lora.rank > 0),
 * else undefined (also for a file or a Hugging Face directory).
 */
export function readLoraCheckpoint(arg: string): LoraCheckpoint | undefined {
  if (!existsSync(arg) || !statSync(arg).isDirectory() || isHfDir(arg)) return undefined;
  const dir = resolveCheckpoint(arg);
  const meta = readMeta(dir);
  const lora = loraSectionOf(meta);
  if (!lora) return undefined;
  const base = String(meta.config.train?.initFrom ?? '');
  if (base === '') throw new CheckpointError(`${arg} is a LoRA run's checkpoint without train.initFrom in its config, so the base its adapters belong to is unknown`);
  return { dir, meta, model: withMoE(meta.config), lora, base };
}

/** `flotilla export RUN OUT --format peft`: the run's adapters as a PEFT LoRA directory. */
export function exportPeft(arg: string, out: string): PeftWriteReport & { step: number } {
  const c = readLoraCheckpoint(arg);
  if (!c) {
    throw new CheckpointError(`${arg} is not a LoRA run's checkpoint (its lora.rank is 0: it holds the whole model), so it has no adapters to export; export the model with --format hf, or as one .safetensors file`);
  }
  const slots = wholeModelSlots(c.model, c.lora.targets, c.lora.rank);
  const { meta, tensors } = consolidate(c.dir);
  try {
    // The adapters go with the tokenizer their run read (a chat run's template and special tokens).
    const tokenizer = runTokenizer(c)?.file;
    const r = writePeftAdapter(out, { slots, tensors, lora: c.lora, base: c.base, ...(tokenizer ? { tokenizer } : {}) });
    return { ...r, step: meta.step };
  } finally {
    for (const t of Object.values(tensors)) t.dispose();
  }
}

/**
 * The dtype a base is stored in, for a merged export: a Hugging Face directory's torch_dtype (else
 * its weights' dtype), float32 for a flotilla checkpoint or export.
 */
export function baseDtypeOf(base: string): 'float32' | 'bfloat16' | 'float16' {
  const ok = (v: unknown): v is 'float32' | 'bfloat16' | 'float16' => v === 'float32' || v === 'bfloat16' || v === 'float16';
  if (!isHfDir(base)) return 'float32';
  const h = readHfDir(base);
  if (ok(h.config.torch_dtype)) return h.config.torch_dtype;
  const first = h.stored.values().next().value as { dtype: string } | undefined;
  return first && ok(first.dtype) ? first.dtype : 'float32';
}

/**
 * The tokenizer.json the run's data was tokenized with (data.tokenizer): a Hugging Face tokenizer
 * directory's (its companions beside it), or a .json file; undefined for a named one ("byte", "gpt2").
 */
export function runTokenizer(c: LoraCheckpoint): { file: string; dir: boolean } | undefined {
  const tok = (c.meta.config.data as { tokenizer?: unknown } | undefined)?.tokenizer;
  if (typeof tok !== 'string' || !existsSync(tok)) return undefined;
  if (statSync(tok).isDirectory()) return existsSync(join(tok, HF_TOKENIZER)) ? { file: join(tok, HF_TOKENIZER), dir: true } : undefined;
  return tok.endsWith('.json') ? { file: tok, dir: false } : undefined;
}

/**
 * The tokenizer.json that goes with a merged export (writeHfDir copies its companions along): the
 * run's data.tokenizer when it is a directory (a chat run's special tokens and template), else the
 * base directory's, else the run's own .json.
 */
export function loraTokenizer(c: LoraCheckpoint): string | undefined {
  const run = runTokenizer(c);
  if (run?.dir) return run.file;
  if (isHfDir(c.base) && existsSync(join(c.base, HF_TOKENIZER))) return join(c.base, HF_TOKENIZER);
  return run?.file;
}

/** Every parameter of a model by name, the adapters left out (what a merged export writes). */
export function baseParameters(model: Module): Record<string, Tensor> {
  return Object.fromEntries(model.namedParameters().filter(([n]) => !isLoraParameter(n) && !isExpertLoraParameter(n)));
}

/**
 * `flotilla export RUN OUT --format hf --merge`: the base with the run's adapters merged in
 * (W + scale * B A) as a Hugging Face directory, stored in the base's dtype unless `dtype` says. An
 * MoE model's expert adapters merge into their own experts' slices of the stacks ([Note: LoRA on
 * experts]), which the family's map writes back as one Linear per expert (Mixtral, Qwen3-MoE).
 */
export function exportMergedHf(c: LoraCheckpoint, out: string, opts: Omit<SaveHfOptions, 'tokenizer'> = {}): HfWriteReport & { step: number; dtype: string } {
  const dtype = opts.dtype ?? baseDtypeOf(c.base);
  const { model, spec } = loraRunModel(c.dir);
  try {
    mergeLora(model);
    const tokenizer = loraTokenizer(c);
    const r = writeHfDir(out, spec, c.model, baseParameters(model), { ...opts, dtype, ...(tokenizer ? { tokenizer } : {}) });
    return { ...r, step: c.meta.step, dtype };
  } finally {
    model.dispose();
  }
}
