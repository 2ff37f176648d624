// Benchmark: the peak resident memory of one training step (forward, backward, AdamW), flotilla with
// its fused kernels against its eager ones ([Note: kernel choice] in src/nn/kernels/choice.ts), and
// PyTorch 1.13 eager on the same model, each case in a fresh process, one intra-op thread:
// - gpt-2048: the demo's GPT (examples/gpt-tiny.toml's model) at context 2048, one sequence (2,048
//   tokens, the demo's tokens per step): the attention's T x T scores dominate the eager step;
// - llama-32k: bench/llama.ts's Llama with a 32,000-token vocabulary, batch 8 x 128: the logits and
//   their gradient (tokens x vocab) dominate the eager step.
// A case reports VmRSS of its process once the model, the batch and the optimizer exist (the base),
// and VmHWM (the kernel's high-water mark of resident memory) after the step(s); PyTorch's are read
// from /proc/<pid>/status of the peer process, from outside.
//
//   node --import tsx bench/step_rss.ts [--models gpt-2048,llama-32k] [--steps 1] [--no-torch] [--no-write]
//
// Writes its section of docs/BENCHMARKS.md (between <!-- step-rss:begin --> and <!-- step-rss:end -->).
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir, loadavg, cpus } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { manualSeed, randint, setNumThreads, torchVersion, type Tensor } from '../src/tensor/index.js';
import type { Module } from '../src/nn/module.js';
import type { KernelChoice } from '../src/nn/kernels/choice.js';
import { GPT } from '../src/models/gpt.js';
import { saveSafetensors } from '../src/checkpoint/safetensors.js';
import { procStatusBytes } from '../src/io/proc_status.js';
import type { PythonPeer } from './report.js';
import { median, parseBench, writeSection, runIfMain } from './report.js';
import { singleProcessTrainer } from './step_measure.js';
import { stepShape, TorchPeer } from './step.js';
import { llamaBench, Peer as LlamaPeer, ADAMW, LLAMA_BATCH, LLAMA_SEQ } from './llama.js';

const MODELS = ['gpt-2048', 'llama-32k'] as const;
type ModelName = (typeof MODELS)[number];
type Variant = KernelChoice | 'torch';
const VARIANTS: Variant[] = ['eager', 'fused', 'torch'];
const MiB = 2 ** 20;

interface CaseOut { baseBytes: number; peakBytes: number; stepMs: number[]; what: string; torch?: string }

/** A case's model and batch. */
async function build(name: ModelName): Promise<{ model: Module & { forward(idx: Tensor): { logits: Tensor } }; idx: Tensor; targets: Tensor; what: string; peer: (init: string) => PythonPeer }> {
  if (name === 'gpt-2048') {
    const { cfg: demo } = await stepShape('demo');
    const cfg = { ...demo, blockSize: 2048 };
    manualSeed(0);
    const model = new GPT(cfg);
    const idx = randint(0, cfg.vocabSize, [1, cfg.blockSize]), targets = randint(0, cfg.vocabSize, [1, cfg.blockSize]);
    const what = `the demo's GPT (nLayer ${cfg.nLayer}, nEmbd ${cfg.nEmbd}, nHead ${cfg.nHead}, vocab ${cfg.vocabSize}) at context ${cfg.blockSize}, batch 1 x ${cfg.blockSize}`;
    return { model, idx, targets, what, peer: (init) => new TorchPeer(init, cfg) };
  }
  const { model, idx, targets } = llamaBench({ nEmbd: 256, nLayer: 4, nKvHead: 2, lora: 0 }, 32000);
  const c = model.cfg;
  const what = `bench/llama.ts's Llama (${c.nLayer} layers, width ${c.nEmbd}, ${c.nHead} heads sharing ${c.nKvHead} key/value heads, SwiGLU ${c.intermediateSize}) with vocab ${c.vocabSize}, untied, batch ${LLAMA_BATCH} x ${LLAMA_SEQ}`;
  return { model, idx, targets, what, peer: (init) => new LlamaPeer(init, c, 0) };
}

