// PEFT LoRA adapter directories, both ways: adapter_config.json plus adapter_model.safetensors, as
// PEFT's save_pretrained writes them, so PEFT, transformers, vLLM and llama.cpp's converter read what
// flotilla exports and flotilla reads theirs.
//
// [Note: PEFT names] PEFT names an adapter's tensors by the Hugging Face module it wraps:
// `base_model.model.<module>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r), e.g.
// `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. flotilla's adapters are
// `<module path>.loraA.weight` / `.loraB.weight` ([Note: LoRA] in src/nn/lora.ts); the module paths
// map to each other through the architecture's Hugging Face tensor map (hfModuleNames). A and B have
// the same shapes for GPT-2's Conv1D as for a Linear: fan_in_fan_out only tells PEFT that the base
// weight is stored [in, out], so its merge adds (B A)^T. An MoE model's experts are Linears to PEFT
// (Mixtral's `...block_sparse_moe.experts.E.w1`, Qwen3-MoE's `...mlp.experts.E.gate_proj`), so
// flotilla's stacked expert adapters ([Note: LoRA on experts]: A (G, r, in), B (G, out, r)) are
// written as one lora_A (r, in) and lora_B (out, r) per expert, expert j's being slice j.
//
// Reading goes through placements like a checkpoint or a Hugging Face directory: each rank reads the
// byte ranges of the adapter elements it holds, under any layout. Writing goes to a temporary
// directory renamed into place, so a failed export leaves nothing behind.
import { existsSync, mkdirSync, readdirSync, renameSync, rmSync, rmdirSync, statSync, writeFileSync } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';
import { randomBytes } from 'node:crypto';
import { Tensor } from '../tensor/index.js';
import { native } from '../tensor/native.js';
import { dtypeCode, elementSize, isFloating, type DType } from '../tensor/dtype.js';
import type { Module } from '../nn/module.js';
import { Linear } from '../nn/layers.js';
import { applyLora, expertLoraAdapters, hfModuleNames, isExpertLoraParameter, isLoraParameter, loraAdapters } from '../nn/lora.js';
import { loraTargetProblems } from '../nn/lora_targets.js';
import { GroupedExperts } from '../nn/moe.js';
import { EXPERT_PROJECTIONS, expertProjectionNames } from '../nn/lora_experts.js';
import { placementsOf, type ParamPlacement } from '../parallel/placement.js';
import { modelSpec, type ModelSpec } from '../models/registry.js';
import { readSafetensorsHeader, saveSafetensors } from './safetensors.js';
import { CheckpointError } from './format.js';
import { PEFT_CONFIG, PEFT_WEIGHTS, peftSettingsProblem, readPeftConfig, type LoraSettings, type PeftAdapterConfig, type PeftLora } from './peft_config.js';
import { RangeReader } from './range_reader.js';
import { copyTokenizer, fillHeld, fillHeldStack, hfFormatFor } from './hf.js';

export { PEFT_CONFIG, PEFT_WEIGHTS, type LoraSettings, type PeftLora } from './peft_config.js';

const PREFIX = 'base_model.model.';

/** One adapted Linear of a whole model: its flotilla and Hugging Face module paths and its sizes. */
export interface AdapterSlot {
  /** flotilla module path, e.g. "layers.0.attn.q"; its adapter's parameters are `<path>.loraA.weight` and `.loraB.weight`. */
  path: string;
  /** Hugging Face module path, e.g. "model.layers.0.self_attn.q_proj". */
  hf: string;
  rank: number;
  inFeatures: number;
  outFeatures: number;
  /** The base weight is stored [in, out] on the Hugging Face side (GPT-2's Conv1D). */
  transposed: boolean;
  /**
   * A projection of this many experts held as one stack ([Note: LoRA on experts]): `path` is
   * `<experts path>.<projection>`, `hf` the experts' module path without an index
   * ("model.layers.0.block_sparse_moe.experts.w1"), and each expert is its own PEFT module.
   */
  experts?: number;
}

/** The flotilla parameter of a slot's A or B: `<path>.loraA.weight`, or a stack's `<path>Lora.loraA`. */
export function slotParameter(s: Pick<AdapterSlot, 'path' | 'experts'>, which: 'A' | 'B'): string {
  return s.experts === undefined ? `${s.path}.lora${which}.weight` : `${s.path}Lora.lora${which}`;
}

