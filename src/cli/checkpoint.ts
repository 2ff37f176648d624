// `flotilla export`, `flotilla generate` and `flotilla checkpoint check`: using what a run saved,
// in one process, without the layout it was trained under.
import { existsSync, readdirSync, statSync, writeFileSync } from 'node:fs';
import type { Tensor } from '../tensor/index.js';
import type { Module } from '../nn/module.js';
import type { GPTConfig } from '../models/gpt.js';
import { generate as generateTokens, type CausalLM } from '../inference/generate.js';
import { withKernels, type KernelChoice } from '../nn/kernels/choice.js';
import { modelSpec } from '../models/registry.js';
import { placementsOf } from '../parallel/placement.js';
import { checkCheckpoint, loadWeights } from '../checkpoint/checkpoint.js';
import { resolveCheckpoint } from '../checkpoint/format.js';
import { exportCheckpoint, withMoE } from '../checkpoint/export.js';
import { CheckpointError, readMeta } from '../checkpoint/format.js';
import { readSafetensorsHeader } from '../checkpoint/safetensors.js';
import { UsageError } from './usage.js';
import { modelEosIds } from '../inference/stop_ids.js';
import { exportCheckpointHf, hfTokenizerSpec, isHfDir, loadHfInto, parseSize, readHfDir } from '../checkpoint/hf.js';
import { exportMergedHf, exportPeft, readLoraCheckpoint, type LoraCheckpoint } from '../train/lora_export.js';
import { attachPeftAdapter } from '../checkpoint/peft.js';
import { loraRunModel } from '../train/lora_run.js';
import type { Tokenizer } from '../data/tokenizer.js';
import { chatPrompt, loadChatTemplate, tokenizerDirOf, type ChatTemplate } from '../data/chat/index.js';


const EXPORT_USAGE = 'export: usage: flotilla export <checkpoint|run dir> <out.safetensors>, or flotilla export <checkpoint|run dir> <out dir> --format hf [--merge] [--dtype bf16|fp32] [--max-shard-size 5GB], or flotilla export <LoRA checkpoint|run dir> <out dir> --format peft';
const HF_DTYPES: Record<string, 'bfloat16' | 'float32' | 'float16'> = { bf16: 'bfloat16', fp32: 'float32', fp16: 'float16' };

/**
 * `flotilla export CKPT OUT.safetensors`, `flotilla export CKPT DIR --format hf [--merge] [--dtype bf16|fp32] [--max-shard-size SIZE]`
 * or `flotilla export LORA_CKPT DIR --format peft`
 */