/** One case in this (fresh) process. */
async function runCase(name: ModelName, variant: Variant, steps: number): Promise<CaseOut> {
  setNumThreads(1);
  const { model, idx, targets, what, peer: makePeer } = await build(name);
  if (variant === 'torch') {
    const dir = mkdtempSync(join(tmpdir(), 'flotilla-bench-rss-'));
    try {
      const init = join(dir, 'init.safetensors');
      saveSafetensors(init, { ...Object.fromEntries(model.namedParameters()), idx, targets });
      const peer = makePeer(init);
      try {
        const ready = await peer.next();
        const pid = peer.pid;
        const baseBytes = procStatusBytes(pid)!.VmRSS!;
        const r = await peer.ask({ steps, mode: 'fp32' });
        const stepMs = (r.times as (number | number[])[]).map((t) => 1e3 * (Array.isArray(t) ? t[0]! + t[1]! + t[2]! : t));
        const peakBytes = procStatusBytes(pid)!.VmHWM!;
        return { baseBytes, peakBytes, stepMs, what, torch: ready.torch };
      } finally {
        peer.close();
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }
  const trainer = singleProcessTrainer(model, idx, targets, ADAMW);
  const baseBytes = procStatusBytes()!.VmRSS!;
  const stepMs: number[] = [];
  for (let s = 0; s < steps; s++) stepMs.push(1e3 * (await trainer.step('fp32', variant))[0]);
  return { baseBytes, peakBytes: procStatusBytes()!.VmHWM!, stepMs, what };
}

/** runCase in a fresh process (this script with --child). */
function caseInChild(name: ModelName, variant: Variant, steps: number): Promise<CaseOut> {
  return new Promise((res, rej) => {
    const c = spawn(process.execPath, ['--import', 'tsx', fileURLToPath(import.meta.url), '--child', `${name}:${variant}`, '--steps', String(steps)], { stdio: ['ignore', 'pipe', 'inherit'] });
    let out = '';
    c.stdout.on('data', (d: Buffer) => (out += d.toString()));
    c.on('error', rej);
    c.on('exit', (code) => (code === 0 ? res(parseBench<CaseOut>(out)) : rej(new Error(`${name} ${variant} exited ${code}:\n${out}`))));
  });
}

async function main(): Promise<void> {
  const { values: a } = parseArgs({ options: { models: { type: 'string', default: MODELS.join(',') }, steps: { type: 'string', default: '1' }, child: { type: 'string' }, 'no-torch': { type: 'boolean', default: false }, 'no-write': { type: 'boolean', default: false } } });
  const steps = Number(a.steps);
  if (!(Number.isInteger(steps) && steps >= 1)) throw new Error(`--steps must be a positive integer, not ${a.steps}`);
  if (a.child) {
    const [name, variant] = a.child.split(':') as [ModelName, Variant];
    console.log(`BENCH ${JSON.stringify(await runCase(name, variant, steps))}`);
    return;
  }
  const models = a.models!.split(',') as ModelName[];
  for (const m of models) if (!MODELS.includes(m)) throw new Error(`--models: unknown model ${m} (known: ${MODELS.join(', ')})`);
  const variants = VARIANTS.filter((v) => v !== 'torch' || !a['no-torch']);
  const load0 = loadavg()[0]!;
  const mib = (b: number) => (b / MiB).toFixed(0);
  const rows: string[] = [], summary: string[] = [], whats: string[] = [];
  let torch = '';
  for (const m of models) {
    const got = new Map<Variant, CaseOut>();
    for (const v of variants) {
      const r = await caseInChild(m, v, steps);
      got.set(v, r);
      torch ||= r.torch ?? '';
      console.log(`${m} ${v}: base ${mib(r.baseBytes)} MiB, peak ${mib(r.peakBytes)} MiB (step +${mib(r.peakBytes - r.baseBytes)} MiB), step ${median(r.stepMs).toFixed(0)} ms`);
    }
    whats.push(`${m}: ${got.get('eager')!.what}`);
    const e = got.get('eager')!, f = got.get('fused')!;
    const stepRatio = (f.peakBytes - f.baseBytes) / (e.peakBytes - e.baseBytes), peakRatio = f.peakBytes / e.peakBytes;
    for (const v of variants) {
      const r = got.get(v)!;
      const label = v === 'torch' ? 'PyTorch 1.13 eager' : `flotilla ${v}`;
      const ratio = v === 'fused' ? `**${stepRatio.toFixed(2)}** (peak ${peakRatio.toFixed(2)})` : v === 'eager' ? '1' : `${((r.peakBytes - r.baseBytes) / (e.peakBytes - e.baseBytes)).toFixed(2)} (peak ${(r.peakBytes / e.peakBytes).toFixed(2)})`;
      rows.push(`| ${m} | ${label} | ${mib(r.baseBytes)} | ${mib(r.peakBytes)} | ${mib(r.peakBytes - r.baseBytes)} | ${ratio} | ${median(r.stepMs).toFixed(0)} ms |`);
    }
    summary.push(`${m}: fused / eager = ${stepRatio.toFixed(2)} of the step's memory above the base (goal <= 0.5: ${stepRatio <= 0.5 ? 'met' : 'missed'}), ${peakRatio.toFixed(2)} of the process's peak`);
  }
  const table = [
    '| model | variant | base MiB (VmRSS before the step) | peak MiB (VmHWM) | step MiB (peak - base) | / flotilla eager | step time |',
    '|---|---|---:|---:|---:|---:|---:|',
    ...rows,
  ].join('\n');
  console.log(table);
  for (const s of summary) console.log(s);
  if (a['no-write']) return;
  const reproduce = `node --import tsx bench/step_rss.ts --models ${models.join(',')} --steps ${steps}${a['no-torch'] ? ' --no-torch' : ''}`;
  writeSection('step-rss', [
    '## Peak memory of a training step: fused kernels against eager',
    '',
    `One training step${steps > 1 ? ` (${steps} steps)` : ''} (forward, backward, AdamW; float32, one intra-op thread), each case in a fresh process: flotilla on the single-process path of ` +
      '`flotilla train` (flat buckets, AdamW over them) with `[train] kernels = "eager"` (op by op, as before the fused kernels) and `"fused"` ' +
      '(attention as one blocked kernel, the loss from the hidden state a chunk of tokens at a time, one-pass norms, activations and update: [Note: kernel choice] in src/nn/kernels/choice.ts)' +
      `${variants.includes('torch') ? `, and PyTorch ${torch} eager (bench/step.py, bench/llama_peer.py) on the same weights and batch` : ''}. ` +
      'Base is VmRSS of the process once the model, the batch and the optimizer exist (libtorch loaded); peak is its VmHWM after the step, read from /proc/<pid>/status ' +
      '(from outside for the PyTorch process); the step\'s memory is peak - base, what the goal (fused <= 0.5x eager) is judged on, as the base (runtime, weights) is the same for both.',
    '',
    ...whats.map((w) => `- ${w}`),
    '',
    `Reproduce: \`${reproduce}\`.`,
    '',
    `Load average (1 min) at the start and the end of this run: ${load0.toFixed(1)} and ${loadavg()[0]!.toFixed(1)} on ${cpus().length} cores; libtorch ${torchVersion()}. Step times are one process's first step${steps > 1 ? 's (median)' : ''}, for orientation only (bench/step.ts and bench/llama.ts time steps).`,
    '',
    table,
    '',
    ...summary.map((s) => `- ${s}`),
  ].join('\n'));
  console.log('wrote the step-rss section of docs/BENCHMARKS.md');
}

runIfMain(import.meta.url, main);
