// [Note: model registry] The one place an architecture is looked up by `[model] arch`. A spec is a
// model plus what its layouts need (the whole-model builder, the pipeline split, ZeRO-3 units, the
// tensor-parallel plan, the criterion) and the shape rules a layout imposes on it, so the trainer,
// the config's validation and `flotilla generate` import no model class. The rules (ModelRules)
// live apart, in files without tensor code (gpt_config.ts, llama_rules.ts), and the one map of
// architectures is rules.ts's, so validating a config loads no model; this file completes each
// built-in entry there with its spec. A new architecture is a config file with its rules (one line
// in rules.ts's builtinRules), a file holding its spec (one line in builtinSpecs below, which the
// type requires); a user's own is registerModel(spec). Its Hugging Face map (*_hf.ts, an HfMap)
// imports no model class either (the spec adds configOf), so a config resolves `[train] initFrom =
// HF_DIR` into [model] before any rank starts (rules.ts's builtinRules lists it).
import type { ModelRules, ModelSpec } from './spec.js';
import { gptSpec } from './gpt_parallel.js';
import { llamaSpec } from './llama_parallel.js';
import { modelArchs, modelRules, registerRules, type BuiltinArch } from './rules.js';

export type { ModelRules, ModelSpec, ShapeContext } from './spec.js';
export { modelArchs } from './rules.js';

const builtinSpecs: { readonly [A in BuiltinArch]: ModelSpec } = { gpt: gptSpec, llama: llamaSpec };
for (const s of Object.values(builtinSpecs)) registerRules(s);

const isSpec = (r: ModelRules): r is ModelSpec => 'build' in r;

/** Makes an architecture of one's own known to `[model] arch` (and to the config's choices). */
export function registerModel(spec: ModelSpec): void {
  if (modelArchs().includes(spec.arch) && modelRules(spec.arch) !== spec) throw new Error(`a model architecture "${spec.arch}" is already registered; choose another arch name`);
  registerRules(spec);
}

/** The spec of an architecture; an unknown name is an error listing the known ones. */
export function modelSpec(arch: string): ModelSpec {
  const s = modelRules(arch);
  if (!isSpec(s)) throw new Error(`internal: model.arch = ${JSON.stringify(arch)} has shape rules but no spec (src/models/registry.ts, builtinSpecs)`);
  return s;
}
