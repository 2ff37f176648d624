// Benchmark: bf16-mixed precision and activation checkpointing against PyTorch 1.13's CPU autocast,
// in the same run, same model and batch, one intra-op thread each (single process). Both sides
// alternate in rounds; numbers are medians of the timed steps. Also the activation memory of each
// checkpointing mode, as peak resident memory read from outside a child process
// (bench/precision_child.ts) minus the same model's peak at batch 1 x 8.
//
//   node --import tsx bench/precision.ts [--widths 256,512] [--steps 3] [--rounds 4] [--warmup 2] [--no-write]
//
// Writes its section of docs/BENCHMARKS.md (between <!-- precision:begin --> and <!-- precision:end -->).
import { spawn } from 'node:child_process';
import os from 'node:os';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { randint, manualSeed, setNumThreads, tidy, torchVersion } from '../src/tensor/index.js';
import { GPT, type GPTConfig } from '../src/models/gpt.js';
import { AdamW, type AdamWOptions } from '../src/optim/index.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { initProcessGroup } from '../src/distributed/process_group.js';
import { saveSafetensors } from '../src/checkpoint/safetensors.js';
import { autocast, type Precision } from '../src/nn/precision.js';
import { withActivationCheckpoint, type ActivationCheckpoint } from '../src/nn/checkpoint.js';
import { withoutAllocatorSettings } from '../src/tensor/allocator.js';
import { procStatusBytes } from '../src/io/proc_status.js';
import { PythonPeer, median, writeSection } from './report.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..');
const BATCH = 8, SEQ = 128;
const ADAMW: AdamWOptions = { lr: 3e-4, betas: [0.9, 0.95], eps: 1e-8, weightDecay: 0.1 };
type Mode = { precision: Precision; ac: ActivationCheckpoint };
const MODES: [string, Mode][] = [
  ['fp32', { precision: 'fp32', ac: 'none' }],
  ['bf16-mixed', { precision: 'bf16-mixed', ac: 'none' }],
  ['fp32 + full checkpointing', { precision: 'fp32', ac: 'full' }],
  ['bf16-mixed + full checkpointing', { precision: 'bf16-mixed', ac: 'full' }],
  ['fp32 + selective checkpointing', { precision: 'fp32', ac: 'selective' }],
  ['bf16-mixed + selective checkpointing', { precision: 'bf16-mixed', ac: 'selective' }],
];

/** The PyTorch side (bench/precision_peer.py) on flotilla's initial weights. */
class Peer extends PythonPeer {
  constructor(init: string, cfg: GPTConfig) {
    super(join(ROOT, 'bench', 'precision_peer.py'), [init, JSON.stringify({ ...cfg, adamw: ADAMW })]);
  }
  async steps(n: number, mode: 'fp32' | 'bf16'): Promise<number[]> {
    return (await this.ask({ steps: n, mode })).times as number[];
  }
}

function peakMiB(o: object): Promise<number> {
  return new Promise((resolve, reject) => {
    const c = spawn(process.execPath, ['--import', 'tsx', join(ROOT, 'bench', 'precision_child.ts'), JSON.stringify(o)], { cwd: ROOT, stdio: ['pipe', 'pipe', 'inherit'], env: withoutAllocatorSettings(process.env) }); // the default allocator, whatever this process runs with
    c.stdout.on('data', (d: Buffer) => {
      if (!d.toString().includes('done')) return;
      const hwm = procStatusBytes(c.pid!)!.VmHWM!;
      c.stdin.end();
      resolve(hwm / 2 ** 20);
    });
    c.on('exit', (code) => { if (code !== 0) reject(new Error(`memory child exited ${code}`)); });
  });
}

type Group = ReturnType<typeof initProcessGroup>;

