// Benchmark: the Llama's training step (forward + backward + AdamW) against the PyTorch reference
// Llama (bench/llama_peer.py, transformers' eager computation) on the same shapes, weights and batch,
// one intra-op thread each, single process: float32 against float32, bf16-mixed against
// torch.autocast('cpu', bfloat16). Both sides alternate step by step; a process pair's ratio is the
// median over pairs of adjacent steps, and the reported ratio the median over `--processes` fresh
// pairs of processes, one after another (this machine runs a whole process at one of two speeds:
// [Note: two speeds] below).
//
//   node --import tsx bench/llama.ts [--width 256] [--steps 3] [--rounds 4] [--warmup 2] [--processes 5] [--no-write]
//
// Writes its section of docs/BENCHMARKS.md (between <!-- llama:begin --> and <!-- llama:end -->).
import { spawn } from 'node:child_process';
import os from 'node:os';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { randint, manualSeed, setNumThreads, tidy, torchVersion } from '../src/tensor/index.js';
import { Llama, type LlamaConfig } from '../src/models/llama.js';
import { llamaCriterion } from '../src/models/llama_parallel.js';
import { AdamW, type AdamWOptions } from '../src/optim/index.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { initProcessGroup } from '../src/distributed/process_group.js';
import { saveSafetensors } from '../src/checkpoint/safetensors.js';
import { autocast, type Precision } from '../src/nn/precision.js';
import { PythonPeer, median, writeSection, parseBench } from './report.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..');
const BATCH = 8, SEQ = 128;
const ADAMW: AdamWOptions = { lr: 3e-4, betas: [0.9, 0.95], eps: 1e-8, weightDecay: 0.1 };

/** The PyTorch reference Llama (bench/llama_peer.py) on flotilla's initial weights. */
class Peer extends PythonPeer {
  constructor(init: string, cfg: LlamaConfig) {
    super(join(ROOT, 'bench', 'llama_peer.py'), [init, JSON.stringify({ ...cfg, adamw: ADAMW })]);
  }
  /** Wall and CPU seconds of each of n steps. */
  async steps(n: number, mode: 'fp32' | 'bf16'): Promise<{ wall: number[]; cpu: number[] }> {
    const r = await this.ask({ steps: n, mode });
    return { wall: r.times as number[], cpu: r.cpu as number[] };
  }
}

type Series = { wall: number[]; cpu: number[] };
/** What one pair of processes measured: every timed step of each side, and each adjacent pair's ratio (flotilla over PyTorch). */
interface PairResult { cfg: LlamaConfig; torch: string; times: Record<string, Series>; ratios: Record<string, Series> }
const MODES = [['flotilla fp32', 'PyTorch fp32', 'fp32', 'fp32'], ['flotilla bf16-mixed', 'PyTorch autocast bf16', 'bf16-mixed', 'bf16']] as const;

