// [Note: model registry] The one place an architecture is looked up by `[model] arch`. A spec is a
// model plus what its layouts need (the whole-model builder, the pipeline split, ZeRO-3 units, the
// tensor-parallel plan, the criterion) and the shape rules a layout imposes on it, so the trainer,
// the config's validation and `flotilla generate` import no model class. The rules (ModelRules)
// live apart, in files without tensor code (gpt_config.ts, llama_config.ts, listed in rules.ts),
// so validating a config loads no model. A new architecture is a config file with its rules, a
// file holding its spec, and one line in each list; a user's own is registerModel(spec).
import type { ModelSpec } from './spec.js';
import { gptSpec } from './gpt_parallel.js';
import { llamaSpec } from './llama_parallel.js';
import { modelArchs, registerRules, unknownArch } from './rules.js';

export type { ModelRules, ModelSpec, ShapeContext } from './spec.js';
export { modelArchs } from './rules.js';

const specs = new Map<string, ModelSpec>([gptSpec, llamaSpec].map((s) => [s.arch, s]));

/** Makes an architecture of one's own known to `[model] arch` (and to the config's choices). */
export function registerModel(spec: ModelSpec): void {
  if (modelArchs().includes(spec.arch) && specs.get(spec.arch) !== spec) throw new Error(`a model architecture "${spec.arch}" is already registered; choose another arch name`);
  specs.set(spec.arch, spec);
  registerRules(spec);
}

/** The spec of an architecture; an unknown name is an error listing the known ones. */
export function modelSpec(arch: string): ModelSpec {
  const s = specs.get(arch);
  if (!s) throw new Error(unknownArch(arch));
  return s;
}