/** Expert j's module path of a stack's Hugging Face path (".experts.w1" -> ".experts.3.w1"). */
const expertModule = (hf: string, j: number): string => hf.replace(/\.experts\.(?=[^.]+$)/, `.experts.${j}.`);

/** The PEFT modules of a slot: its Linear, or each of its experts' in order. */
export function slotModules(s: Pick<AdapterSlot, 'hf' | 'experts'>): string[] {
  return s.experts === undefined ? [s.hf] : Array.from({ length: s.experts }, (_, j) => expertModule(s.hf, j));
}

/** PEFT's tensor name of one adapter matrix ([Note: PEFT names]). */
export function peftTensorName(hfModule: string, which: 'A' | 'B'): string {
  return `${PREFIX}${hfModule}.lora_${which}.weight`;
}

/** The last component of a module path ("q_proj" of "model.layers.0.self_attn.q_proj"). */
const shortName = (path: string): string => path.slice(path.lastIndexOf('.') + 1);

/**
 * Hugging Face module paths (and whether stored transposed) by flotilla module path, from a spec's
 * tensor map; `modules`: every Hugging Face module path of the model (each expert's Linear too).
 */
function hfModules(spec: ModelSpec, cfg: Record<string, unknown>): { names: Map<string, string>; transposed: Set<string>; modules: Set<string> } {
  if (!spec.hf) throw new CheckpointError(`model.arch = "${spec.arch}" has no Hugging Face form, so its adapters have no PEFT names`);
  // The class the config is written as: a family's (Mixtral, Qwen3-MoE: its experts' names) when one fits.
  const tensors = (hfFormatFor(spec, cfg) ?? spec.hf).tensors(cfg);
  const transposed = new Set(tensors.filter((t) => t.transpose && t.name.endsWith('.weight')).map((t) => t.name.slice(0, -7)));
  const modules = new Set(tensors.filter((t) => t.hf.endsWith('.weight')).map((t) => t.hf.slice(0, -7)));
  return { names: hfModuleNames(tensors), transposed, modules };
}

/** The options applyLora needs to resolve Hugging Face target names for a model of this config. */
export function loraHfNames(spec: ModelSpec, cfg: Record<string, unknown>): Map<string, string> {
  return hfModules(spec, cfg).names;
}

/** The adapted Linears of a model (whole, or a pipeline stage: what it holds), with their PEFT names. */
export function adapterSlots(model: Module, spec: ModelSpec, cfg: Record<string, unknown>): AdapterSlot[] {
  const { names, transposed } = hfModules(spec, cfg);
  const hfOf = (path: string): string => {
    const hf = names.get(path);
    if (hf === undefined) throw new CheckpointError(`the adapted Linear '${path}' has no Hugging Face name in a ${spec.hf!.architecture}, so it has no PEFT name`);
    return hf;
  };
  const linears = loraAdapters(model).map(([path, a]): AdapterSlot => ({ path, hf: hfOf(path), rank: a.rank, inFeatures: a.base.inFeatures, outFeatures: a.base.outFeatures, transposed: transposed.has(path) }));
  const stacks = expertLoraAdapters(model).map(([path, a]): AdapterSlot => {
    const [G, , In] = a.loraA.shape as [number, number, number];
    return { path, hf: hfOf(path), rank: a.rank, inFeatures: In, outFeatures: a.loraB.shape[1]!, transposed: false, experts: G };
  });
  return [...linears, ...stacks];
}

/**
 * Every adapter slot of the whole model a [model] section describes with LoRA on `targets` at `rank`,
 * from the architecture's list of Linears (ModelRules.linears: no model is built, so any rank may
 * ask, whatever part of the model it holds), chosen as applyLora chooses them.
 */
export function wholeModelSlots(cfg: Record<string, unknown>, targets: readonly string[], rank: number): AdapterSlot[] {
  const spec = modelSpec(String(cfg.arch ?? 'gpt'));
  const { transposed } = hfModules(spec, cfg);
  const linears = spec.linears?.(cfg);
  if (!linears) throw new CheckpointError(`model.arch = "${spec.arch}" does not list its Linears, so its adapters have no PEFT names`);
  const r = loraTargetProblems(linears, { rank, targets, head: 'head' });
  if (r.problems.length > 0) throw new CheckpointError(`LoRA: ${r.problems[0]}`);
  return linears.filter((l) => r.chosen.has(l.path)).map((l) => {
    if (l.hf === undefined) throw new CheckpointError(`the adapted Linear '${l.path}' has no Hugging Face name in a ${spec.hf!.architecture}, so it has no PEFT name`);
    return { path: l.path, hf: l.hf, rank, inFeatures: l.inFeatures, outFeatures: l.outFeatures, transposed: transposed.has(l.path), ...(l.experts !== undefined ? { experts: l.experts } : {}) };
  });
}