/** One pair of processes: this one runs flotilla, its child the PyTorch reference. */
async function measurePair(nEmbd: number, steps: number, rounds: number, warmup: number): Promise<PairResult> {
  setNumThreads(1);
  manualSeed(0);
  const model = new Llama({ vocabSize: 256, blockSize: SEQ, nLayer: 4, nHead: 8, nKvHead: 2, nEmbd }, { initSeed: 0 });
  const cfg = model.cfg;
  const idx = randint(0, 256, [BATCH, SEQ]);
  const targets = randint(0, 256, [BATCH, SEQ]);
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-bench-llama-'));
  const init = join(dir, 'init.safetensors');
  saveSafetensors(init, { ...Object.fromEntries(model.namedParameters()), idx, targets });
  const peer = new Peer(init, cfg);
  try {
    const ready = await peer.next();
    // The single-process path of `flotilla train`: flat buckets, AdamW over them.
    const group = initProcessGroup();
    const dp = new DataParallel(model, { group });
    const opt = new AdamW(model.parameters(), ADAMW, { grads: dp });
    const loss0 = tidy(() => llamaCriterion(model.call(idx), targets).item());
    if (Math.abs(loss0 - ready.loss0) > 1e-4 * Math.abs(ready.loss0)) throw new Error(`the two models differ: loss ${loss0} against PyTorch's ${ready.loss0}`);
    const ours = async (n: number, precision: Precision, untimedFirst: boolean): Promise<Series> => {
      const out: Series = { wall: [], cpu: [] };
      for (let i = untimedFirst ? -1 : 0; i < n; i++) {
        await new Promise((r) => setImmediate(r));
        const c0 = process.cpuUsage();
        const t0 = performance.now();
        tidy(() => {
          opt.zeroGrad();
          autocast(precision, () => {
            const loss = llamaCriterion(dp.forward(idx), targets);
            loss.backward();
            dp.finishGradSync();
            loss.item();
          });
          opt.step();
        });
        if (i < 0) continue;
        out.wall.push((performance.now() - t0) / 1e3);
        const c = process.cpuUsage(c0);
        out.cpu.push((c.user + c.system) / 1e6);
      }
      return out;
    };
    // Pairs of adjacent steps, one on each side, in alternating order: this machine's speed drifts by
    // tens of percent within seconds, which a ratio of two steps a few hundred milliseconds apart
    // mostly cancels and a ratio of medians taken over different seconds does not.
    const times: Record<string, Series> = {}, ratios: Record<string, Series> = {};
    const add = (m: Record<string, Series>, k: string, xs: Series) => {
      const t = m[k] ?? { wall: [], cpu: [] };
      m[k] = { wall: [...t.wall, ...xs.wall], cpu: [...t.cpu, ...xs.cpu] };
    };
    await ours(warmup, 'fp32', false);
    await ours(warmup, 'bf16-mixed', false);
    await peer.steps(warmup, 'fp32');
    await peer.steps(warmup, 'bf16');
    for (let r = 0; r < rounds; r++) {
      for (const [fk, pk, prec, mode] of r % 2 ? [...MODES].reverse() : MODES) {
        // The first step of each mode in a round is untimed on both sides: it follows the other mode's steps.
        await ours(0, prec, true);
        await peer.steps(1, mode);
        for (let s = 0; s < steps; s++) {
          const first = (r + s) % 2 === 0;
          const f = first ? await ours(1, prec, false) : undefined;
          const p = await peer.steps(1, mode);
          const f2 = f ?? await ours(1, prec, false);
          add(times, fk, f2);
          add(times, pk, p);
          add(ratios, fk, { wall: [f2.wall[0]! / p.wall[0]!], cpu: [f2.cpu[0]! / p.cpu[0]!] });
        }
      }
    }
    opt.dispose();
    dp.dispose();
    return { cfg, torch: ready.torch, times, ratios };
  } finally {
    peer.close();
    rmSync(dir, { recursive: true, force: true });
  }
}

/** measurePair in a fresh process (this script with --child). */
function pairInChild(args: string[]): Promise<PairResult> {
  return new Promise((res, rej) => {
    const c = spawn(process.execPath, ['--import', 'tsx', fileURLToPath(import.meta.url), '--child', ...args], { cwd: ROOT, stdio: ['ignore', 'pipe', 'inherit'] });
    let out = '';
    c.stdout.on('data', (d: Buffer) => (out += d.toString()));
    c.on('error', rej);
    c.on('exit', (code) => (code === 0 ? res(parseBench<PairResult>(out)) : rej(new Error(`a benchmark process exited ${code}:\n${out}`))));
  });
}

