// The architectures `[model] arch` accepts and their shape rules, without the models' code: the
// config's validation imports this, so a launcher checks a config before any rank starts without
// loading the tensor library. registry.ts adds the builders ([Note: model registry]).
import type { ModelRules } from './spec.js';
import { gptRules } from './gpt_config.js';
import { llamaRules } from './llama_config.js';

const rules = new Map<string, ModelRules>([gptRules, llamaRules].map((r) => [r.arch, r]));

/** Makes an architecture's rules known (registerModel calls it with the whole spec). */
export function registerRules(r: ModelRules): void {
  rules.set(r.arch, r);
}

/** The architectures `[model] arch` accepts. */
export function modelArchs(): string[] {
  return [...rules.keys()];
}

/** The rules of an architecture; an unknown name is an error listing the known ones. */
export function modelRules(arch: string): ModelRules {
  const r = rules.get(arch);
  if (!r) throw new Error(unknownArch(arch));
  return r;
}

export function unknownArch(arch: string): string {
  return `model.arch = ${JSON.stringify(arch)} is not a known architecture; choose one of ${modelArchs().map((a) => JSON.stringify(a)).join(', ')}`;
}