export function exportCommand(args: readonly string[], print: (l: string) => void): number {
  const pos: string[] = [];
  const flags: Record<string, string> = {};
  let merge = false;
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (!a.startsWith('--')) {
      pos.push(a);
      continue;
    }
    const [flag, inline] = a.includes('=') ? [a.slice(0, a.indexOf('=')), a.slice(a.indexOf('=') + 1)] : [a, undefined];
    if (flag === '--merge') {
      if (inline !== undefined) throw new UsageError('export: --merge takes no value');
      merge = true;
      continue;
    }
    if (!['--format', '--dtype', '--max-shard-size'].includes(flag)) throw new UsageError(`export: unknown option ${a}; options are --format, --merge, --dtype, --max-shard-size`);
    const v = inline ?? args[++i];
    if (v === undefined) throw new UsageError(`export: ${flag} needs a value`);
    flags[flag] = v;
  }
  const [src, out, ...extra] = pos;
  if (src === undefined || out === undefined || extra.length > 0) throw new UsageError(EXPORT_USAGE);
  const format = flags['--format'] ?? 'safetensors';
  if (merge && format !== 'hf') throw new UsageError(`export: --merge goes with --format hf (the base with the adapters merged in, a Hugging Face directory)${format === 'peft' ? '; --format peft writes the adapters alone, unmerged' : ''}`);
  const notEmpty = (): void => {
    if (existsSync(out) && (!statSync(out).isDirectory() || readdirSync(out).length > 0)) {
      throw new UsageError(`export: ${out} exists${statSync(out).isDirectory() ? ' and is not empty' : ''}; choose a new directory (nothing was written)`);
    }
  };
  if (format === 'peft') {
    if (flags['--dtype'] !== undefined || flags['--max-shard-size'] !== undefined) throw new UsageError('export: --dtype and --max-shard-size go with --format hf');
    notEmpty();
    const r = exportPeft(src, out);
    print(`exported step ${r.step}'s LoRA adapters as a PEFT adapter: ${r.tensors} tensors (${r.bytes.toLocaleString('en-US')} bytes) on ${r.targets.join(', ')} to ${r.dir}`);
    return 0;
  }
  // A LoRA run's checkpoint holds the adapters alone: as a whole model it needs its base merged in.
  const lora = format === 'safetensors' || format === 'hf' ? readLoraCheckpoint(src) : undefined;
  if (lora && !merge) {
    throw new UsageError(`export: ${src} is a LoRA run's checkpoint (adapters only); add --format hf --merge to write its base with the adapters merged in, or use --format peft to write the adapters as a PEFT adapter`);
  }
  if (format === 'hf') {
    if (merge && !lora) throw new UsageError(`export: --merge merges a LoRA run's adapters into its base, and ${src} is not a LoRA run's checkpoint (lora.rank is 0); leave --merge out`);
    const dtype = flags['--dtype'] === undefined ? undefined : HF_DTYPES[flags['--dtype']];
    if (flags['--dtype'] !== undefined && !dtype) throw new UsageError(`export: --dtype ${JSON.stringify(flags['--dtype'])} is not bf16, fp32 or fp16`);
    let maxShardSize: number | undefined;
    try {
      if (flags['--max-shard-size'] !== undefined) maxShardSize = parseSize(flags['--max-shard-size'], '--max-shard-size');
    } catch (e) {
      throw new UsageError(`export: ${(e as Error).message}`);
    }
    notEmpty();
    const shard = maxShardSize !== undefined ? { maxShardSize } : {};
    if (lora) {
      const r = exportMergedHf(lora, out, { ...(dtype ? { dtype } : {}), ...shard });
      print(`exported step ${r.step} with its LoRA adapters merged into the base as a Hugging Face ${r.architecture}: ${r.tensors} tensors (${r.bytes.toLocaleString('en-US')} bytes, ${r.dtype}) in ${r.files.length} file(s) to ${r.dir}`);
      return 0;
    }
    const r = exportCheckpointHf(src, out, { dtype: dtype ?? 'float32', ...shard });
    print(`exported step ${r.step} as a Hugging Face ${r.architecture}: ${r.tensors} tensors (${r.bytes.toLocaleString('en-US')} bytes, ${dtype ?? 'float32'}) in ${r.files.length} file(s) to ${r.dir}`);
    return 0;
  }
  if (format !== 'safetensors') throw new UsageError(`export: --format ${JSON.stringify(format)} is not "safetensors" (one file, the default), "hf" (a Hugging Face directory) or "peft" (a LoRA run's adapters)`);
  if (flags['--dtype'] !== undefined || flags['--max-shard-size'] !== undefined) throw new UsageError('export: --dtype and --max-shard-size go with --format hf');
  if (!out.endsWith('.safetensors')) throw new UsageError(`export: the output ${out} should end in .safetensors (or add --format hf to write a Hugging Face directory)`);
  if (existsSync(out)) throw new UsageError(`export: ${out} exists; choose another name or delete it first (nothing was written)`);
  const r = exportCheckpoint(src, out);
  print(`exported step ${r.step}: ${r.params} parameters (${r.elements.toLocaleString('en-US')} elements) to ${r.out}`);
  return 0;
}

/** `flotilla checkpoint check PATH [PATH...]` (several: the hosts' directories of one checkpoint) */
export function checkpointCommand(args: readonly string[], print: (l: string) => void): number {
  const [sub, ...paths] = args;
  if (sub !== 'check' || paths.length === 0) throw new UsageError('checkpoint: usage: flotilla checkpoint check <checkpoint|checkpoints dir|run dir> [the same on other hosts...]');
  const r = checkCheckpoint(paths);
  const where = r.dirs.length > 1 ? `${r.dirs.join(' + ')}` : r.dirs[0]!;
  const copies = r.dirs.length > 1 ? (r.single.length > 0 ? `; one copy only of ${r.single.join(', ')}` : '; every file on two hosts') : '';
  print(`OK ${where}: step ${r.step}, ${r.files} file(s), ${r.bytes.toLocaleString('en-US')} bytes, ${r.params} parameters (${r.elements.toLocaleString('en-US')} elements); sizes and SHA-256 checksums match, every tensor complete${copies}`);
  return 0;
}

