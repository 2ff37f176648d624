// What a pipeline needs from a model, and nothing else: how to build stage s of n, the loss the
// last stage applies, and which parameters several stages hold a copy of. Any model that can be
// cut into a sequence of modules fits (as torch.distributed.pipelining takes stage modules and a
// loss function); the GPT's split lives next to the GPT (src/models/gpt_parallel.ts).
//
// [Note: stage values] A stage's forward takes the previous stage's output spread as arguments
// (the first stage takes the micro-batch's `x`) and returns a tensor or an array of tensors, of any
// rank and dtype. Shapes and dtypes travel with the activations (executor.ts), so nothing about
// them is assumed. A floating-point output that requires grad gets its gradient sent back; other
// outputs (masks, ids) travel forward only.
//
// The values, micro-batches and criterion are the types every layout shares (parallel_model.ts).
import { Module } from '../../nn/module.js';
import type { Tensor } from '../../tensor/index.js';
import { asList, type Criterion, type LossFn, type StageValue } from '../parallel_model.js';

/** A parameter used by several stages, each holding its own copy (a tied input embedding and output head). */
export interface TiedParameter {
  /** The parameter's name in the whole model; every copy is reported (and saved) under it. */
  name: string;
  /** Each copy: the stage holding it and its name inside that stage's module. At least two. */
  copies: { stage: number; path: string }[];
}

export interface PipelineModel {
  /** Builds stage `index` of `numStages`; a rank builds only the stages it runs. */
  stage(index: number, numStages: number): Module;
  /** What the last stage applies: a LossFn (with `reduces`, summed over trained tokens) or a Criterion. */
  loss: LossFn | Criterion;
  /**
   * Parameters tied across stages for this number of stages. Their copies must start equal; after
   * each step every copy holds the sum of their gradients, and the norm counts the first copy only.
   */
  tied?(numStages: number): TiedParameter[];
}

/** Layers [first, end) of a sequence, registered under their global indices, called in order. */
export class LayerRange extends Module {
  readonly items: Module[];
  constructor(readonly first: number, layers: Module[]) {
    super();
    this.items = layers;
    layers.forEach((m, i) => this.registerModule(String(first + i), m));
  }

  /** Each layer gets the previous one's output spread as arguments ([Note: stage values]). */
  forward(...inputs: Tensor[]): StageValue {
    let v: Tensor[] = inputs;
    for (const l of this.items) v = asList((l as unknown as { call: (...a: Tensor[]) => StageValue }).call(...v));
    return v.length === 1 ? v[0]! : v;
  }
}

export interface SequentialOptions {
  /** How many layers the model has. */
  layers: number;
  /**
   * Builds layer i. Only a rank's own layers are built, so seed each layer's weights from i (e.g.
   * manualSeed(seed + i) first) for every split to start from the whole model's weights.
   */
  layer: (i: number) => Module;
  loss: LossFn | Criterion;
  /**
   * Where each stage after the first starts (numStages - 1 increasing layer indices), or a
   * function of numStages returning them. Default: an even split, earlier stages taking the rest.
   */
  splitPoints?: readonly number[] | ((numStages: number) => readonly number[]);
  tied?: (numStages: number) => TiedParameter[];
}

/**
 * A model that is a sequence of layers, cut at split points: stage s is the layers between its
 * split points in a LayerRange, so parameter names are those of the whole sequence ('3.fc.weight').
 */
export function sequentialStages(o: SequentialOptions): PipelineModel {
  const bounds = (n: number): number[] => {
    const pts = typeof o.splitPoints === 'function' ? o.splitPoints(n) : o.splitPoints ?? evenSplitPoints(o.layers, n);
    const b = [0, ...pts, o.layers];
    const ok = pts.length === n - 1 && b.every((x, i) => Number.isInteger(x) && (i === 0 || x > b[i - 1]!));
    if (!ok) {
      throw new Error(
        `pipeline: split points [${pts.join(', ')}] do not cut ${o.layers} layers into ${n} non-empty stages; ` +
          `give ${n - 1} increasing layer indices between 1 and ${o.layers - 1} (or fewer stages)`,
      );
    }
    return b;
  };
  return {
    stage(index, numStages) {
      const b = bounds(numStages);
      return new LayerRange(b[index]!, Array.from({ length: b[index + 1]! - b[index]! }, (_, k) => o.layer(b[index]! + k)));
    },
    loss: o.loss,
    ...(o.tied ? { tied: o.tied } : {}),
  };
}

/** numStages - 1 split points of an even split of layers (earlier stages take the remainder). */
export function evenSplitPoints(layers: number, numStages: number): number[] {
  if (layers < numStages) {
    throw new Error(`pipeline: ${numStages} stages need at least ${numStages} layers, the model has ${layers}; lower parallel.pp (or parallel.ppVirtualStages), or give the model more layers`);
  }
  const base = Math.floor(layers / numStages), extra = layers % numStages;
  const pts: number[] = [];
  let at = 0;
  for (let s = 0; s < numStages - 1; s++) pts.push((at += base + (s < extra ? 1 : 0)));
  return pts;
}
