// What the step benchmarks (bench/step.ts, bench/llama.ts, bench/step_rss.ts, bench/speeds.ts) share
// besides bench/report.ts: the kernels and precisions they measure, and the share of the machine's
// GEMM rate a step reaches. Loads the addon (report.ts does not, for the benchmarks that only spawn ranks).
import { cpus } from 'node:os';
import { bf16Support, tidy, type DType, type Tensor } from '../src/tensor/index.js';
import type { Module } from '../src/nn/module.js';
import { autocast, type Precision } from '../src/nn/precision.js';
import { withKernels } from '../src/nn/kernels/choice.js';
import { llamaCriterion } from '../src/models/llama_parallel.js';
import { AdamW, type AdamWOptions } from '../src/optim/index.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { initProcessGroup } from '../src/distributed/process_group.js';
import { KERNEL_CHOICES, type KernelChoice } from '../src/nn/kernels/choice.js';
import { modelFlops } from '../src/train/flops.js';
import { probePeakTflops } from '../src/train/peak_flops.js';
import { parseConfig } from '../src/config/index.js';

/** The kernels a step benchmark measures (`--kernels fused|eager|both`): [Note: kernel choice] in src/nn/kernels/choice.ts. */
export function kernelsArg(v: string | undefined): KernelChoice[] {
  if (v === undefined || v === 'both') return ['fused', 'eager'];
  if ((KERNEL_CHOICES as readonly string[]).includes(v)) return [v as KernelChoice];
  throw new Error(`--kernels must be fused, eager or both, not ${v}`);
}

/**
 * Whether a step benchmark measures bf16-mixed besides float32: only on a CPU with native bfloat16
 * arithmetic (AVX512-BF16 or AMX; src/tensor/cpu_features.ts), where it is the precision one would
 * train in; elsewhere a bf16 step measures conversions more than the step. `force` measures it anyway.
 */
export function bf16Plan(force: boolean): { measure: boolean; note: string } {
  const cpu = cpus()[0]?.model.trim() ?? 'this CPU';
  if (bf16Support().native) return { measure: true, note: `bf16-mixed measured too: ${cpu} has native bfloat16 arithmetic` };
  return force
    ? { measure: true, note: `bf16-mixed measured on request (--bf16), although ${cpu} has no native bfloat16 arithmetic (its bf16 GEMMs are emulated)` }
    : { measure: false, note: `float32 only: ${cpu} has no native bfloat16 arithmetic (no AVX512-BF16 or AMX), where a bf16 step measures conversions more than the step (--bf16 measures it anyway)` };
}

/**
 * The model FLOPs of one training step of `tokens` tokens of the model that `overrides` (--model.* and
 * --data.seqLen) describe: 3 x the forward's FLOPs per token (the count is 6 N + 12 x layers x seqLen x
 * width per token, forward and backward, causal masking not halved: [Note: model flops] in
 * src/train/flops.ts) x tokens.
 */
export function stepFlops(overrides: string[], tokens: number): number {
  const count = modelFlops(parseConfig('', overrides));
  if (!count) throw new Error(`no FLOP count for the model of ${overrides.join(' ')}`);
  return count.perToken * tokens;
}

/**
 * The machine's GEMM rate at `dtype` and this process's threads, TFLOP/s: src/train/peak_flops.ts's
 * probe (torch.matmul of 768 x 768), run here and now rather than read from its cache, the best of
 * `probes` runs as the machine's speed drifts.
 */
export function gemmRate(dtype: DType, probes = 2): number {
  let best = 0;
  for (let i = 0; i < probes; i++) best = Math.max(best, probePeakTflops(dtype));
  return best;
}

/** The share of the GEMM rate (TFLOP/s) that a step of `flops` FLOPs taking `seconds` reaches, in percent. */
export function gemmShare(flops: number, seconds: number, tflops: number): number {
  return (100 * flops) / seconds / (tflops * 1e12);
}

/** The sentence a benchmark's section gives its GEMM-rate column. */
export const GEMM_SHARE_NOTE = 'GEMM share: the step\'s model FLOPs (3 x the forward\'s per token x tokens, i.e. 6 N + 12 x layers x ' +
  'seqLen x width per token, causal masking not halved: [Note: model flops] in src/train/flops.ts) over the step\'s median time, against ' +
  'torch.matmul\'s rate (768 x 768 GEMMs, src/train/peak_flops.ts\'s probe) at the same precision and threads, measured in the same process during this run (goal >= 75%).';

/**
 * The single-process path of `flotilla train` over a GPT or a Llama: flat buckets, AdamW over the
 * parameters that train (the trainer's trainedParameters: all of them, or LoRA's adapters alone), and
 * one training step under a precision and kernels, chosen around forward + backward and around the
 * optimizer's step as src/train/trainer.ts does. A step yields to the event loop first, as the trainer
 * does between steps, and returns its wall and CPU seconds (the clock runs until tidy() has freed the
 * step's temporaries: PyTorch frees them inside its step).
 */
export function singleProcessTrainer(model: Module & { forward(idx: Tensor): { logits: Tensor } }, idx: Tensor, targets: Tensor, adamw: AdamWOptions): { step: (precision: Precision, kernels: KernelChoice) => Promise<[number, number]>; dispose: () => void } {
  const dp = new DataParallel<Module & { forward(idx: Tensor): { logits: Tensor } }>(model, { group: initProcessGroup() });
  const opt = new AdamW(model.parameters().filter((p) => p.requiresGrad), adamw, { grads: dp });
  return {
    async step(precision, kernels) {
      await new Promise((r) => setImmediate(r));
      const c0 = process.cpuUsage();
      const t0 = performance.now();
      tidy(() => {
        opt.zeroGrad();
        autocast(precision, () => withKernels(kernels, () => {
          // GPT.forward(idx) and Llama.forward(idx) both return { logits }: the criterion takes either ([Note: deferred head]).
          const loss = llamaCriterion(dp.forward(idx), targets);
          loss.backward();
          dp.finishGradSync();
          loss.item();
        }));
        withKernels(kernels, () => opt.step());
      });
      const c = process.cpuUsage(c0);
      return [(performance.now() - t0) / 1e3, (c.user + c.system) / 1e6];
    },
    dispose() {
      opt.dispose();
      dp.dispose();
    },
  };
}
