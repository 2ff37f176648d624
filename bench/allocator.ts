// The tensor cache against malloc's tuned heap ([Note: allocator tuning]), in one process so both see
// the same machine: the same GPT steps alternate in rounds with the cache on and off (off is the
// `tuned` mode: libtorch's own malloc with flotilla's thresholds). Numbers are medians of the timed steps;
// page faults per step come from getrusage.
//
//   node --import tsx bench/allocator.ts [--width 256] [--layers 4] [--steps 3] [--rounds 6]
import { parseArgs } from 'node:util';
import os from 'node:os';
import { randint, manualSeed, releaseIdleMemory, setNumThreads, tidy } from '../src/tensor/index.js';
import { native, tensorCacheStats } from '../src/tensor/native.js';
import { TENSOR_CACHE } from '../src/tensor/allocator.js';
import { GPT } from '../src/models/gpt.js';
import { AdamW } from '../src/optim/index.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { initProcessGroup } from '../src/distributed/process_group.js';
import { autocast, type Precision } from '../src/nn/precision.js';
import { withActivationCheckpoint, type ActivationCheckpoint } from '../src/nn/checkpoint.js';
import { median } from './report.js';

const { values: a } = parseArgs({ options: { width: { type: 'string', default: '256' }, layers: { type: 'string', default: '4' }, steps: { type: 'string', default: '3' }, rounds: { type: 'string', default: '6' } } });
if (!tensorCacheStats().on) throw new Error('run without FLOTILLA_MALLOC, MALLOC_*_ or glibc.malloc tunables: the cache must be on to compare');
setNumThreads(1);
manualSeed(0);
const model = new GPT({ vocabSize: 256, blockSize: 128, nLayer: Number(a.layers), nHead: 8, nEmbd: Number(a.width), dropout: 0, bias: true, tieEmbeddings: false });
const idx = randint(0, 256, [8, 128]);
const dp = new DataParallel(model, { group: initProcessGroup() });
const opt = new AdamW(model.parameters(), { lr: 3e-4 }, { grads: dp });

function step(precision: Precision, ac: ActivationCheckpoint): { ms: number; faults: number } {
  const f0 = process.resourceUsage().minorPageFault;
  const t0 = performance.now();
  tidy(() => {
    opt.zeroGrad();
    autocast(precision, () => withActivationCheckpoint(ac, () => {
      const { loss } = dp.forward(idx, idx);
      loss!.backward();
      dp.finishGradSync();
    }));
    opt.step();
  });
  releaseIdleMemory(); // as the trainer does after every step
  return { ms: performance.now() - t0, faults: process.resourceUsage().minorPageFault - f0 };
}

const modes: [Precision, ActivationCheckpoint][] = [['fp32', 'none'], ['bf16-mixed', 'none'], ['bf16-mixed', 'full'], ['bf16-mixed', 'selective']];
const load0 = os.loadavg()[0]!;
console.log(`| run | malloc (tuned) step | tensor cache step | cache / malloc | page faults per step, malloc / cache |`);
console.log(`|---|---:|---:|---:|---:|`);
for (const [precision, ac] of modes) {
  const t: Record<'cache' | 'malloc', number[]> = { cache: [], malloc: [] };
  const f: Record<'cache' | 'malloc', number[]> = { cache: [], malloc: [] };
  for (let r = 0; r < Number(a.rounds); r++) {
    for (const side of ['malloc', 'cache'] as const) {
      native.setTensorCache(TENSOR_CACHE.minBytes, side === 'cache' ? TENSOR_CACHE.capBytes : 0);
      step(precision, ac); // untimed: the first step after a switch refills the side's memory
      for (let s = 0; s < Number(a.steps); s++) {
        const x = step(precision, ac);
        t[side].push(x.ms);
        f[side].push(x.faults);
      }
    }
  }
  const m = median(t.malloc), c = median(t.cache);
  console.log(`| ${precision}${ac === 'none' ? '' : ` + ${ac}`} | ${m.toFixed(1)} ms | ${c.toFixed(1)} ms | ${(c / m).toFixed(3)} | ${median(f.malloc)} / ${median(f.cache)} |`);
}
console.log(`\nGPT ${a.layers} layers, width ${a.width}, batch 8 x 128, one thread; ${a.rounds} rounds of ${a.steps} timed steps per side. Load average (1 min) ${load0.toFixed(1)} at the start, ${os.loadavg()[0]!.toFixed(1)} at the end, on ${os.cpus().length} cores.`);
console.log(`Reproduce: \`node --import tsx bench/allocator.ts --width ${a.width} --layers ${a.layers} --steps ${a.steps} --rounds ${a.rounds}\``);
