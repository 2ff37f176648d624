// Benchmark: one program, two speeds (docs/BENCHMARKS.md). Starts fresh flotilla processes one after
// another, each training bench/llama.ts's Llama (or bench/step.ts's GPT) for warmup steps and then N
// timed steps, float32, one intra-op thread, and reports each process's median step and how far the
// slowest process's median is from the fastest's (goal: within 10%), per kernels ([Note: kernel
// choice] in src/nn/kernels/choice.ts; fused and eager processes alternate). With each process it
// records what might tell a slow process from a fast one: its GEMM rate (src/train/peak_flops.ts's
// probe after the steps: is a slow process slow at plain matmuls too?), the CPUs its main thread ran on
// and may run on, involuntary context switches and minor page faults per step, transparent huge pages
// (AnonHugePages), its NUMA nodes, the size and address of its largest anonymous mapping, and the
// machine's steal time (a virtual machine's CPUs taken by the hypervisor).
//
//   node --import tsx bench/speeds.ts [--model llama|gpt] [--kernels fused|eager|both] [--processes 10] [--steps 20] [--warmup 3] [--no-write]
//
// Writes its section of docs/BENCHMARKS.md (between <!-- speeds:begin --> and <!-- speeds:end -->).
import { spawn } from 'node:child_process';
import { readFileSync, readdirSync } from 'node:fs';
import { cpus, loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { randint, manualSeed, setNumThreads, torchVersion, describeBlas, type Tensor } from '../src/tensor/index.js';
import type { KernelChoice } from '../src/nn/kernels/choice.js';
import type { Module } from '../src/nn/module.js';
import { GPT } from '../src/models/gpt.js';
import { procStatusBytes } from '../src/io/proc_status.js';
import { probePeakTflops } from '../src/train/peak_flops.js';
import { median, parseBench, writeSection, runIfMain } from './report.js';
import { kernelsArg, singleProcessTrainer } from './step_measure.js';
import { llamaBench, ADAMW } from './llama.js';
import { STEP_CONFIG } from './step.js';

interface ProcOut {
  kernels: KernelChoice; wall: number[]; cpu: number[]; gflops: number;
  /** CPUs the main thread ran on (sampled after each step), how often that changed, and the CPUs the process may run on. */
  ranOn: number[]; moves: number; allowed: string;
  /** The largest anonymous mapping after the steps. */
  largest: { mib: number; start: string };
  /** Per timed step. */
  involuntary: number; minorFaults: number;
  /** The whole machine's steal time per timed step, ms (all its CPUs). */
  steal: number;
  anonHugeMiB: number; numaNodes: string; threads: number;
  /** The kernels OpenBLAS picked when it loaded (by CPU, unless OPENBLAS_CORETYPE pins them). */
  blas: string;
}

/** A number field of /proc/self/status (not a kB one). */
const statusCount = (field: string): number => Number(new RegExp(`^${field}:\\s+(\\d+)`, 'm').exec(readFileSync('/proc/self/status', 'utf8'))?.[1] ?? NaN);
const statusText = (field: string): string => new RegExp(`^${field}:\\s+(.*)$`, 'm').exec(readFileSync('/proc/self/status', 'utf8'))?.[1]?.trim() ?? '?';

/** The CPU the main thread (the one computing, at one intra-op thread) last ran on: field 39 of /proc/self/stat. */
function mainThreadCpu(): number {
  const stat = readFileSync('/proc/self/stat', 'utf8');
  return Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[36]);
}

/** The largest writable anonymous mapping (the allocator's largest cached block, or an arena): its size in MiB and its start address. */
function largestAnonMapping(): { mib: number; start: string } {
  let best = { mib: 0, start: '?' };
  for (const line of readFileSync('/proc/self/maps', 'utf8').split('\n')) {
    const f = line.trim().split(/\s+/);
    if (f.length !== 5 || f[1] !== 'rw-p') continue; // a mapping with a path or a [name], or a reservation (---p)
    const [lo, hi] = f[0]!.split('-').map((x) => parseInt(x, 16)) as [number, number];
    if ((hi - lo) / 2 ** 20 > best.mib) best = { mib: (hi - lo) / 2 ** 20, start: `0x${lo.toString(16)}` };
  }
  return best;
}

/** The NUMA nodes holding this process's anonymous pages (from /proc/self/numa_maps), with their page counts. */
function numaNodes(): string {
  const nodes = new Map<string, number>();
  try {
    for (const m of readFileSync('/proc/self/numa_maps', 'utf8').matchAll(/ (N\d+)=(\d+)/g)) nodes.set(m[1]!, (nodes.get(m[1]!) ?? 0) + Number(m[2]));
  } catch { return 'n/a'; }
  return [...nodes].map(([n, p]) => `${n}:${p}`).join(' ');
}

/**
 * The machine's steal time so far, ms (the 8th number of /proc/stat's cpu line, in USER_HZ ticks of
 * 10 ms): time the hypervisor ran something else while a virtual CPU of this machine had work.
 */
function stealMs(): number {
  const f = readFileSync('/proc/stat', 'utf8').split('\n')[0]!.trim().split(/\s+/);
  return Number(f[8] ?? NaN) * 10;
}