/** The sorted distinct module names (last path components) of the slots: PEFT's target_modules. */
export function targetModules(slots: readonly AdapterSlot[]): string[] {
  return [...new Set(slots.map((s) => shortName(s.hf)))].sort();
}

export interface PeftWriteOptions {
  /** The adapted Linears (the whole model's). */
  slots: readonly AdapterSlot[];
  /** Every adapter tensor by flotilla parameter name (slotParameter: `<path>.loraA.weight`, a stack's `<path>Lora.loraA` ...). */
  tensors: Readonly<Record<string, Tensor>>;
  lora: PeftLora;
  /** base_model_name_or_path: the base the adapters were trained on. */
  base: string;
  /** A tokenizer.json to copy in, with the TOKENIZER_COMPANIONS beside it (hf.ts copyTokenizer). */
  tokenizer?: string;
}

export interface PeftWriteReport {
  dir: string;
  tensors: number;
  bytes: number;
  targets: string[];
}

/** A directory we may write into: absent, or empty. */
function checkOutDir(dir: string): void {
  if (!existsSync(dir)) return;
  if (!statSync(dir).isDirectory()) throw new CheckpointError(`${dir} exists and is not a directory; choose a new directory name (nothing was written)`);
  if (readdirSync(dir).length > 0) throw new CheckpointError(`${dir} exists and is not empty; choose a new directory or empty it first (nothing was written)`);
}

/** adapter_config.json's fields for these adapters, as PEFT writes them. */
export function peftConfig(o: { slots: readonly AdapterSlot[]; lora: PeftLora; base: string }): Record<string, unknown> {
  const conv = o.slots.filter((s) => s.transposed).length;
  if (conv !== 0 && conv !== o.slots.length) {
    throw new CheckpointError('the adapted modules mix Linear and Conv1D layouts; one PEFT adapter records one fan_in_fan_out for all of them');
  }
  return {
    alpha_pattern: {},
    base_model_name_or_path: o.base,
    bias: 'none',
    fan_in_fan_out: conv > 0,
    inference_mode: true,
    init_lora_weights: true,
    layers_to_transform: null,
    lora_alpha: o.lora.alpha,
    lora_dropout: o.lora.dropout,
    modules_to_save: null,
    peft_type: 'LORA',
    r: o.lora.rank,
    rank_pattern: {},
    revision: null,
    target_modules: targetModules(o.slots),
    task_type: 'CAUSAL_LM',
    use_dora: false,
    use_rslora: o.lora.rsLora,
  };
}

/**
 * Writes adapters as a PEFT LoRA directory (adapter_config.json, adapter_model.safetensors with
 * PEFT's names, [Note: PEFT names]). The directory appears whole or not at all.
 */
export function writePeftAdapter(dir: string, o: PeftWriteOptions): PeftWriteReport {
  const out = resolve(dir);
  checkOutDir(out);
  if (o.slots.length === 0) throw new CheckpointError('there are no adapters to write');
  const config = peftConfig(o);
  const tensors: Record<string, Tensor> = {};
  let bytes = 0;
  const names = new Set<string>();
  for (const s of [...o.slots].sort((a, b) => (a.hf < b.hf ? -1 : a.hf > b.hf ? 1 : 0))) {
    for (const [which, one] of [['A', [s.rank, s.inFeatures]], ['B', [s.outFeatures, s.rank]]] as const) {
      const name = slotParameter(s, which);
      const shape = s.experts === undefined ? one : [s.experts, ...one];
      const t = o.tensors[name];
      if (!t) throw new CheckpointError(`there is no adapter tensor '${name}' for the adapted module '${s.path}'`);
      if (t.shape.join(',') !== shape.join(',')) throw new CheckpointError(`adapter tensor '${name}' is [${t.shape.join(', ')}]; the model's adapter is [${shape.join(', ')}]`);
      // A stack's slice j is expert j's matrix.
      slotModules(s).forEach((hf, j) => (tensors[peftTensorName(hf, which)] = s.experts === undefined ? t.detach() : t.detach().select(0, j).contiguous()));
      names.add(name);
      bytes += t.numel() * elementSize(t.dtype);
    }
  }
  const extra = Object.keys(o.tensors).filter((n) => !names.has(n));
  if (extra.length > 0) throw new CheckpointError(`'${extra[0]}' is not an adapter of the model's adapted modules; the adapters and the model disagree`);
  const tmp = join(dirname(out), `.${basename(out)}.tmp-${process.pid}-${randomBytes(4).toString('hex')}`);
  mkdirSync(tmp, { recursive: true });
  try {
    saveSafetensors(join(tmp, PEFT_WEIGHTS), tensors, { format: 'pt' });
    writeFileSync(join(tmp, PEFT_CONFIG), `${JSON.stringify(config, null, 2)}\n`);
    if (o.tokenizer !== undefined) copyTokenizer(o.tokenizer, tmp);
    if (existsSync(out)) rmdirSync(out); // empty (checked above)
    renameSync(tmp, out);
  } catch (e) {
    rmSync(tmp, { recursive: true, force: true });
    throw e;
  }
  return { dir: out, tensors: Object.keys(tensors).length, bytes, targets: config.target_modules as string[] };
}

