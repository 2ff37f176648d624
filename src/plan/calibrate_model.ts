// One process of the planner's compute calibration: builds the config's model at two depths and
// times its own forward and backward at each requested shape (samples x tokens, precision,
// activation checkpointing), with the intra-op threads a rank uses, and measures the resident
// bytes one forward and backward add (the process's high-water mark, reset before each: Linux's
// /proc/self/clear_refs). Bytes: the difference between the depths is one block, the rest is the
// embeddings and the head. Time: the blocks' forward is timed between their own forward hooks, and
// the backward is split between blocks and the rest as the forward is (differences of whole-model
// times drown in the noise of a shared machine). Also times AdamW's step and a gradient-norm pass
// per parameter, as the trainer runs them (flat buckets). Writes a line on stdout after each shape at
// each depth ([Note: measuring progress] in progress.ts).
//   node calibrate_model.js IN.json OUT.json
import { readFileSync, writeFileSync } from 'node:fs';
import { randint, releaseFreedMemory, setNumThreads, tidy } from '../tensor/index.js';
import { autocast } from '../nn/precision.js';
import { withActivationCheckpoint } from '../nn/checkpoint.js';
import { AdamW } from '../optim/index.js';
import { DataParallel } from '../parallel/data_parallel/data_parallel.js';
import { clippedStep } from '../optim/clipped_step.js';
import { initProcessGroup } from '../distributed/process_group.js';
import { modelSpec } from '../models/registry.js';
import { procStatusBytes } from '../io/proc_status.js';
import { modelConfigOf, type FlotillaConfig } from '../config/schema.js';
import { median } from './stats.js';
import { PROGRESS_TAG } from './progress.js';

export interface CalibrationPoint {
  samples: number;
  tokens: number;
  precision: 'fp32' | 'bf16-mixed';
  activationCheckpoint: 'none' | 'full' | 'selective';
}
export interface DepthTiming {
  fwdMs: number;
  bwdMs: number;
  actBytes: number;
  /** The blocks' own forward time (between each block's forward hooks), summed. */
  blocksFwdMs: number;
}
export interface ModelCalibrationIn { cfg: FlotillaConfig; depths: [number, number]; points: CalibrationPoint[]; reps: number }
export interface ModelCalibrationOut {
  points: (CalibrationPoint & { depth: [DepthTiming, DepthTiming] })[];
  /** Per parameter: AdamW's step, and the norm and clip pass over the gradients (ns). */
  optimizerNsPerParam: number;
}

function status(field: string): number {
  return procStatusBytes()?.[field] ?? NaN;
}
function resetPeak(): boolean {
  try {
    writeFileSync('/proc/self/clear_refs', '5');
    return true;
  } catch {
    return false;
  }
}

const [inPath, outPath] = process.argv.slice(2);
const input = JSON.parse(readFileSync(inPath!, 'utf8')) as ModelCalibrationIn;
const cfg = input.cfg;
const world = initProcessGroup(); // a world of one: the optimizer's flat buckets below
setNumThreads(cfg.train.threads);
const spec = modelSpec(cfg.model.arch);
const out: ModelCalibrationOut = { points: input.points.map((p) => ({ ...p, depth: [] as unknown as [DepthTiming, DepthTiming] })), optimizerNsPerParam: 0 };
for (const [d, depth] of input.depths.entries()) {
  // A shallower model of the same blocks: block indices past its depth dropped (the window starts
  // at most at its end; the blocks moe.every gives experts keep them, dense ones listed or not).
  const shallow = { ...cfg, model: { ...cfg.model, nLayer: depth, windowFrom: Math.min(cfg.model.windowFrom, depth) }, moe: { ...cfg.moe, denseLayers: [] } };
  const model = spec.build(modelConfigOf(shallow), { initSeed: cfg.train.seed });
  model.train();
  const params = model.parameters();
  const call = (model as unknown as { call: (x: unknown) => unknown });
  // The blocks (modules named by an index: `h.3`, `layers.3`), timed between their forward hooks.
  let blocksFwdMs = 0, started = 0;
  for (const [name, m] of model.namedModules()) {
    if (!/(?:^|\.)\d+$/.test(name) || /\.\d+\./.test(`.${name}`)) continue;
    m.registerForwardPreHook(() => { started = performance.now(); });
    m.registerForwardHook(() => { blocksFwdMs += performance.now() - started; });
  }
  for (const [i, p] of input.points.entries()) {
    const run = (measureMemory: boolean): DepthTiming => tidy(() => {
      const x = randint(0, cfg.model.vocabSize, [p.samples, p.tokens]);
      const y = randint(0, cfg.model.vocabSize, [p.samples, p.tokens]);
      // Timing runs keep the allocator's freed blocks, as the trainer's steady state does; the memory
      // run starts from a trimmed heap so that what the step adds is resident anew.
      if (measureMemory) releaseFreedMemory();
      const base = status('VmRSS');
      const peakOk = measureMemory && resetPeak();
      let fwdMs = 0, bwdMs = 0;
      blocksFwdMs = 0;
      autocast(p.precision, () => withActivationCheckpoint(p.activationCheckpoint, () => {
        const t0 = performance.now();
        const loss = spec.loss(call.call(x) as never, y as never);
        const t1 = performance.now();
        loss.backward();
        fwdMs = t1 - t0;
        bwdMs = performance.now() - t1;
      }));
      return { fwdMs, bwdMs, actBytes: peakOk ? Math.max(0, status('VmHWM') - base) : NaN, blocksFwdMs };
    });
    run(false); // warm-up: gradients allocated, kernels and allocator ready
    const reps = Array.from({ length: input.reps }, () => run(false));
    const mem = run(true);
    out.points[i]!.depth[d] = { fwdMs: median(reps.map((r) => r.fwdMs)), bwdMs: median(reps.map((r) => r.bwdMs)), actBytes: mem.actBytes, blocksFwdMs: median(reps.map((r) => r.blocksFwdMs)) };
    process.stdout.write(`${PROGRESS_TAG}${JSON.stringify({ depth: d, point: i })}\n`); // [Note: measuring progress]
  }
  if (d === 1) {
    // The optimizer pass as the trainer runs it: the gradient-norm clip and AdamW over the flat
    // gradient buckets of data parallelism on one rank. Per-parameter AdamW and norms pay a fixed
    // cost per tensor the trainer does not: the demo model measured 11.5 ns per parameter that way
    // and 5.2 through the buckets (the 25M GPT, with fewer and larger tensors, 2.8 and 3.4).
    const dp = new DataParallel(model, { group: world });
    const opt = new AdamW(model.parameters(), { lr: 1e-4 }, { grads: dp });
    const n = params.reduce((a, p) => a + p.numel(), 0);
    const times: number[] = [];
    const T = input.points[0]!.tokens;
    for (let k = 0; k < 1 + input.reps; k++) {
      tidy(() => { // untimed: gradients in the buckets, as the step finds them
        opt.zeroGrad();
        spec.loss((dp as unknown as { forward: (x: unknown) => unknown }).forward(randint(0, cfg.model.vocabSize, [1, T])) as never, randint(0, cfg.model.vocabSize, [1, T]) as never).backward();
        dp.finishGradSync();
      });
      const t0 = performance.now();
      tidy(() => clippedStep(dp, opt, 1));
      if (k > 0) times.push(performance.now() - t0);
    }
    out.optimizerNsPerParam = (median(times) * 1e6) / n;
    opt.dispose();
    dp.dispose();
  }
}
writeFileSync(outPath!, JSON.stringify(out));