/** One process's run. */
async function runProcess(model: 'llama' | 'gpt', kernels: KernelChoice, steps: number, warmup: number): Promise<ProcOut> {
  setNumThreads(1);
  let m: Module & { forward(idx: Tensor): { logits: Tensor } }, idx: Tensor, targets: Tensor;
  if (model === 'llama') ({ model: m, idx, targets } = llamaBench({ nEmbd: 256, nLayer: 4, nKvHead: 2, lora: 0 }));
  else {
    manualSeed(0);
    m = new GPT(STEP_CONFIG);
    idx = randint(0, STEP_CONFIG.vocabSize, [8, STEP_CONFIG.blockSize]);
    targets = randint(0, STEP_CONFIG.vocabSize, [8, STEP_CONFIG.blockSize]);
  }
  const trainer = singleProcessTrainer(m, idx, targets, ADAMW);
  for (let i = 0; i < warmup; i++) await trainer.step('fp32', kernels);
  const inv0 = statusCount('nonvoluntary_ctxt_switches'), flt0 = process.resourceUsage().minorPageFault, steal0 = stealMs();
  const wall: number[] = [], cpu: number[] = [];
  const ran: number[] = [];
  for (let i = 0; i < steps; i++) {
    const [w, c] = await trainer.step('fp32', kernels);
    wall.push(w);
    cpu.push(c);
    ran.push(mainThreadCpu());
  }
  const involuntary = (statusCount('nonvoluntary_ctxt_switches') - inv0) / steps;
  const minorFaults = (process.resourceUsage().minorPageFault - flt0) / steps;
  const steal = (stealMs() - steal0) / steps;
  const gflops = probePeakTflops('float32') * 1e3;
  let anonHugeMiB = NaN;
  try {
    anonHugeMiB = Number(/^AnonHugePages:\s+(\d+) kB/m.exec(readFileSync('/proc/self/smaps_rollup', 'utf8'))?.[1]) / 1024;
  } catch { /* no smaps_rollup */ }
  const out: ProcOut = {
    kernels, wall, cpu, gflops, ranOn: [...new Set(ran)].sort(), moves: ran.filter((c, i) => i > 0 && c !== ran[i - 1]).length, largest: largestAnonMapping(), allowed: statusText('Cpus_allowed_list'), involuntary, minorFaults, steal,
    anonHugeMiB, numaNodes: numaNodes(), threads: readdirSync('/proc/self/task').length, blas: describeBlas(),
  };
  trainer.dispose();
  return out;
}

function inChild(args: string[]): Promise<ProcOut> {
  return new Promise((res, rej) => {
    const c = spawn(process.execPath, ['--import', 'tsx', fileURLToPath(import.meta.url), '--child', ...args], { stdio: ['ignore', 'pipe', 'inherit'] });
    let out = '';
    c.stdout.on('data', (d: Buffer) => (out += d.toString()));
    c.on('error', rej);
    c.on('exit', (code) => (code === 0 ? res(parseBench<ProcOut>(out)) : rej(new Error(`a benchmark process exited ${code}:\n${out}`))));
  });
}