async function width(group: Group, nEmbd: number, steps: number, rounds: number, warmup: number): Promise<{ rows: string[]; summary: string }> {
  const cfg: GPTConfig = { vocabSize: 256, blockSize: SEQ, nLayer: 4, nHead: 8, nEmbd, dropout: 0, bias: true, tieEmbeddings: false };
  manualSeed(0);
  const model = new GPT(cfg);
  const idx = randint(0, 256, [BATCH, SEQ]);
  const targets = randint(0, 256, [BATCH, SEQ]);
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-bench-'));
  const init = join(dir, 'init.safetensors');
  saveSafetensors(init, { ...Object.fromEntries(model.namedParameters()), idx, targets });
  const peer = new Peer(init, cfg);
  try {
    await peer.next();
    const dp = new DataParallel(model, { group });
    const opt = new AdamW(model.parameters(), ADAMW, { grads: dp });
    // Also this process's CPU time per step (one intra-op thread): on a loaded machine wall time
    // includes waiting for a core, CPU time much less so; the checkpointing ratios are given in both.
    const cpu = new Map<string, number[]>();
    // The first step of each round is run untimed on both sides: it follows another mode's (or the
    // other process's) steps, and re-warms caches and the allocator rather than measuring this mode.
    const ours = async (n: number, m: Mode, key?: string): Promise<number[]> => {
      const out: number[] = [];
      for (let i = key ? -1 : 0; i < n; i++) {
        await new Promise((r) => setImmediate(r));
        const c0 = process.cpuUsage();
        const t0 = performance.now();
        tidy(() => {
          opt.zeroGrad();
          autocast(m.precision, () => withActivationCheckpoint(m.ac, () => {
            const { loss } = dp.forward(idx, targets);
            loss!.backward();
            dp.finishGradSync();
            loss!.item();
          }));
          opt.step();
        });
        if (i < 0) continue;
        out.push((performance.now() - t0) / 1e3);
        const c = process.cpuUsage(c0);
        if (key) cpu.set(key, [...(cpu.get(key) ?? []), (c.user + c.system) / 1e6]);
      }
      return out;
    };
    const times = new Map<string, number[]>();
    const add = (k: string, xs: number[]) => times.set(k, [...(times.get(k) ?? []), ...xs]);
    for (const [, m] of MODES) await ours(warmup, m);
    await peer.steps(warmup, 'fp32');
    await peer.steps(warmup, 'bf16');
    for (let r = 0; r < rounds; r++) {
      const jobs: [string, () => Promise<number[]>][] = [
        ...MODES.map(([k, m]) => [k, () => ours(steps, m, k)] as [string, () => Promise<number[]>]),
        ['PyTorch fp32', async () => (await peer.steps(steps + 1, 'fp32')).slice(1)],
        ['PyTorch autocast bf16', async () => (await peer.steps(steps + 1, 'bf16')).slice(1)],
      ];
      if (r % 2 === 1) jobs.reverse();
      for (const [k, f] of jobs) add(k, await f());
    }
    const med = (k: string) => median(times.get(k)!);
    const ms = (s: number) => (s * 1e3).toFixed(1);
    const mem: Record<string, number> = {};
    const base = await peakMiB({ nLayer: 4, nEmbd, batch: 1, seq: 8, precision: 'fp32', ac: 'none', steps: 3 });
    for (const [k, m] of MODES) mem[k] = (await peakMiB({ nLayer: 4, nEmbd, batch: BATCH, seq: SEQ, ...m, steps: 3 })) - base;
    const cmed = (k: string) => median(cpu.get(k)!);
    const rows = [...MODES.map(([k]) => k), 'PyTorch fp32', 'PyTorch autocast bf16'].map((k) =>
      `| ${nEmbd} | ${k} | ${ms(med(k))} ms | ${cpu.has(k) ? `${ms(cmed(k))} ms` : ''} | ${(med(k) / med('PyTorch autocast bf16')).toFixed(3)} | ${(med(k) / med('PyTorch fp32')).toFixed(3)} | ${mem[k] !== undefined ? `${mem[k]!.toFixed(0)} MiB` : ''} |`);
    const b = med('bf16-mixed');
    const slow = (ac: string, p: 'fp32' | 'bf16-mixed') => {
      const k = `${p} + ${ac} checkpointing`;
      return `${(med(k) / med(p)).toFixed(3)}x (CPU time ${(cmed(k) / cmed(p)).toFixed(3)}x) in ${p}`;
    };
    const summary = `width ${nEmbd}: bf16-mixed / autocast = ${(b / med('PyTorch autocast bf16')).toFixed(3)} (target <= 0.95), ` +
      `bf16-mixed / PyTorch fp32 = ${(b / med('PyTorch fp32')).toFixed(3)} (target <= 0.60); full checkpointing slowdown ` +
      `${slow('full', 'fp32')}, ${slow('full', 'bf16-mixed')} (target <= 1.35); selective slowdown ` +
      `${slow('selective', 'fp32')}, ${slow('selective', 'bf16-mixed')} (target <= 1.10); ` +
      `activation memory (fp32) none ${mem['fp32']!.toFixed(0)}, full ${mem['fp32 + full checkpointing']!.toFixed(0)} ` +
      `(${(mem['fp32 + full checkpointing']! / mem['fp32']!).toFixed(2)} of none; the 1/3 target is for nLayer=8, test/checkpointing_activation_memory.test.ts), ` +
      `selective ${mem['fp32 + selective checkpointing']!.toFixed(0)} MiB`;
    return { rows, summary };
  } finally {
    peer.close();
    rmSync(dir, { recursive: true, force: true });
  }
}

