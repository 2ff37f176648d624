// A PEFT adapter's adapter_config.json, read and checked without the tensor library, so the config's
// checks can refuse a `[lora] adapter` that cannot continue the run before any rank starts (the
// tensors themselves are checked by src/checkpoint/peft.ts when they are read).
import { existsSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { CheckpointError, isObj, readJsonObject } from './format.js';

export const PEFT_CONFIG = 'adapter_config.json';
export const PEFT_WEIGHTS = 'adapter_model.safetensors';

/** The LoRA hyperparameters an adapter records (PEFT's r, lora_alpha, lora_dropout, use_rslora). */
export interface PeftLora {
  rank: number;
  alpha: number;
  dropout: number;
  rsLora: boolean;
}

/** What adapter_config.json says, checked. */
export interface PeftAdapterConfig extends PeftLora {
  /** adapter_config.json as written. */
  config: Record<string, unknown>;
  /** target_modules: module names, or ["all-linear"]. */
  targets: string[];
  /** base_model_name_or_path ("" when absent). */
  base: string;
}

const isEmpty = (v: unknown): boolean => v === undefined || v === null || (isObj(v) && Object.keys(v).length === 0) || (Array.isArray(v) && v.length === 0);

/**
 * Reads a PEFT adapter directory's adapter_config.json. What flotilla's adapters cannot be (another
 * PEFT method, trained biases, per-module ranks or alphas, extra trained modules, DoRA, a regular
 * expression of targets) is an error naming the field.
 */
export function readPeftConfig(path: string): PeftAdapterConfig {
  const dir = resolve(path);
  if (!existsSync(dir)) throw new CheckpointError(`adapter ${path} does not exist`);
  if (!statSync(dir).isDirectory()) throw new CheckpointError(`adapter ${path} is not a directory; a PEFT adapter is a directory holding ${PEFT_CONFIG} and ${PEFT_WEIGHTS}`);
  const cfgPath = join(dir, PEFT_CONFIG);
  if (!existsSync(cfgPath)) throw new CheckpointError(`${path} has no ${PEFT_CONFIG}: it is not a PEFT adapter directory`);
  const c = readJsonObject(cfgPath);
  const bad = (field: string, why: string): CheckpointError => new CheckpointError(`${cfgPath}: ${field} = ${JSON.stringify(c[field])} ${why}`);
  if (c.peft_type !== 'LORA') throw bad('peft_type', 'is not supported; flotilla reads LoRA adapters (peft_type "LORA")');
  if (c.task_type !== undefined && c.task_type !== null && c.task_type !== 'CAUSAL_LM') throw bad('task_type', 'is not supported; flotilla reads adapters of causal language models (task_type "CAUSAL_LM")');
  if ((c.bias ?? 'none') !== 'none') throw bad('bias', 'is not supported; flotilla\'s adapters train no biases (bias "none")');
  if (!isEmpty(c.rank_pattern)) throw bad('rank_pattern', 'is not supported; flotilla\'s adapters all have rank r (rank_pattern {})');
  if (!isEmpty(c.alpha_pattern)) throw bad('alpha_pattern', 'is not supported; flotilla\'s adapters all use lora_alpha (alpha_pattern {})');
  if (!isEmpty(c.modules_to_save)) throw bad('modules_to_save', 'is not supported; flotilla reads adapters that train LoRA matrices only (modules_to_save null)');
  if (!isEmpty(c.layers_to_transform)) throw bad('layers_to_transform', 'is not supported; name the adapted modules in target_modules instead');
  if (c.use_dora === true) throw bad('use_dora', 'is not supported; flotilla reads plain LoRA adapters (use_dora false)');
  const r = c.r;
  if (typeof r !== 'number' || !Number.isInteger(r) || r <= 0) throw bad('r', 'is not a positive whole number');
  const alpha = c.lora_alpha ?? 8; // PEFT's default
  if (typeof alpha !== 'number' || !(alpha > 0) || !Number.isFinite(alpha)) throw bad('lora_alpha', 'is not a positive number');
  const dropout = c.lora_dropout ?? 0;
  if (typeof dropout !== 'number' || !(dropout >= 0 && dropout < 1)) throw bad('lora_dropout', 'is not a number in [0, 1)');
  const rsLora = c.use_rslora ?? false;
  if (typeof rsLora !== 'boolean') throw bad('use_rslora', 'is not true or false');
  let targets: string[];
  if (c.target_modules === 'all-linear') targets = ['all-linear'];
  else if (typeof c.target_modules === 'string') throw bad('target_modules', 'is a regular expression, which flotilla does not read; list the module names (e.g. ["q_proj", "v_proj"])');
  else if (Array.isArray(c.target_modules) && c.target_modules.length > 0 && c.target_modules.every((t) => typeof t === 'string')) targets = c.target_modules as string[];
  else throw bad('target_modules', 'is not a list of module names');
  const base = typeof c.base_model_name_or_path === 'string' ? c.base_model_name_or_path : '';
  return { config: c, rank: r, alpha, dropout, rsLora, targets, base };
}

/** The [lora] fields an adapter must equal to continue a run. */
export interface LoraSettings {
  rank: number;
  alpha: number;
  rsLora: boolean;
  targets: readonly string[];
}

/**
 * Why an adapter cannot continue a run with these [lora] settings (undefined when it can): r,
 * lora_alpha, use_rslora, and (when `resolve` says which modules a targets list adapts) the modules
 * target_modules adapts. One message, naming the field that differs and the fix.
 */
export function peftSettingsProblem(dir: string, a: PeftAdapterConfig, lora: LoraSettings, resolve?: (targets: readonly string[]) => string[] | undefined): string | undefined {
  const where = `lora.adapter ${dir}`;
  if (a.rank !== lora.rank) return `${where} has rank r = ${a.rank}, and lora.rank = ${lora.rank}: set lora.rank = ${a.rank} to continue training it`;
  if (a.alpha !== lora.alpha) return `${where} has lora_alpha = ${a.alpha}, and lora.alpha = ${lora.alpha}: set lora.alpha = ${a.alpha} to continue training it`;
  if (a.rsLora !== lora.rsLora) return `${where} has use_rslora = ${a.rsLora}, and lora.rsLora = ${lora.rsLora}: set lora.rsLora = ${a.rsLora} to continue training it`;
  if (!resolve) return undefined;
  const mine = resolve(lora.targets), theirs = resolve(a.targets);
  if (mine === undefined) return undefined; // lora.targets' own problem is reported by itself
  const same = theirs !== undefined && theirs.length === mine.length && mine.every((m) => theirs.includes(m));
  if (same) return undefined;
  const names = [...new Set(mine.map((p) => p.slice(p.lastIndexOf('.') + 1)))].sort();
  return `${where} has target_modules = ${JSON.stringify(a.targets)}, and lora.targets = ${JSON.stringify(lora.targets)} adapts ${JSON.stringify(names)}: set lora.targets = ${JSON.stringify(a.targets)} to continue training it`;
}
