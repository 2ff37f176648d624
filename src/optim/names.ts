// The optimizers `[optim] name` accepts, without their code: the config's validation imports this,
// so a launcher checks a config without loading the tensor library. registry.ts completes each
// entry with what builds it ([Note: optimizer registry]); this map is the one list either reads.
import type { OptimizerSpec } from './spec.js';

/** The built-in optimizers by `[optim] name`; registry.ts gives each its spec (typed by this list). */
export const builtinOptimizers = ['adamw', 'sgd'] as const;
export type BuiltinOptimizer = (typeof builtinOptimizers)[number];

/** Every known name: its spec once registry.ts (or registerOptimizer) gave it. */
const known = new Map<string, OptimizerSpec | undefined>(builtinOptimizers.map((n) => [n, undefined]));

/** Makes an optimizer known, or completes a built-in name with its spec (registry.ts). */
export function registerOptimizerSpec(spec: OptimizerSpec): void {
  known.set(spec.name, spec);
}

/** The names `[optim] name` accepts. */
export function optimizerNames(): string[] {
  return [...known.keys()];
}

/** The spec of a known name (undefined before registry.ts is loaded); an unknown name is an error listing the known ones. */
export function knownOptimizer(name: string): OptimizerSpec | undefined {
  if (!known.has(name)) throw new Error(unknownOptimizer(name));
  return known.get(name);
}

export function unknownOptimizer(name: string): string {
  return `optim.name = ${JSON.stringify(name)} is not a known optimizer; choose one of ${optimizerNames().map((n) => JSON.stringify(n)).join(', ')}`;
}