async function main(): Promise<void> {
  const { values: a } = parseArgs({ options: { widths: { type: 'string', default: '256,512' }, steps: { type: 'string', default: '3' }, rounds: { type: 'string', default: '4' }, warmup: { type: 'string', default: '2' }, 'no-write': { type: 'boolean', default: false } } });
  setNumThreads(1);
  const load0 = os.loadavg()[0]!;
  const rows: string[] = [], summaries: string[] = [];
  const group = initProcessGroup(); // a world of one: the single-process path of flotilla train
  for (const w of a.widths.split(',').map(Number)) {
    const r = await width(group, w, Number(a.steps), Number(a.rounds), Number(a.warmup));
    rows.push(...r.rows);
    summaries.push(r.summary);
    console.log(r.summary);
  }
  const table = ['| width | run | step (median) | CPU time per step (median) | / autocast bf16 | / PyTorch fp32 | activation memory (peak RSS) |', '|---:|---|---:|---:|---:|---:|---:|', ...rows].join('\n');
  console.log(table);
  if (!a['no-write']) {
    writeSection('precision', [
      '## bf16-mixed precision and activation checkpointing vs PyTorch autocast',
      '',
      `GPT, 4 layers, 8 heads, vocab 256, batch ${BATCH} x ${SEQ}, forward + backward + AdamW, one intra-op thread each, single process. ` +
        'PyTorch runs bench/step.py\'s model in float32 and under `torch.autocast(\'cpu\', dtype=torch.bfloat16)`; flotilla runs the ' +
        'single-process path of `flotilla train` (flat buckets, AdamW over them) with `precision` and `activationCheckpoint`. ' +
        `Both alternate in ${a.rounds} rounds of ${a.steps} timed steps per mode (each after one untimed step) after ${a.warmup} warmup steps; medians. libtorch ${torchVersion()}.`,
      '',
      `Reproduce: \`node --import tsx bench/precision.ts --widths ${a.widths} --steps ${a.steps} --rounds ${a.rounds} --warmup ${a.warmup}\`.`,
      '',
      'CPU time per step is this process\'s own (user + system, one intra-op thread): the checkpointing slowdowns are also given as its ratios, which waiting for a core on a loaded machine inflates less than wall time (cache and core sharing still do).',
      '',
      `Load average of the machine (1 min) at the start and the end of this run: ${load0.toFixed(1)} and ${os.loadavg()[0]!.toFixed(1)} on ${os.cpus().length} cores.`,
      '',
      'Activation memory: peak resident memory (VmHWM, read from outside) of a child training 3 steps in that mode, minus the ' +
        'same model\'s peak at batch 1 x 8, every child with the default allocator (the tensor cache: freed blocks are kept for the next ' +
        'step by size class, so the peak follows what a mode holds at once, not a fragmented heap). The machine is shared with other work: compare ratios, not absolute numbers.',
      '',
      table,
      '',
      ...summaries.map((s) => `- ${s}`),
    ].join('\n'));
    console.log('wrote the precision section of docs/BENCHMARKS.md');
  }
}

main().catch((e) => {
  console.error(e instanceof Error ? e.message : e);
  process.exit(1);
});
