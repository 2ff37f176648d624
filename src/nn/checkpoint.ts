// Activation checkpointing: a region of a transformer block (the whole block for "full", the
// attention core for "selective") runs without keeping its activations and runs again in backward
// to get them (torch.utils.checkpoint, non-reentrant in effect: one outer backward; the recompute's
// own backward is an autograd.grad inside the node's backward).
//
// [Note: activation checkpoint]
// - Built on defineFunction (src/tensor/function.ts, a native node): the node's inputs are the
//   region's inputs and the parameters it uses, so parameter gradients come out of it and are
//   accumulated by the outer backward into the float32 .grad views: data-parallel readiness hooks
//   fire as without checkpointing, and nothing reduces a gradient from inside the nested pass.
// - Forward keeps only the inputs (aliases, no copy). The node is built inside the block's call(),
//   so parallel wrappers' hooks surround it: ZeRO-3 has the parameters gathered while the node
//   takes its parameter inputs, and its backward pre-hook on the block's output regathers them
//   before the node's backward recomputes the block (one gather for recompute and backward).
// - The most recent region keeps its graph ([Note: last region]).
// - Dropout replays the same mask: when the region is training with dropout, forward draws a seed
//   from the generator and reseeds before the region and before its recompute; the recompute
//   restores the generator's state afterwards (PyTorch's preserve_rng_state).
// - In float32 the recompute repeats the same kernels on the same values, so gradients are
//   bit-identical to running without checkpointing, for "full" and "selective" alike
//   (test/checkpointing_activation.test.ts).
//
// [Note: last region] A region's recompute would run right after the forward when backward starts
// with it: the last block of a stage, whose activations are still the newest ones when backward
// begins. So each region runs forward with recording on and keeps its graph until the next region
// starts its forward (then that graph is freed, and its backward recomputes); a graph still held
// when its backward comes is used as it is. Peak memory is unchanged (one region's activations at a
// time, the recompute's own peak), and one recompute per backward pass is saved: the last of every
// run of regions (a pipeline stage with 1F1B, or one micro-batch's model).
//
// [Note: selective checkpointing] "selective" recomputes the attention core only, as Megatron's
// selective recompute does: from the qkv projection's output to the heads' output (q k^T, scale,
// mask, softmax, dropout, att v). Its (B, nh, T, T) tensors are the big activations at these
// sizes and cost few FLOPs to redo; the Linears, LayerNorms and GELU keep their activations and
// run through autograd as without checkpointing.
import { type Tensor, defineFunction, grad, keep, manualSeed, randint } from '../tensor/index.js';
import { native } from '../tensor/native.js';
import type { Module } from './module.js';
import { ambientChoice } from './ambient_choice.js';
import type { PlanAxis } from '../distributed/plan_terms.js';

export type ActivationCheckpoint = 'none' | 'full' | 'selective';
export const ACTIVATION_CHECKPOINTS: readonly ActivationCheckpoint[] = ['none', 'full', 'selective'];

const mode = ambientChoice('activationCheckpoint', ACTIVATION_CHECKPOINTS, 'none');

/** Runs fn with activation checkpointing of transformer blocks set to mode (the trainer opens it per step). */
export function withActivationCheckpoint<T>(m: ActivationCheckpoint, fn: () => T): T {
  return mode.with(m, fn);
}

export function activationCheckpointMode(): ActivationCheckpoint {
  return mode.current();
}

let inRegion = 0;
/**
 * True while a checkpointed region's forward runs: its modules' outputs get their gradients from
 * the region's node (the zero-bubble pipeline captures no Linear there).
 */
export function insideCheckpointedRegion(): boolean {
  return inRegion > 0;
}

let recomputing = 0;
/**
 * True while a region's forward runs again in backward: what a forward records about itself (an
 * MoE block's token counts) is not recorded twice.
 */
export function isRecomputing(): boolean {
  return recomputing > 0;
}

/** A graph kept by the newest region ([Note: last region]). */
interface Live {
  inputs: Tensor[]; // the detached inputs the graph starts from
  out: Tensor;
}
let newest: { live?: Live } | undefined;

function dropNewest(): void {
  const l = newest?.live;
  if (l) {
    for (const t of [l.out, ...l.inputs]) t.dispose();
    newest!.live = undefined;
  }
  newest = undefined;
}

type Body = (...xs: Tensor[]) => Tensor;
interface RegionArgs {
  body: Body;
  /** The parameters body uses, read again for the recompute (ZeRO-3 has regathered them). */
  params: () => Tensor[];
  nIn: number;
  seed?: number;
}

