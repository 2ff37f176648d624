// The architectures `[model] arch` accepts and their shape rules, without the models' code: the
// config's validation imports this, so a launcher checks a config before any rank starts without
// loading the tensor library. registry.ts completes each entry with its builders ([Note: model
// registry]); this map is the one list of architectures either reads.
import type { HfMap, ModelRules } from './spec.js';
import { gptRules } from './gpt_config.js';
import { llamaRules } from './llama_rules.js';
import { gpt2Hf } from './gpt_hf.js';
import { llamaFamilyHf } from './llama_family_hf.js';
import { mixtralHf } from './mixtral_hf.js';
import { qwen3MoeHf } from './qwen3_moe_hf.js';

/**
 * The built-in architectures by name, with their Hugging Face maps (a config resolves
 * `[train] initFrom = HF_DIR` with them); registry.ts gives each its spec (typed by this list).
 */
export const builtinRules = { gpt: { ...gptRules, hfMap: gpt2Hf }, llama: { ...llamaRules, hfMap: llamaFamilyHf, hfFamilyMaps: [mixtralHf, qwen3MoeHf] } } as const;
export type BuiltinArch = keyof typeof builtinRules;

/** Every known architecture: its rules, or its whole spec once registry.ts (or registerModel) gave it. */
const known = new Map<string, ModelRules>(Object.entries(builtinRules));

/** Makes an architecture known, or completes its rules with the whole spec (registry.ts). */
export function registerRules(r: ModelRules): void {
  known.set(r.arch, r);
}

/** The Hugging Face maps of the known architectures (a spec's hf, else its rules' hfMap). */
export function hfMaps(): { arch: string; map: HfMap }[] {
  const out: { arch: string; map: HfMap }[] = [];
  for (const [arch, r] of known) {
    const map = (r as { hf?: HfMap }).hf ?? r.hfMap;
    if (map) out.push({ arch, map });
    for (const f of (r as { hfFamilies?: readonly HfMap[] }).hfFamilies ?? r.hfFamilyMaps ?? []) out.push({ arch, map: f });
  }
  return out;
}

/** The architectures `[model] arch` accepts. */
export function modelArchs(): string[] {
  return [...known.keys()];
}

/** The rules of an architecture (its spec once the registry is loaded); an unknown name is an error listing the known ones. */
export function modelRules(arch: string): ModelRules {
  const r = known.get(arch);
  if (!r) throw new Error(unknownArch(arch));
  return r;
}

export function unknownArch(arch: string): string {
  return `model.arch = ${JSON.stringify(arch)} is not a known architecture; choose one of ${modelArchs().map((a) => JSON.stringify(a)).join(', ')}`;
}