async function main(): Promise<void> {
  const { values: a } = parseArgs({ options: { model: { type: 'string', default: 'llama' }, kernels: { type: 'string', default: 'both' }, processes: { type: 'string', default: '10' }, steps: { type: 'string', default: '20' }, warmup: { type: 'string', default: '3' }, child: { type: 'boolean', default: false }, 'no-write': { type: 'boolean', default: false } } });
  const steps = Number(a.steps), warmup = Number(a.warmup), processes = Number(a.processes);
  const kernels = kernelsArg(a.kernels);
  if (a.model !== 'llama' && a.model !== 'gpt') throw new Error(`--model must be llama or gpt, not ${a.model}`);
  if (a.child) {
    console.log(`BENCH ${JSON.stringify(await runProcess(a.model, kernels[0]!, steps, warmup))}`);
    return;
  }
  if (!(processes >= 2 && steps >= 1)) throw new Error('--processes must be at least 2 and --steps at least 1');
  const load0 = loadavg()[0]!;
  const ms = (s: number) => (s * 1e3).toFixed(1);
  const runs: ProcOut[] = [];
  for (let k = 0; k < processes; k++) {
    // Alternate which kernels start each round, so that neither always follows the other.
    for (const kc of k % 2 ? [...kernels].reverse() : kernels) {
      const r = await inChild(['--model', a.model, '--kernels', kc, '--steps', String(steps), '--warmup', String(warmup)]);
      runs.push(r);
      console.log(`process ${k + 1}/${processes} ${kc}: median ${ms(median(r.wall))} ms (fastest ${ms(Math.min(...r.wall))}), CPU ${ms(median(r.cpu))} ms, GEMM ${r.gflops.toFixed(1)} GFLOP/s, main thread on CPUs ${r.ranOn.join(',')} of ${r.allowed} (moved ${r.moves} times), largest anonymous mapping ${r.largest.mib.toFixed(0)} MiB at ${r.largest.start}, ${r.involuntary.toFixed(1)} involuntary switches and ${r.minorFaults.toFixed(0)} minor faults per step, steal ${r.steal.toFixed(1)} ms per step, AnonHugePages ${r.anonHugeMiB.toFixed(0)} MiB, NUMA ${r.numaNodes}, ${r.threads} threads, ${r.blas}`);
    }
  }
  const rows = runs.map((r, i) => `| ${Math.floor(i / kernels.length) + 1} | ${r.kernels} | ${ms(median(r.wall))} | ${ms(Math.min(...r.wall))} | ${ms(median(r.cpu))} | ${r.gflops.toFixed(1)} | ${r.ranOn.join(',')} (of ${r.allowed}), ${r.moves} | ${r.largest.mib.toFixed(0)} MiB at ${r.largest.start} | ${r.involuntary.toFixed(1)} | ${r.minorFaults.toFixed(0)} | ${r.steal.toFixed(1)} | ${r.anonHugeMiB.toFixed(0)} | ${r.numaNodes} | ${r.threads} | ${r.blas} |`);
  const summary = kernels.map((kc) => {
    const meds = runs.filter((r) => r.kernels === kc).map((r) => median(r.wall));
    const lo = Math.min(...meds), hi = Math.max(...meds), spread = hi / lo;
    const slow = meds.filter((x) => x > 1.1 * lo).length;
    const gem = runs.filter((r) => r.kernels === kc).map((r) => r.gflops);
    const cpuMeds = runs.filter((r) => r.kernels === kc).map((r) => median(r.cpu));
    const cpuSpread = Math.max(...cpuMeds) / Math.min(...cpuMeds);
    return `${kc}: process medians ${ms(lo)}-${ms(hi)} ms, slowest / fastest = ${spread.toFixed(3)} (goal <= 1.10: ${spread <= 1.1 ? 'met' : 'missed'}), ` +
      `${slow} of ${meds.length} processes more than 10% slower than the fastest; in CPU time per step ${ms(Math.min(...cpuMeds))}-${ms(Math.max(...cpuMeds))} ms (${cpuSpread.toFixed(3)}: ` +
      `a wall-time spread without one in CPU time is waiting for a core, not the slow mode); their GEMM rates ${Math.min(...gem).toFixed(1)}-${Math.max(...gem).toFixed(1)} GFLOP/s`;
  });
  const table = [
    '| process | kernels | median step ms | fastest step ms | CPU ms per step | GEMM GFLOP/s after | main thread\'s CPUs (allowed), moves between samples | largest anonymous mapping | involuntary switches per step | minor faults per step | machine\'s steal ms per step | AnonHugePages MiB | NUMA pages | threads | BLAS |',
    '|---:|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---|---:|---|',
    ...rows,
  ].join('\n');
  console.log(table);
  for (const s of summary) console.log(s);
  if (a['no-write']) return;
  const what = a.model === 'llama' ? 'bench/llama.ts\'s Llama (4 layers, width 256, 8 heads sharing 2 key/value heads, vocab 256), batch 8 x 128' : 'bench/step.ts\'s GPT (4 layers, width 256, 8 heads, vocab 256), batch 8 x 128';
  writeSection('speeds', [
    '## One program, two speeds: step time over fresh processes',
    '',
    `${processes * kernels.length} fresh flotilla processes one after another (${processes} per kernels: ${kernels.join(' and ')}, alternating), each training ${what} ` +
      `(forward + backward + AdamW, float32, one intra-op thread, the single-process path of \`flotilla train\`) for ${warmup} warmup steps and ${steps} timed steps. ` +
      'A process\'s speed is the median of its timed steps; the goal is the slowest process within 10% of the fastest. After its steps each process probes its GEMM rate ' +
      '(src/train/peak_flops.ts: 768 x 768 float32 matmuls, best of 0.5 s) and reports the CPUs its main thread ran on (sampled after each step; at one intra-op thread it computes) and may run on, ' +
      'its largest anonymous mapping (the tensor cache\'s largest block, or an arena) and where it starts, ' +
      'its involuntary context switches and minor page faults per timed step, the machine\'s steal time per step (/proc/stat: the hypervisor running something else while a virtual CPU had work), ' +
      'its transparent huge pages, the NUMA nodes of its pages, its threads and the BLAS kernels it loaded. A slow process whose GEMM rate is low too is slow at plain matmuls, where flotilla\'s memory layout plays no part.',
    '',
    `Reproduce: \`node --import tsx bench/speeds.ts --model ${a.model} --kernels ${a.kernels} --processes ${processes} --steps ${steps} --warmup ${warmup}\`.`,
    '',
    `Machine: ${cpus().length} x ${cpus()[0]?.model.trim() ?? 'cpu'}, libtorch ${torchVersion()}, ${describeBlas()}. Load average (1 min) at the start and the end of this run: ${load0.toFixed(1)} and ${loadavg()[0]!.toFixed(1)}.`,
    '',
    table,
    '',
    ...summary.map((s) => `- ${s}`),
  ].join('\n'));
  console.log('wrote the speeds section of docs/BENCHMARKS.md');
}

runIfMain(import.meta.url, main);