/** Where one stored adapter tensor's bytes are. */
interface StoredTensor {
  dtype: DType;
  shape: number[];
  /** Absolute byte offset of its first element in adapter_model.safetensors. */
  byte: number;
}

/** A PEFT LoRA adapter directory, its config checked (nothing read but the header). */
export interface PeftAdapter extends PeftAdapterConfig {
  dir: string;
  /** Stored tensors by Hugging Face module path, A and B. */
  modules: Map<string, { A?: StoredTensor; B?: StoredTensor }>;
}

// A stored name: PEFT drops the adapter's name ("default") on save; some savers keep it.
const STORED = /^base_model\.model\.(.+)\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$/;

/**
 * Reads a PEFT adapter directory's config (readPeftConfig) and safetensors header: every tensor must
 * be a LoRA A or B weight.
 */
export function readPeftAdapter(path: string): PeftAdapter {
  const c = readPeftConfig(path);
  const dir = resolve(path);
  const wPath = join(dir, PEFT_WEIGHTS);
  if (!existsSync(wPath)) {
    const bin = existsSync(join(dir, 'adapter_model.bin'));
    throw new CheckpointError(`${path} has no ${PEFT_WEIGHTS}${bin ? ': its weights are pickled (adapter_model.bin), which flotilla does not read; save the adapter with safe_serialization=True' : ''}`);
  }
  const h = readSafetensorsHeader(wPath);
  const modules = new Map<string, { A?: StoredTensor; B?: StoredTensor }>();
  for (const name of Object.keys(h.tensors).sort()) {
    const e = h.tensors[name]!;
    const m = STORED.exec(name);
    if (!m) throw new CheckpointError(`${wPath} holds '${name}', which is not a LoRA A or B weight (base_model.model.<module>.lora_A.weight / .lora_B.weight); flotilla reads adapters of LoRA matrices only`);
    if (!isFloating(e.dtype)) throw new CheckpointError(`${wPath}: '${name}' is ${e.dtype}; adapter weights are floating point`);
    const mod = modules.get(m[1]!) ?? {};
    const which = m[2] as 'A' | 'B';
    if (mod[which]) throw new CheckpointError(`${wPath} holds two lora_${which} weights for '${m[1]}'`);
    mod[which] = { dtype: e.dtype, shape: e.shape, byte: h.dataStart + e.dataOffsets[0] };
    modules.set(m[1]!, mod);
  }
  if (modules.size === 0) throw new CheckpointError(`${wPath} holds no LoRA weights`);
  return { ...c, dir, modules };
}

/**
 * Checks an adapter's tensors against the model's adapter slots: every stored module is one the
 * model adapts, every slot has its A and B, every shape is the slot's. The first mismatch is one
 * error naming it. Returns the stored tensors of each flotilla adapter parameter (one, or a stack's
 * one per expert in order).
 */
