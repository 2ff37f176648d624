// One measurement of bench/attention.ts in a fresh process (so its peak resident memory is its own):
// attention alone, forward and backward, fused kernel or the eager ops of the GPT's attention.
// Prints 'BENCH <json>': the step times and VmRSS before the first step / VmHWM after the last.
//   node --import tsx bench/attention_run.ts '{"mode":"fused","T":2048,"B":1,"H":4,"D":32,"steps":5,"threads":2}'
import { manualSeed, ones, randn, setNumThreads, tidy, backward } from '../src/tensor/index.js';
import { fusedAttention } from '../src/nn/kernels/attention.js';
import { attentionScores } from '../src/nn/functional.js';
import { processMemory } from '../src/parallel/data_parallel/memory.js';

export interface RunOpts { mode: 'fused' | 'eager'; T: number; B: number; H: number; D: number; steps: number; threads: number }
export interface RunOut { stepMs: number[]; baseBytes: number; peakBytes: number }

const o = JSON.parse(process.argv[2]!) as RunOpts;
setNumThreads(o.threads);
manualSeed(0);
const shape = [o.B, o.H, o.T, o.D];
const [q, k, v, w] = [0, 1, 2, 3].map((i) => randn(shape, { requiresGrad: i < 3 }));
// The eager path's mask as the GPT keeps it (a (T, T) bool buffer), made before the base is read.
const allowed = o.mode === 'eager' ? ones([o.T, o.T], { dtype: 'bool' }).tril() : undefined;
const step = () => tidy(() => {
  const out = o.mode === 'fused'
    ? fusedAttention(q!, k!, v!)
    : attentionScores(q!, k!, allowed!, 1 / Math.sqrt(o.D)).softmax(-1).matmul(v!);
  backward([out.mul(w!).sum()]);
  for (const t of [q, k, v]) t!.grad?.dispose();
});
const baseBytes = processMemory()?.rssBytes ?? NaN;
const stepMs: number[] = [];
for (let s = 0; s < o.steps + 1; s++) {
  const t0 = performance.now();
  step();
  if (s > 0) stepMs.push(performance.now() - t0); // the first is a warm-up
}
const peakBytes = processMemory()?.peakBytes ?? NaN;
process.stdout.write(`BENCH ${JSON.stringify({ stepMs, baseBytes, peakBytes } satisfies RunOut)}\n`);
