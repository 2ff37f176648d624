// [Note: initFrom model] `[train] initFrom` names the model a run starts from, so the model's
// section comes from there rather than from the user: a Hugging Face directory's config.json through
// its architecture's map (HfMap.fromConfig, src/models/*_hf.ts), or a flotilla checkpoint's saved
// config. Every [model] field the user did not set (in the file or on the command line) takes the
// directory's value; one the user set must agree (compared resolved, so a derived 0 agrees with its
// value), else it is one error naming it. A Hugging Face directory's tokenizer comes with it when
// data.tokenizer is left at its default. This runs where the config is read, in the launcher too,
// before any rank starts, and loads no tensor library (the maps live in light files, src/models/rules.ts).
import { existsSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { hfMaps } from '../models/rules.js';
import type { HfMap } from '../models/spec.js';
import type { RawConfig } from './schema.js';

const HF_CONFIG = 'config.json';
const HF_TOKENIZER = 'tokenizer.json';
const CKPT_META = 'meta.json';

/** The model train.initFrom holds, as [model] (and, for a mixture of experts, [moe]) fields. */
export interface InitFromModel {
  /** What it is, for messages: `the Hugging Face directory D (LlamaForCausalLM)` or `the checkpoint D`. */
  what: string;
  /** Fields by section. */
  sections: Record<string, Record<string, unknown>>;
  /** The architecture's map (a Hugging Face directory): resolves derived fields for the comparison. */
  map?: HfMap;
  /** The directory's tokenizer.json (a Hugging Face directory that has one). */
  tokenizer?: string;
  /** Whether it is a Hugging Face directory. */
  hf: boolean;
}

function readJson(path: string): Record<string, unknown> {
  let v: unknown;
  try {
    v = JSON.parse(readFileSync(path, 'utf8'));
  } catch (e) {
    throw new Error(`${path} is not valid JSON (${(e as Error).message})`);
  }
  if (v === null || typeof v !== 'object' || Array.isArray(v)) throw new Error(`${path} does not hold a JSON object`);
  return v as Record<string, unknown>;
}

/** The model_types a map reads, with their transformers class. */
const typesOf = (m: HfMap): Readonly<Record<string, string>> => m.modelTypes ?? { [m.modelType]: m.architecture };

/** The architecture a config.json describes, by model_type (and architectures[0]). */
function mapOf(path: string, config: Record<string, unknown>): { arch: string; map: HfMap; architecture: string } {
  const maps = hfMaps();
  const type = config.model_type;
  const hit = maps.find((m) => typeof type === 'string' && Object.hasOwn(typesOf(m.map), type));
  const supported = maps.flatMap((m) => Object.entries(typesOf(m.map)).map(([t, a]) => `${a} (model_type "${t}")`)).join(', ');
  if (!hit) throw new Error(`${path}: model_type ${JSON.stringify(type)} is not supported; flotilla reads ${supported}`);
  const want = typesOf(hit.map)[type as string]!;
  const archs = config.architectures;
  if (archs !== undefined && (!Array.isArray(archs) || archs[0] !== want)) {
    throw new Error(`${path}: architectures = ${JSON.stringify(archs)} is not supported; for model_type "${String(type)}" flotilla reads ${want}`);
  }
  return { ...hit, architecture: want };
}

/**
 * The model of train.initFrom (an absolute path): a Hugging Face directory's, a checkpoint
 * directory's (its meta.json), or undefined (an exported .safetensors file, a missing path: the
 * ranks name those). Throws an Error whose message names the file and the problem.
 */
export function initFromModel(path: string): InitFromModel | undefined {
  if (!existsSync(path) || !statSync(path).isDirectory()) return undefined;
  const cfgPath = join(path, HF_CONFIG);
  if (existsSync(cfgPath)) {
    const config = readJson(cfgPath);
    const { arch, map, architecture } = mapOf(cfgPath, config);
    let determined: Record<string, unknown>;
    try {
      determined = map.fromConfig(config);
    } catch (e) {
      throw new Error(`${path}/${(e as Error).message}`);
    }
    const sections: Record<string, Record<string, unknown>> = { model: { arch } };
    for (const [k, v] of Object.entries(determined)) {
      // A nested table (e.g. moe) is that section's fields; dropout is the run's, not the model's.
      if (v !== null && typeof v === 'object' && !Array.isArray(v)) sections[k] = { ...(sections[k] ?? {}), ...(v as Record<string, unknown>) };
      else if (k !== 'dropout') sections.model![k] = v;
    }
    const tok = join(path, HF_TOKENIZER);
    return { what: `the Hugging Face directory ${path} (${architecture})`, sections, map, hf: true, ...(existsSync(tok) ? { tokenizer: path } : {}) };
  }
  const metaPath = join(path, CKPT_META);
  if (existsSync(metaPath)) {
    const meta = readJson(metaPath);
    const config = (meta.config ?? {}) as Record<string, Record<string, unknown> | undefined>;
    if (!config.model || typeof config.model !== 'object') return undefined;
    const { dropout: _, ...model } = config.model;
    // [moe] holds training settings too (the router's loss weights), which a fine-tune may change: the model only.
    return { what: `the checkpoint ${path}`, sections: { model }, hf: false };
  }
  return undefined;
}

/** A comparison of resolved configs; a config that does not resolve is not the same. */
function sameResolved(f: () => boolean): boolean {
  try {
    return f();
  } catch {
    return false;
  }
}

const show = (v: unknown): string => (typeof v === 'string' || Array.isArray(v) ? JSON.stringify(v) : String(v));

/**
 * Fills `cfg` (defaults with the user's layers applied) from train.initFrom's model ([Note:
 * initFrom model]); `set` holds the fields the user set (file and command line). Returns problems.
 */
export function applyInitFromModel(cfg: RawConfig, set: RawConfig, from: InitFromModel): string[] {
  const problems: string[] = [];
  const said = (section: string, k: string) => set[section]?.[k] !== undefined;
  const fix = (section: string, k: string) => `remove ${section}.${k} (the [${section}] section comes from train.initFrom)`;
  const model = from.sections.model ?? {};
  if (said('model', 'arch') && model.arch !== undefined && cfg.model!.arch !== model.arch) {
    return [`model.arch = ${show(cfg.model!.arch)} is set, and train.initFrom is ${from.what}, arch ${show(model.arch)}: ${fix('model', 'arch')}`];
  }
  // Derived fields (0 = from the others) compare by their resolved values.
  const resolve = (m: Record<string, unknown>): Record<string, unknown> => (from.map?.resolve?.(m) ?? m) as Record<string, unknown>;
  let theirsModel: Record<string, unknown>;
  try {
    theirsModel = resolve({ ...cfg.model, ...model });
  } catch {
    theirsModel = { ...cfg.model, ...model };
  }
  for (const [section, fields] of Object.entries(from.sections)) {
    const body = cfg[section];
    if (!body) continue;
    for (const [k, theirs] of Object.entries(fields)) {
      if (!(k in body)) continue; // a field this flotilla has no place for: the ranks' check names a difference
      const mine = body[k];
      // (List fields, e.g. moe.denseLayers, compare by their entries.)
      if (said(section, k) && (Array.isArray(mine) ? JSON.stringify(mine) !== JSON.stringify(theirs) : mine !== theirs)) {
        // model.vocabSize = 0 means "the vocabulary of what the model reads", here the directory's.
        const derived = section === 'model' && (k === 'vocabSize' && mine === 0 || sameResolved(() => resolve({ ...cfg.model, ...model, [k]: mine })[k] === theirsModel[k]));
        if (!derived) {
          problems.push(`${section}.${k} = ${show(mine)} is set, and train.initFrom is ${from.what}, whose model has ${section}.${k} = ${show(theirs)}: ${fix(section, k)}`);
          continue;
        }
      }
      body[k] = theirs;
    }
  }
  return problems;
}
