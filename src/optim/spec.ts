// What an optimizer registered by `[optim] name` is ([Note: optimizer registry] in registry.ts): types only,
// so names.ts (read by the config's validation) and registry.ts (which builds) share them without
// importing each other.
import type { Tensor } from '../tensor/index.js';
import type { Optimizer, OptimizerExtras } from './optimizer.js';

/** The [optim] settings a spec may read (fields of that section). */
export interface OptimizerSettings {
  lr: number;
  beta1: number;
  beta2: number;
  eps: number;
  weightDecay: number;
}

/** Parameters that share settings: the trainer decays matrices only. */
export interface OptimizerGroup {
  params: Tensor[];
  weightDecay: number;
}

export interface OptimizerSpec {
  /** The `[optim] name`. */
  readonly name: string;
  /** The optimizer's class name, recorded in checkpoints (a resume needs the same optimizer's state). */
  readonly label: string;
  /** The optimizer over these groups (non-empty), stepping the ranges `extras.grads` gives (ZeRO). */
  build(groups: OptimizerGroup[], s: OptimizerSettings, extras: OptimizerExtras): Optimizer<{ lr: number }>;
  /** Its words in the run's header, before the weight decay and the schedule (e.g. "AdamW betas (0.9, 0.95)"). */
  describe(s: OptimizerSettings): string;
}