export interface GenerateOptions {
  /** One or more prompts, continued together in one batch. */
  prompts: string[];
  tokens: number;
  temperature: number;
  topK: number;
  topP: number;
  seed: number;
  /** Go on past the end-of-text token. */
  ignoreEos: boolean;
  /** A PEFT LoRA adapter directory applied (unmerged) to the base model at the path. */
  adapter?: string;
  /**
   * Each prompt is a user's turn in the model's chat template (rendered with the generation prompt),
   * and sampling stops at the template's end of turn: a chat template spec ("model", "chatml", a
   * .jinja path) or "" for the one the run trained with (a Hugging Face directory's own otherwise).
   */
  chat?: string;
}

/** The attention a run trained with ([train] kernels), which its generation uses too; eager for anything else. */
function kernelsOf(config: Record<string, unknown>): KernelChoice {
  const k = (config.train as { kernels?: unknown } | undefined)?.kernels;
  return k === 'fused' ? 'fused' : 'eager';
}

/** The model config and tokenizer spec a checkpoint or an exported file records (and a run's kernels). */
function modelOf(path: string): { weights: string; model: Partial<GPTConfig>; tokenizer: string; chatTemplate?: string; kernels?: KernelChoice } {
  if (isHfDir(path)) {
    const h = readHfDir(path);
    return { weights: path, model: h.model, tokenizer: hfTokenizerSpec({ config: h.model, ...(h.tokenizer ? { tokenizer: h.tokenizer } : {}) }, path) };
  }
  if (existsSync(path) && statSync(path).isFile()) {
    const h = readSafetensorsHeader(path);
    const model = h.metadata['flotilla.model'];
    if (!model) throw new CheckpointError(`${path} has no flotilla.model metadata: it was not written by flotilla export, so its model config is unknown`);
    const data = JSON.parse(h.metadata['flotilla.data'] ?? '{}') as { tokenizer?: string };
    return { weights: path, model: JSON.parse(model) as Partial<GPTConfig>, tokenizer: data.tokenizer ?? 'byte' };
  }
  const dir = resolveCheckpoint(path);
  const meta = readMeta(dir);
  const data = (meta.config.data ?? {}) as { tokenizer?: string; chatTemplate?: string };
  return { weights: dir, model: withMoE(meta.config) as Partial<GPTConfig>, tokenizer: data.tokenizer ?? 'byte', ...(data.chatTemplate ? { chatTemplate: data.chatTemplate } : {}), kernels: kernelsOf(meta.config) };
}

type Sampled = CausalLM & { namedParameters(): [string, Tensor][]; numParams(): number; dispose(): void };

/**
 * The model to sample from and its tokenizer: a checkpoint, an exported file or a Hugging Face
 * directory; a LoRA run's checkpoint as its base with its adapters; any of the first three with a
 * PEFT adapter directory's adapters on it (unmerged).
 */
function modelFor(path: string, adapter: string | undefined): { model: Sampled; tokenizer: string; chatTemplate?: string; kernels: KernelChoice } {
  const lora = readLoraCheckpoint(path);
  if (lora) {
    if (adapter !== undefined) throw new UsageError(`generate: ${path} is a LoRA run's checkpoint, which brings its own adapters; --adapter goes with a base model (a Hugging Face directory or a checkpoint of a whole model)`);
    const { model } = loraRunModel(lora.dir);
    const data = (lora.meta.config.data ?? {}) as { tokenizer?: string; chatTemplate?: string };
    return { model: model as unknown as Sampled, tokenizer: data.tokenizer ?? 'byte', ...(data.chatTemplate ? { chatTemplate: data.chatTemplate } : {}), kernels: kernelsOf(lora.meta.config) };
  }
  const { weights, model: cfg, tokenizer, chatTemplate, kernels } = modelOf(path);
  // Any registered architecture (the run's [model] arch) that decodes with a cache.
  const spec = modelSpec((cfg as { arch?: string }).arch ?? 'gpt');
  const model = spec.build(cfg, { initSeed: 0 }) as unknown as Sampled & Module;
  try {
    if (isHfDir(weights)) loadHfInto(weights, placementsOf(model.namedParameters()), model.numParams());
    else loadWeights(weights, placementsOf(model.namedParameters()), model.numParams());
    if (adapter !== undefined) attachPeftAdapter(model, spec, cfg as Record<string, unknown>, adapter);
  } catch (e) {
    model.dispose();
    throw e;
  }
  return { model, tokenizer, ...(chatTemplate ? { chatTemplate } : {}), kernels: kernels ?? 'eager' };
}

