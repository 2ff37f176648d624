// One AdamW step over a flat float32 buffer of 25M parameters (a 25M model's bucket): the fused
// one-pass update (src/optim/fused.ts, kernels = "fused") against the op-by-op update (the default)
// in this process, alternating step by step, and PyTorch 1.13's torch.optim.AdamW (single-tensor and
// foreach, bench/optim_peer.py) on the same size and threads; and the step after gradient clipping:
// the clip's factor multiplied into the gradient in a pass of its own then the step, against the
// factor folded into the fused update ([Note: folded clip]). Writes its section of
// docs/BENCHMARKS.md (between <!-- optim:begin --> and <!-- optim:end -->).
//
//   node --import tsx bench/optim.ts [--params 25000000] [--steps 10] [--threads 1,2] [--no-write]
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { loadavg } from 'node:os';
import * as ft from '../src/tensor/index.js';
import { AdamW } from '../src/optim/index.js';
import { withKernels, type KernelChoice } from '../src/nn/kernels/choice.js';
import { cpuFlags } from '../src/tensor/cpu_features.js';
import { median, parseBench, writeSection } from './report.js';

const { values: a } = parseArgs({
  options: {
    params: { type: 'string', default: '25000000' }, steps: { type: 'string', default: '10' },
    threads: { type: 'string', default: '1,2' }, 'no-write': { type: 'boolean', default: false },
  },
});
const N = Number(a.params), steps = Number(a.steps), threadCounts = a.threads.split(',').map(Number);
const root = join(import.meta.dirname, '..');
const loadBefore = loadavg()[0]!;
// Bytes an update must move at least: read parameters, gradient and both moments, write three of them.
const gbps = (ms: number) => ((7 * 4 * N) / (ms / 1000) / 1e9).toFixed(1);
const rows: string[] = [];
for (const threads of threadCounts) {
  ft.setNumThreads(threads);
  ft.manualSeed(0);
  // clip: none; 'pass': the gradient scaled in place, then the step (clipGradNorm's pass); 'folded': the factor handed to the step.
  const kinds: [KernelChoice, 'none' | 'pass' | 'folded'][] = [['fused', 'none'], ['eager', 'none'], ['fused', 'pass'], ['fused', 'folded'], ['eager', 'pass']];
  const sides = kinds.map(([kernels, clip]) => {
    const p = ft.keep(ft.randn([N]));
    p.grad = ft.keep(ft.randn([N]).mul(1e-3));
    return { kernels, clip, p, opt: new AdamW([p], { lr: 3e-4, betas: [0.9, 0.95], eps: 1e-8, weightDecay: 0.1 }), ms: [] as number[] };
  });
  const scale = 0.9; // a clip factor (the norm itself, the same pass on every side, is not timed)
  for (let s = 0; s <= steps; s++) {
    // Each step starts at another side, so no side always runs after the same one (the eager update's frees).
    for (const side of [...sides.slice(s % sides.length), ...sides.slice(0, s % sides.length)]) {
      const t0 = performance.now();
      if (side.clip === 'pass') ft.noGrad(() => side.p.grad!.mul_(scale));
      withKernels(side.kernels, () => side.opt.step(side.clip === 'folded' ? { gradScale: scale } : {}));
      if (s > 0) side.ms.push(performance.now() - t0);
    }
  }
  for (const side of sides) {
    side.opt.dispose();
    side.p.grad!.dispose();
    side.p.dispose();
  }
  const r = spawnSync('/usr/bin/python3', [join('bench', 'optim_peer.py'), JSON.stringify({ N, steps, threads })], { cwd: root, encoding: 'utf8' });
  if (r.status !== 0) throw new Error(`optim_peer.py failed:\n${r.stdout}\n${r.stderr}`);
  const pt = parseBench<{ single: number[]; foreach: number[] }>(r.stdout);
  const [fused, eager, fusedPass, fusedFolded, eagerPass] = sides.map((s) => median(s.ms)) as [number, number, number, number, number];
  const row = (name: string, ms: number) => `| ${threads} | ${name} | ${ms.toFixed(1)} | ${gbps(ms)} | ${(ms / fused).toFixed(2)} |`;
  rows.push(row('flotilla fused (one pass)', fused), row('flotilla eager (op by op, chunked)', eager),
    row('PyTorch 1.13 AdamW, single-tensor', median(pt.single)), row('PyTorch 1.13 AdamW, foreach', median(pt.foreach)),
    row('clipped: flotilla fused, clip factor folded in', fusedFolded), row('clipped: flotilla fused after a clip pass', fusedPass),
    row('clipped: flotilla eager after a clip pass', eagerPass));
  console.log(rows.slice(-7).join('\n'));
}
const loadAfter = loadavg()[0]!;

const flags = cpuFlags();
const isa = `${flags.has('avx2') ? 'AVX2' : 'no AVX2'}${flags.has('fma') ? ' + FMA' : ''}`;
const cmd = `node --import tsx bench/optim.ts --params ${N} --steps ${steps} --threads ${a.threads}`;
const body = [
  '## Fused optimizer step',
  '',
  `One AdamW step (weight decay 0.1) over one flat float32 buffer of ${N.toLocaleString('en-US')} parameters, at ${a.threads} intra-op thread(s): one warm-up`,
  `step, then ${steps} timed steps (median). flotilla's fused (one pass: parameters, gradient and both moments read once and written once,`,
  'native/optim.cc) and eager (the op-by-op update in cache-sized chunks) alternate step by step in one process (each step in another order); PyTorch 1.13\'s',
  'torch.optim.AdamW (bench/optim_peer.py) runs its single-tensor and foreach paths on the same size afterwards. GB/s: the 28 bytes',
  'per parameter an update must move (4 arrays read, 3 written) over the step\'s time. The "clipped" rows are the step after',
  'gradient clipping with a factor below 1: a pass multiplying the gradient in place (as clipGradNorm does; the eager update\'s',
  'default) then the step, or the factor handed to the fused update, which multiplies the gradient as it reads it ([Note: folded',
  'clip]); the norm\'s own pass, the same either way, is left out. time / fused: against the unclipped fused step.',
  `CPU: ${isa}. 1-minute load average ${loadBefore.toFixed(1)} when the run started and ${loadAfter.toFixed(1)} when it ended (other processes`,
  'share the cores when it is above the core count, and the times then vary from run to run; every parallel region then waits for its',
  'slowest thread, and the eager update opens one per op and chunk where the fused one opens one per bucket).',
  '',
  `\`${cmd}\``,
  '',
  '| threads | update | step (ms) | GB/s | time / fused |',
  '|---|---|---|---|---|',
  ...rows,
].join('\n');
console.log(body);
if (!a['no-write']) writeSection('optim', body);