export function matchPeftAdapter(a: PeftAdapter, slots: readonly AdapterSlot[], knownModules?: ReadonlySet<string>): Map<string, StoredTensor[]> {
  const other = 'the adapter was made for another base model';
  const byHf = new Set(slots.flatMap(slotModules));
  for (const hf of a.modules.keys()) {
    if (!byHf.has(hf)) {
      const what = knownModules === undefined || knownModules.has(hf) ? 'which this model does not adapt' : 'which this model does not have';
      throw new CheckpointError(`adapter ${a.dir} holds weights for module '${hf}', ${what}; ${other} (or with other target_modules)`);
    }
  }
  const out = new Map<string, StoredTensor[]>();
  for (const s of slots) {
    for (const [which, shape] of [['A', [s.rank, s.inFeatures]], ['B', [s.outFeatures, s.rank]]] as const) {
      const parts = slotModules(s).map((hf) => {
        const name = peftTensorName(hf, which);
        const t = a.modules.get(hf)?.[which];
        if (!t) throw new CheckpointError(`adapter ${a.dir} has no '${name}' for the adapted module '${hf}'; ${other} (or with other target_modules)`);
        if (t.shape.length !== 2 || t.shape[0] !== shape[0] || t.shape[1] !== shape[1]) {
          throw new CheckpointError(`adapter ${a.dir}: '${name}' is [${t.shape.join(', ')}], this model's is [${shape.join(', ')}] (rank ${s.rank}, ${hf} is ${s.outFeatures} x ${s.inFeatures}); ${other}`);
        }
        return t;
      });
      out.set(slotParameter(s, which), parts);
    }
  }
  return out;
}

/**
 * Fills the placements of adapter parameters from the adapter's file: each the runs of the whole
 * tensor it holds (a range under ZeRO-3, a tensor-parallel slice), read by byte range. Placements of
 * other parameters are left alone.
 */
export function loadPeftTensors(a: PeftAdapter, matched: ReadonlyMap<string, StoredTensor[]>, placements: readonly ParamPlacement[]): number {
  const reader = new RangeReader(a.dir);
  const read = (s: StoredTensor, offset: number, n: number): Tensor => {
    const es = elementSize(s.dtype);
    return new Tensor(native.fromBuffer(reader.read(PEFT_WEIGHTS, s.byte + offset * es, n * es), [n], dtypeCode(s.dtype)));
  };
  let loaded = 0;
  try {
    for (const p of placements) {
      const stack = isExpertLoraParameter(p.name);
      if (!stack && !isLoraParameter(p.name)) continue;
      const parts = matched.get(p.name);
      if (!parts) throw new CheckpointError(`adapter ${a.dir} has nothing for this model's adapter parameter '${p.name}'; the adapter was made for another base model`);
      const shape = stack ? [parts.length, ...parts[0]!.shape] : parts[0]!.shape;
      if (shape.join(',') !== p.shape.join(',')) throw new CheckpointError(`adapter ${a.dir}: '${p.name}' is [${shape.join(', ')}] there and [${p.shape.join(', ')}] in this model; the adapter was made for another base model`);
      loaded++;
      // A stack's slice j is expert j's matrix, its own stored tensor.
      if (stack) fillHeldStack(p, parts[0]!.shape.reduce((x, y) => x * y, 1), (j, offset, n) => read(parts[j]!, offset, n));
      else fillHeld(p, (whole, n) => read(parts[0]!, whole, n));
    }
  } finally {
    reader.close();
  }
  return loaded;
}

/**
 * The adapter at `dir` checked against a run's [model] and [lora]: every module it holds must be one
 * of this model's; r, lora_alpha, use_rslora and the modules target_modules resolves to must be the
 * run's (one error naming the field that differs); its tensors the whole model's adapters
 * (matchPeftAdapter).
 */
export function checkPeftAdapter(dir: string, model: Record<string, unknown>, lora: LoraSettings): { adapter: PeftAdapter; matched: Map<string, StoredTensor[]> } {
  const a = readPeftAdapter(dir);
  const where = `lora.adapter ${dir}`;
  const spec = modelSpec(String(model.arch ?? 'gpt'));
  const known = hfModules(spec, model).modules;
  // A module this model does not have: another base, whatever the fields say.
  for (const hf of a.modules.keys()) {
    if (!known.has(hf)) throw new CheckpointError(`${where} holds weights for module '${hf}', which this ${spec.hf!.architecture} does not have; the adapter was made for another base model`);
  }
  const problem = peftSettingsProblem(dir, a, lora, (targets) => wholeModelSlotsOrNone(model, targets, lora.rank)?.map((s) => s.hf));
  if (problem !== undefined) throw new CheckpointError(problem);
  const slots = wholeModelSlots(model, lora.targets, lora.rank);
  return { adapter: a, matched: matchPeftAdapter(a, slots, known) };
}