interface TextCodec {
  encode(text: string): ArrayLike<number>;
  decode(ids: ArrayLike<number>): string;
}

async function codecFor(spec: string): Promise<TextCodec> {
  const data = await import('../data/index.js') as Record<string, unknown>;
  const load = data.loadTokenizer as ((s: string) => TextCodec) | undefined;
  if (load) return load(spec);
  if (spec !== 'byte') throw new CheckpointError(`this build cannot decode tokenizer "${spec}"`);
  return {
    encode: (t) => new TextEncoder().encode(t),
    decode: (ids) => new TextDecoder().decode(Uint8Array.from(ids as ArrayLike<number>)),
  };
}

/**
 * Samples a continuation of each prompt from a checkpoint, an exported file or a Hugging Face
 * directory, all prompts in one batch with the key/value cache (src/inference/generate.ts); a
 * continuation ends at the tokenizer's end-of-text id unless ignoreEos. Deterministic for a seed.
 * Attention runs as a run trained it ([train] kernels; eager for an exported file or a Hugging Face directory).
 */
export async function generate(path: string, o: GenerateOptions): Promise<{ prompt: string; text: string }[]> {
  const { model, tokenizer, chatTemplate, kernels } = modelFor(path, o.adapter);
  try {
    const codec = await codecFor(tokenizer);
    const eot = (codec as { eot?: number }).eot;
    let prompts: number[][];
    let stop: number[] = eot !== undefined ? [eot] : [];
    if (o.chat !== undefined) {
      const chat = chatPrompts(codec as unknown as Tokenizer, tokenizer, o.chat || chatTemplate || 'model', o.prompts);
      prompts = chat.ids;
      stop = chat.stop;
    } else {
      // An empty prompt starts from the end-of-text token alone (an unconditional sample).
      prompts = o.prompts.map((p) => (p === '' && eot !== undefined ? [eot] : Array.from(codec.encode(p))));
    }
    if (prompts.some((p) => p.length === 0)) throw new UsageError('generate: --prompt needs some text');
    // The family's end ids (eos_token_id may be a list: end of turn and end of text) end a reply too.
    for (const id of modelEosIds([isHfDir(path) ? path : undefined, tokenizerDirOf(tokenizer)])) if (!stop.includes(id)) stop.push(id);
    const out = withKernels(kernels, () => generateTokens(model, prompts, {
      maxNewTokens: o.tokens, temperature: o.temperature, topK: o.topK, topP: o.topP, seed: o.seed >>> 0,
      ...(!o.ignoreEos ? { stopIds: stop } : {}),
    }));
    return out.map((ids, r) => ({ prompt: o.prompts[r]!, text: codec.decode(!o.ignoreEos && stop.includes(ids[ids.length - 1]!) ? ids.slice(0, -1) : ids) }));
  } finally {
    model.dispose();
  }
}

/** Each prompt as a user's turn in the chat template `spec`, and the ids that end the reply. */
function chatPrompts(tok: Tokenizer, tokenizerSpec: string, spec: string, prompts: readonly string[]): { ids: number[][]; stop: number[] } {
  const dir = tokenizerDirOf(tokenizerSpec);
  let t: ChatTemplate;
  try {
    t = loadChatTemplate(spec, dir !== undefined ? { tokenizerDir: dir } : {});
  } catch (e) {
    throw new UsageError(`generate --chat: ${(e as Error).message}`);
  }
  const rendered = prompts.map((p) => chatPrompt(tok, t, p));
  return { ids: rendered.map((r) => r.ids), stop: rendered[0]!.stop };
}

