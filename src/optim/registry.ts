// [Note: optimizer registry] The one place an optimizer is looked up by `[optim] name`, as the model
// is by `[model] arch` ([Note: model registry]): the trainer asks here and imports no optimizer
// class. A spec builds its optimizer over groups of parameters (the trainer's weight-decay split)
// from the [optim] settings it reads. The one map of names is names.ts's, without tensor code, so
// validating a config loads no optimizer; this file completes each built-in name there with its
// spec. A new optimizer is its class, one name in builtinOptimizers (names.ts) and one entry in
// builtinSpecs below (which the type requires); a user's own is registerOptimizer(spec).
import { AdamW } from './adamw.js';
import { SGD } from './sgd.js';
import type { OptimizerGroup, OptimizerSettings, OptimizerSpec } from './spec.js';
import { knownOptimizer, optimizerNames, registerOptimizerSpec, type BuiltinOptimizer } from './names.js';

export type { OptimizerGroup, OptimizerSettings, OptimizerSpec } from './spec.js';

const groupsOf = (groups: OptimizerGroup[]) => groups.map((g) => ({ params: g.params, options: { weightDecay: g.weightDecay } }));

const builtinSpecs: { readonly [N in BuiltinOptimizer]: OptimizerSpec } = {
  adamw: {
    name: 'adamw', label: 'AdamW',
    build: (groups, s, extras) => new AdamW(groupsOf(groups), { lr: s.lr, betas: [s.beta1, s.beta2], eps: s.eps, weightDecay: s.weightDecay }, extras),
    describe: (s) => `AdamW betas (${s.beta1}, ${s.beta2})`,
  },
  sgd: {
    name: 'sgd', label: 'SGD',
    // Plain SGD: weight decay enters the gradient (L2, as torch.optim.SGD); the betas and eps are AdamW's.
    build: (groups, s, extras) => new SGD(groupsOf(groups), { lr: s.lr, weightDecay: s.weightDecay }, extras),
    describe: () => 'SGD',
  },
};
for (const s of Object.values(builtinSpecs)) registerOptimizerSpec(s);

/** Makes an optimizer of one's own known to `[optim] name`. */
export function registerOptimizer(spec: OptimizerSpec): void {
  if (optimizerNames().includes(spec.name) && knownOptimizer(spec.name) !== spec) throw new Error(`an optimizer "${spec.name}" is already registered; choose another name`);
  registerOptimizerSpec(spec);
}

/** The spec of an optimizer; an unknown name is an error listing the known ones. */
export function optimizerSpec(name: string): OptimizerSpec {
  const s = knownOptimizer(name);
  if (!s) throw new Error(`internal: optim.name = ${JSON.stringify(name)} has no spec (src/optim/registry.ts, builtinSpecs)`);
  return s;
}
