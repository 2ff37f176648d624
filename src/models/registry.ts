// [Note: model registry] The one place an architecture is looked up by `[model] arch`. A spec is a
// model plus what its layouts need (the whole-model builder, the pipeline split, ZeRO-3 units, the
// tensor-parallel plan, the criterion) and the shape rules a layout imposes on it, so the trainer,
// the config's validation and `flotilla generate` import no model class. A new architecture is one
// file holding its spec and one line in BUILT_IN; a user's own is registerModel(spec).
import type { ModelSpec } from './spec.js';
import { gptSpec } from './gpt_parallel.js';
import { llamaSpec } from './llama_parallel.js';

export type { ModelSpec, ShapeContext } from './spec.js';

const BUILT_IN: ModelSpec[] = [gptSpec, llamaSpec];

const specs = new Map<string, ModelSpec>(BUILT_IN.map((s) => [s.arch, s]));

/** Makes an architecture of one's own known to `[model] arch` (and to the config's choices). */
export function registerModel(spec: ModelSpec): void {
  if (specs.has(spec.arch) && specs.get(spec.arch) !== spec) throw new Error(`a model architecture "${spec.arch}" is already registered; choose another arch name`);
  specs.set(spec.arch, spec);
}

/** The architectures `[model] arch` accepts. */
export function modelArchs(): string[] {
  return [...specs.keys()];
}

/** The spec of an architecture; an unknown name is an error listing the known ones. */
export function modelSpec(arch: string): ModelSpec {
  const s = specs.get(arch);
  if (!s) throw new Error(`model.arch = ${JSON.stringify(arch)} is not a known architecture; choose one of ${modelArchs().map((a) => JSON.stringify(a)).join(', ')}`);
  return s;
}