/** Runs body with recording on from detached copies of xs; returns them and the output. */
function record(body: Body, xs: Tensor[], needs: boolean[], seed: number | undefined): Live {
  const inputs = xs.map((x, i) => x.detach().requiresGrad_(needs[i] ?? false));
  if (seed !== undefined) manualSeed(seed);
  const prev = native.setGradEnabled(true);
  inRegion++;
  try {
    return { inputs, out: body(...inputs) };
  } finally {
    inRegion--;
    native.setGradEnabled(prev);
  }
}

const region = defineFunction<[RegionArgs, ...Tensor[]]>({
  forward(ctx, a, ...ts) {
    const xs = ts.slice(0, a.nIn);
    if (a.seed !== undefined) manualSeed(a.seed);
    if (!ctx.needsInputGrad.some(Boolean)) return a.body(...xs); // nothing to differentiate: no node
    dropNewest(); // the previous region's backward will recompute
    ctx.state.args = a;
    ctx.saveForBackward(...xs);
    const live = record(a.body, xs, ctx.needsInputGrad.slice(1, 1 + a.nIn), a.seed);
    const state = { live: { inputs: live.inputs.map((t) => keep(t)), out: keep(live.out) } };
    ctx.state.region = state;
    newest = state;
    return live.out.detach();
  },
  backward(ctx, g) {
    const a = ctx.state.args as RegionArgs;
    const state = ctx.state.region as { live?: Live };
    const needs = ctx.needsInputGrad.slice(1);
    let live = state.live;
    state.live = undefined;
    if (newest === state) newest = undefined;
    if (!live) {
      // The recompute reseeds for its dropout masks and then puts the generator back, so the random
      // stream after a backward does not depend on which regions recomputed.
      const rng = a.seed !== undefined ? native.rngState() : undefined;
      recomputing++;
      try {
        live = record(a.body, ctx.savedTensors.slice(0, a.nIn) as Tensor[], needs, a.seed);
      } finally {
        recomputing--;
        if (rng !== undefined) {
          native.setRngState(rng);
          native.release(rng);
        }
      }
    }
    try {
      const params = a.params();
      const wrt = [...live.inputs, ...params].filter((_, i) => needs[i]);
      const gs = grad([live.out], wrt, { gradOutputs: [g], allowUnused: true });
      let k = 0;
      return [undefined, ...needs.map((n) => (n ? gs[k++] : undefined))];
    } finally {
      for (const t of [live.out, ...live.inputs]) t.dispose();
    }
  },
}, 'ActivationCheckpoint');

/**
 * body(...xs) with its activations recomputed in backward ([Note: activation checkpoint]), called
 * from inside the owning module's call(). params() lists every parameter body uses; dropout says
 * whether body draws random numbers (a seed is then replayed).
 */
export function checkpointRegion(owner: Module, xs: Tensor[], body: Body, params: () => Tensor[], opts: { dropout?: boolean } = {}): Tensor {
  // A seed only when dropout draws: otherwise the generator's stream is left as without checkpointing.
  const seed = opts.dropout && owner.training ? randint(0, 2 ** 31 - 1, [1]).item() : undefined;
  const a: RegionArgs = { body, params, nIn: xs.length, ...(seed !== undefined ? { seed } : {}) };
  return region(a, ...xs, ...params()) as Tensor;
}

/** A block's forward checkpointed as a whole ("full"): its input and all of its parameters are the node's inputs. */
export function checkpointBlock(block: Module, x: Tensor, body: (x: Tensor) => Tensor, opts: { dropout?: boolean } = {}): Tensor {
  return checkpointRegion(block, [x], body, () => block.parameters(), opts);
}

/**
 * Activation checkpointing, for the planner ([Note: plan terms] in src/distributed/plan_terms.ts):
 * it holds no state and sends nothing; what it saves in activations and costs in recomputation is
 * measured by running the model's forward and backward under the mode (the planner's calibration),
 * per block.
 */
export const activationCheckpointPlanAxis = {
  name: 'activation checkpointing',
  fields: ['activationCheckpoint'] as const,
  apply(b, ctx) {
    if (ctx.layout.activationCheckpoint !== 'none') b.notes.push(`activations kept under activationCheckpoint = "${ctx.layout.activationCheckpoint}" (measured)`);
  },
} satisfies PlanAxis;