async function main(): Promise<void> {
  const { values: a } = parseArgs({ options: { width: { type: 'string', default: '256' }, steps: { type: 'string', default: '3' }, rounds: { type: 'string', default: '4' }, warmup: { type: 'string', default: '2' }, processes: { type: 'string', default: '5' }, child: { type: 'boolean', default: false }, 'no-write': { type: 'boolean', default: false } } });
  const nEmbd = Number(a.width), steps = Number(a.steps), rounds = Number(a.rounds), warmup = Number(a.warmup), processes = Number(a.processes);
  if (a.child) {
    console.log(`BENCH ${JSON.stringify(await measurePair(nEmbd, steps, rounds, warmup))}`);
    return;
  }
  if (!(processes >= 1)) throw new Error(`--processes must be at least 1, not ${a.processes}`);
  const load0 = os.loadavg()[0]!;
  // [Note: two speeds] On this machine a flotilla process runs the same step at one of two speeds,
  // the slower 1.2-1.9x, for most of its life, and PyTorch's processes have slow steps and slow hours
  // of their own (docs/BENCHMARKS.md, below the table): one pair of processes measures which speeds
  // its two processes drew. The pairs run one after another, each a fresh flotilla process and a
  // fresh PyTorch peer, and the ratio is their median.
  const pairs: PairResult[] = [];
  for (let k = 0; k < processes; k++) {
    const r = await pairInChild(['--width', String(nEmbd), '--steps', String(steps), '--rounds', String(rounds), '--warmup', String(warmup)]);
    pairs.push(r);
    console.log(`process pair ${k + 1}/${processes}: ${MODES.map(([f, p]) => `${f} ${(median(r.times[f]!.wall) * 1e3).toFixed(1)} ms, ${p} ${(median(r.times[p]!.wall) * 1e3).toFixed(1)} ms, ratio ${median(r.ratios[f]!.wall).toFixed(3)}`).join('; ')}`);
  }
  const { cfg, torch } = pairs[0]!;
  const all = (k: string, w: 'wall' | 'cpu') => pairs.flatMap((r) => r.times[k]![w]);
  const perPair = (f: string, w: 'wall' | 'cpu') => pairs.map((r) => median(r.ratios[f]![w]));
  const ms = (s: number) => (s * 1e3).toFixed(1);
  const rows = [['float32', 'flotilla fp32', 'PyTorch fp32', '<= 1.0'], ['bf16-mixed / autocast bf16', 'flotilla bf16-mixed', 'PyTorch autocast bf16', '<= 0.95']] as const;
  const pr = (f: string) => median(perPair(f, 'wall')), cpr = (f: string) => median(perPair(f, 'cpu'));
  const table = [
    '| precision | flotilla step | PyTorch step | ratio (median over process pairs) | each pair\'s ratio (median of its adjacent steps) | flotilla CPU time | PyTorch CPU time | CPU ratio | target |',
    '|---|---:|---:|---:|---|---:|---:|---:|---:|',
    ...rows.map(([what, f, p, target]) => `| ${what} | ${ms(median(all(f, 'wall')))} ms | ${ms(median(all(p, 'wall')))} ms | ${pr(f).toFixed(3)} | ${perPair(f, 'wall').map((x) => x.toFixed(3)).join(', ')} | ${ms(median(all(f, 'cpu')))} ms | ${ms(median(all(p, 'cpu')))} ms | ${cpr(f).toFixed(3)} | ${target} |`),
  ].join('\n');
  const ratio = (f: string) => `${pr(f).toFixed(3)}x (CPU time ${cpr(f).toFixed(3)}x)`;
  const summary = `Llama width ${nEmbd}: float32 ${ratio('flotilla fp32')} PyTorch (target <= 1.0), bf16-mixed ${ratio('flotilla bf16-mixed')} autocast (target <= 0.95), median over ${processes} process pairs`;
  console.log(summary);
  console.log(table);
  if (a['no-write']) return;
  writeSection('llama', [
    '## Llama step time vs the PyTorch reference Llama',
    '',
    `Llama, ${cfg.nLayer} layers, ${cfg.nHead} query heads sharing ${cfg.nKvHead} key/value heads of ${cfg.headDim}, width ${cfg.nEmbd}, SwiGLU ${cfg.intermediateSize}, ` +
      `vocab ${cfg.vocabSize}, untied, batch ${BATCH} x ${SEQ}; forward + backward + AdamW, one intra-op thread each, single process. ` +
      'PyTorch runs bench/llama_peer.py (the computation of transformers\' LlamaForCausalLM with eager attention: float32 RMSNorm and rotary tables, ' +
      'rotate_half, repeat_kv, an additive causal mask, softmax in float32) in float32 and under `torch.autocast(\'cpu\', dtype=torch.bfloat16)`; ' +
      'flotilla runs src/models/llama.ts on the single-process path of `flotilla train` (flat buckets, AdamW over them) with `precision` fp32 and bf16-mixed. ' +
      `Same weights and batch (the first losses agree). ${processes} pairs of processes, one after another, each a fresh flotilla process and a fresh PyTorch peer. ` +
      `In each pair, after ${warmup} warmup steps, ${rounds} rounds; in each round, per mode, one untimed step on each side, then ` +
      `${steps} pairs of adjacent steps, one on each side, alternating which goes first; the pair's ratio is the median over those of flotilla's step over ` +
      `PyTorch's (this machine's speed drifts by tens of percent within seconds, which two steps a few hundred milliseconds apart share). ` +
      `The ratio is the median over the process pairs (a flotilla process runs at one of two speeds, below); step times are medians over all pairs' steps. ` +
      `libtorch ${torchVersion()}, PyTorch ${torch}.`,
    '',
    `Reproduce: \`node --import tsx bench/llama.ts --width ${nEmbd} --steps ${steps} --rounds ${rounds} --warmup ${warmup} --processes ${processes}\`.`,
    '',
    'Step times are medians of wall time; CPU time is each process\'s own (user + system) per step, which waiting for a core on a loaded machine inflates much less.',
    '',
    `Load average of the machine (1 min) at the start and the end of this run: ${load0.toFixed(1)} and ${os.loadavg()[0]!.toFixed(1)} on ${os.cpus().length} cores.`,
    '',
    table,
    '',
    summary,
  ].join('\n'));
}

await main();
