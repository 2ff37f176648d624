// The one-pass pointwise kernels (src/nn/kernels/pointwise.ts) against the eager ops they replace,
// each forward and backward at a training shape: 8192 tokens of width 512 and 2048 (rotary: heads of
// width 64), float32 and bfloat16 inputs. One process, one warm-up step, then `steps` timed steps
// (median), eager's and fused's alternating. Writes its section of docs/BENCHMARKS.md (between <!-- pointwise:begin --> and <!-- pointwise:end -->).
//
//   node --import tsx bench/pointwise.ts [--tokens 8192] [--widths 512,2048] [--steps 5] [--threads 2] [--no-write]
import { parseArgs } from 'node:util';
import { loadavg } from 'node:os';
import { grad, manualSeed, randn, setNumThreads, tidy, type DType, type Tensor } from '../src/tensor/index.js';
import * as F from '../src/nn/functional.js';
import { applyRotary } from '../src/models/llama.js';
import { fusedGelu, fusedLayerNorm, fusedRmsNorm, fusedRotary, fusedSwiglu } from '../src/nn/kernels/pointwise.js';
import { median, writeSection } from './report.js';

const { values: a } = parseArgs({
  options: {
    tokens: { type: 'string', default: '8192' }, widths: { type: 'string', default: '512,2048' },
    steps: { type: 'string', default: '5' }, threads: { type: 'string', default: '2' }, 'no-write': { type: 'boolean', default: false },
  },
});
const N = Number(a.tokens), steps = Number(a.steps), widths = a.widths.split(',').map(Number);
setNumThreads(Number(a.threads));

interface Kernel {
  name: string;
  /** Inputs (the first `diff` differentiated) at width C in dtype. */
  inputs: (C: number, dtype: DType) => Tensor[];
  diff: number;
  eager: (...xs: Tensor[]) => Tensor;
  fused: (...xs: Tensor[]) => Tensor;
}
const HD = 64;
const kernels: Kernel[] = [
  { name: 'RMSNorm', diff: 2, inputs: (C, d) => [randn([N, C], { dtype: d }), randn([C], { dtype: d })], eager: (x, w) => F.rmsNorm(x, w, 1e-5), fused: (x, w) => fusedRmsNorm(x, w, 1e-5) },
  { name: 'LayerNorm', diff: 3, inputs: (C, d) => [randn([N, C], { dtype: d }), randn([C], { dtype: d }), randn([C], { dtype: d })], eager: (x, w, b) => F.layerNorm(x, [x.shape[1]!], w, b, 1e-5), fused: (x, w, b) => fusedLayerNorm(x, w, b, 1e-5) },
  { name: 'SwiGLU', diff: 2, inputs: (C, d) => [randn([N, C], { dtype: d }), randn([N, C], { dtype: d })], eager: (g, u) => g.silu().mul(u), fused: fusedSwiglu },
  { name: 'GELU (tanh)', diff: 1, inputs: (C, d) => [randn([N, C], { dtype: d })], eager: (x) => x.gelu('tanh'), fused: (x) => fusedGelu(x, 'tanh') },
  { name: 'GELU (exact)', diff: 1, inputs: (C, d) => [randn([N, C], { dtype: d })], eager: (x) => x.gelu('none'), fused: (x) => fusedGelu(x, 'none') },
  // The Llama's layout: x (1, T, heads, 64) from a (T, C) projection, float32 tables (T, 64).
  { name: 'rotary', diff: 1, inputs: (C, d) => [randn([1, N, C / HD, HD], { dtype: d }), randn([N, HD]), randn([N, HD])], eager: applyRotary, fused: fusedRotary },
];

/**
 * Median ms of forward + backward (gradient of every differentiated input, upstream gradient given),
 * eager and fused: the two alternate step by step on the same inputs, so both see the same load.
 */
function time(k: Kernel, C: number, dtype: DType): [number, number] {
  manualSeed(1);
  return tidy(() => {
    const xs = k.inputs(C, dtype).map((x, i) => (i < k.diff ? x.requiresGrad_() : x));
    const y0 = k.eager(...xs), g = randn(y0.shape, { dtype: y0.dtype });
    const ms: [number[], number[]] = [[], []];
    for (let s = 0; s <= steps; s++) {
      [k.eager, k.fused].forEach((fn, i) => tidy(() => {
        const t0 = performance.now();
        const y = fn(...xs);
        grad([y], xs.slice(0, k.diff), { gradOutputs: [g] });
        if (s > 0) ms[i]!.push(performance.now() - t0);
      }));
    }
    return [median(ms[0]), median(ms[1])];
  });
}

const load = loadavg()[0]!;
const rows: string[] = [];
for (const dtype of ['float32', 'bfloat16'] as DType[]) {
  for (const C of widths) {
    for (const k of kernels) {
      const [eager, fused] = time(k, C, dtype);
      const row = `| ${k.name} | ${dtype} | ${N} x ${C} | ${fused.toFixed(1)} | ${eager.toFixed(1)} | ${(eager / fused).toFixed(2)} |`;
      console.log(row);
      rows.push(row);
    }
  }
}
const loadEnd = loadavg()[0]!;
const cmd = `node --import tsx bench/pointwise.ts --tokens ${N} --widths ${a.widths} --steps ${steps} --threads ${a.threads}`;
const body = [
  '## Fused pointwise kernels',
  '',
  `Each kernel alone, forward and backward (the gradient of every differentiated input from a given upstream gradient), ${a.threads}`,
  `intra-op thread(s), one process: one warm-up step, then ${steps} timed steps (median), eager's and fused's alternating. Fused: the one-pass kernels`,
  '(src/nn/kernels/pointwise.ts, native/pointwise.cc). Eager: the ops `[train] kernels = "eager"` runs (F.rmsNorm, F.layerNorm,',
  'silu then mul, gelu, applyRotary), autograd through each. Every input is (tokens x width); rotary\'s is (1, tokens, width / 64, 64)',
  'with float32 tables, as the Llama rotates q. bfloat16 rows: bfloat16 inputs (the norms and SwiGLU run in float32 under',
  'bf16-mixed; these rows show the kernels\' bfloat16 path).',
  `The machine's 1-minute load average was ${load.toFixed(1)} when the run started and ${loadEnd.toFixed(1)} when it ended (other work shared`,
  'its 2 cores), so single numbers are noisy; compare ratios within a row. Ratios near 1 (the exact GELU in float32, where at',
  '2 threads both paths are bound by memory) moved by up to 25% between runs under such load.',
  '',
  `\`${cmd}\``,
  '',
  '| kernel | dtype | shape | fused (ms) | eager (ms) | eager / fused |',
  '|---|---|---|---|---|---|',
  ...rows,
].join('\n');
if (!a['no-write']) writeSection('pointwise', body);
else console.log(body);
