// The start-of-run notice of a bf16-mixed run on a CPU without bfloat16 arithmetic (no AVX512-BF16
// or AMX: src/tensor/cpu_features.ts). There libtorch converts every bfloat16 operand to float32 and
// back, so bf16-mixed trains several times slower than float32 (the demo's 300 steps take minutes
// instead of seconds); the user hears it before waiting, with this machine's measured ratio of a
// bfloat16 GEMM's time to a float32 one's (the MFU's peak probes and their cache: peak_flops.ts).
import { bf16Support, type Bf16Support } from '../tensor/cpu_features.js';
import { peakTflops, type Peak } from './peak_flops.js';
import type { DType } from '../tensor/index.js';

/** The notice for a run of `precision` on this CPU, or undefined when there is nothing to say. */
export function bf16Notice(precision: string, support: Bf16Support = bf16Support(), peak: (dtype: DType) => Peak = (d) => peakTflops(0, d)): string | undefined {
  if (precision !== 'bf16-mixed' || support.native) return undefined;
  const ratio = peak('float32').tflops / peak('bfloat16').tflops;
  return `this CPU has no native bfloat16 arithmetic (no AVX512-BF16 or AMX): a bfloat16 GEMM takes ${ratio.toFixed(1)}x the time of a ` +
    `float32 one here (measured at this rank's threads), so bf16-mixed trains slower than float32; --train.precision=fp32 trains faster on this machine`;
}