/** The slots targets resolve to, or undefined when they name no module of this model. */
function wholeModelSlotsOrNone(model: Record<string, unknown>, targets: readonly string[], rank: number): AdapterSlot[] | undefined {
  try {
    return wholeModelSlots(model, targets, rank);
  } catch {
    return undefined;
  }
}

/**
 * `[lora] adapter = DIR`: checks the adapter against the run (checkPeftAdapter), then loads its
 * tensors into this rank's adapter placements, each rank the ranges it holds. Returns how many
 * adapter parameters this rank loaded.
 */
export function loadPeftAdapter(dir: string, placements: readonly ParamPlacement[], run: { model: Record<string, unknown>; lora: LoraSettings }): number {
  const { adapter, matched } = checkPeftAdapter(dir, run.model, run.lora);
  return loadPeftTensors(adapter, matched, placements);
}

/**
 * Attaches an adapter directory's adapters to a built (whole) model, unmerged: applyLora with its
 * r, lora_alpha, use_rslora on exactly the modules its file holds, after checking each is a Linear
 * of this model; then its tensors are loaded. The first mismatch with the model is one error.
 */
export function attachPeftAdapter(model: Module, spec: ModelSpec, cfg: Record<string, unknown>, dir: string): PeftAdapter {
  const a = readPeftAdapter(dir);
  const { names, modules: known } = hfModules(spec, cfg);
  // The model's Linears by Hugging Face module path, each expert of a stack too ([Note: PEFT names]),
  // with its sizes and the target that adapts it.
  const fits = new Map<string, { inFeatures: number; outFeatures: number; target: string }>();
  for (const [path, m] of model.namedModules()) {
    const hf = names.get(path);
    if (hf !== undefined && m instanceof Linear) fits.set(hf, { inFeatures: m.inFeatures, outFeatures: m.outFeatures, target: hf });
    if (!(m instanceof GroupedExperts)) continue;
    for (const n of expertProjectionNames(m)) {
      const stack = names.get(`${path}.${n}`);
      if (stack === undefined) continue;
      const [G, In, Out] = m[EXPERT_PROJECTIONS[n]!]!.shape as [number, number, number];
      for (const hfj of slotModules({ hf: stack, experts: G })) fits.set(hfj, { inFeatures: In, outFeatures: Out, target: stack });
    }
  }
  for (const hf of a.modules.keys()) {
    if (!fits.has(hf)) {
      throw new CheckpointError(`adapter ${a.dir} holds weights for module '${hf}', which this ${spec.hf!.architecture} ${known.has(hf) ? 'has, but not as a Linear' : 'does not have'}; the adapter was made for another base model`);
    }
  }
  // Each stored module must fit: a shape error names the tensor before applyLora would name the rank.
  for (const [hf, t] of a.modules) {
    const m = fits.get(hf)!;
    const A = t.A?.shape, B = t.B?.shape;
    if (A && (A.length !== 2 || A[0] !== a.rank || A[1] !== m.inFeatures)) {
      throw new CheckpointError(`adapter ${a.dir}: '${peftTensorName(hf, 'A')}' is [${A.join(', ')}], this model's is [${a.rank}, ${m.inFeatures}] (rank ${a.rank}, ${hf} is ${m.outFeatures} x ${m.inFeatures}); the adapter was made for another base model`);
    }
    if (B && (B.length !== 2 || B[0] !== m.outFeatures || B[1] !== a.rank)) {
      throw new CheckpointError(`adapter ${a.dir}: '${peftTensorName(hf, 'B')}' is [${B.join(', ')}], this model's is [${m.outFeatures}, ${a.rank}] (rank ${a.rank}, ${hf} is ${m.outFeatures} x ${m.inFeatures}); the adapter was made for another base model`);
    }
  }
  const targets = [...new Set([...a.modules.keys()].map((hf) => fits.get(hf)!.target))];
  applyLora(model, { rank: a.rank, alpha: a.alpha, dropout: a.dropout, rsLora: a.rsLora, targets, hfNames: names });
  const slots = adapterSlots(model, spec, cfg);
  const matched = matchPeftAdapter(a, slots, known);
  const adapterParams = model.namedParameters().filter(([n]) => matched.has(n));
  loadPeftTensors(a, matched, placementsOf(adapterParams));
  return a;
}