function num(v: string | undefined, flag: string, ok: (n: number) => boolean, what: string): number {
  const n = Number(v);
  if (v === undefined || v.trim() === '' || !Number.isFinite(n) || !ok(n)) throw new UsageError(`generate: ${flag} needs ${what}, got ${v === undefined ? 'nothing' : JSON.stringify(v)}`);
  return n;
}

const GENERATE_USAGE = 'generate: usage: flotilla generate <checkpoint|run dir|exported.safetensors|Hugging Face dir> [--adapter PEFT_DIR] [--chat [--chat-template model|chatml|FILE]] --prompt TEXT [--prompt TEXT ...] [--tokens N --temperature T --top-k K --top-p P --seed S --ignore-eos --out FILE] (attention as a run trained it: its [train] kernels)';

/** `flotilla generate CKPT [--adapter DIR] [--chat [--chat-template SPEC]] --prompt TEXT [--prompt TEXT ...] [--tokens N --temperature T --top-k K --top-p P --seed S --ignore-eos --out FILE]` */
export async function generateCommand(args: readonly string[], print: (l: string) => void): Promise<number> {
  let path: string | undefined;
  let out: string | undefined;
  const o: GenerateOptions = { prompts: [], tokens: 200, temperature: 0.8, topK: 40, topP: 1, seed: 1, ignoreEos: false };
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    const [flag, inline] = a.startsWith('--') && a.includes('=') ? [a.slice(0, a.indexOf('=')), a.slice(a.indexOf('=') + 1)] : [a, undefined];
    const value = (): string | undefined => inline ?? args[++i];
    if (flag === '--prompt') {
      const v = value();
      if (v === undefined) throw new UsageError('generate: --prompt needs text');
      o.prompts.push(v);
    } else if (flag === '--chat') {
      if (inline !== undefined) throw new UsageError('generate: --chat takes no value (the template: --chat-template model|chatml|FILE)');
      o.chat = o.chat ?? '';
    } else if (flag === '--chat-template') {
      const v = value();
      if (v === undefined || v === '') throw new UsageError('generate: --chat-template needs "model", "chatml" or the path of a .jinja file');
      o.chat = v;
    } else if (flag === '--ignore-eos') {
      if (inline !== undefined) throw new UsageError('generate: --ignore-eos takes no value');
      o.ignoreEos = true;
    } else if (flag === '--top-p') {
      o.topP = num(value(), '--top-p', (n) => n > 0 && n <= 1, 'a number in (0, 1] (1 = no limit)');
    } else if (flag === '--tokens') o.tokens = num(value(), '--tokens', (n) => Number.isInteger(n) && n >= 1 && n <= 100_000, 'a whole number from 1 to 100000');
    else if (flag === '--temperature') o.temperature = num(value(), '--temperature', (n) => n >= 0, 'a number >= 0 (0 = always the most likely token)');
    else if (flag === '--top-k') o.topK = num(value(), '--top-k', (n) => Number.isInteger(n) && n >= 0, 'a whole number >= 0 (0 = no limit)');
    else if (flag === '--seed') o.seed = num(value(), '--seed', (n) => Number.isInteger(n) && n >= 0 && n < 2 ** 32, 'a whole number from 0 to 2^32-1');
    else if (flag === '--out') out = value();
    else if (flag === '--adapter') {
      const v = value();
      if (v === undefined) throw new UsageError('generate: --adapter needs a PEFT adapter directory');
      o.adapter = v;
    }
    else if (a.startsWith('-')) throw new UsageError(`generate: unknown option ${a}; options are --prompt, --adapter, --chat, --chat-template, --tokens, --temperature, --top-k, --top-p, --seed, --ignore-eos, --out`);
    else if (path === undefined) path = a;
    else throw new UsageError(`generate: one checkpoint expected, got ${JSON.stringify(path)} and ${JSON.stringify(a)}`);
  }
  if (path === undefined || o.prompts.length === 0) throw new UsageError(GENERATE_USAGE);
  // A chat reply is printed alone (the prompt went in as the user's turn).
  const texts = (await generate(path, o)).map((r) => (o.chat !== undefined ? r.text : `${r.prompt}${r.text}`));
  print(texts.join('\n\n'));
  if (out !== undefined) writeFileSync(out, `${texts.join('\n\n')}\n`);
  return 0;
}
