// Benchmark: the Llama's training step (forward + backward + AdamW) against the PyTorch reference
// Llama (bench/llama_peer.py, transformers' eager computation) on the same shapes, weights and batch,
// one intra-op thread each, single process: float32 against float32, and where the CPU has native
// bfloat16 (or with --bf16) bf16-mixed against torch.autocast('cpu', bfloat16). flotilla runs with its
// fused kernels and with the eager ones (--kernels; [Note: kernel choice] in src/nn/kernels/choice.ts).
// The variants alternate step by step; a process pair's ratio is the median over groups of adjacent
// steps, and the reported ratio the median over `--processes` fresh
// pairs of processes, one after another (this machine runs a whole process at one of two speeds:
// [Note: two speeds] below).
//
// With --lora R both sides fine-tune instead: flotilla's applyLora (src/nn/lora.ts, rank R, alpha 16,
// every Linear but the head) and the peer's own LoRA layer around nn.Linear, each with its base
// frozen and AdamW over the adapters only; B starts nonzero so that the first losses' agreement
// checks the adapters too.
//
//   node --import tsx bench/llama.ts [--width 256] [--layers 4] [--kv-heads 2] [--lora 0] [--kernels fused|eager|both] [--bf16] [--steps 3] [--rounds 4] [--warmup 2] [--processes 5] [--no-write]
//
// Writes its section of docs/BENCHMARKS.md (between <!-- llama:begin --> and <!-- llama:end -->, or
// <!-- lora-step:begin --> and <!-- lora-step:end --> with --lora).
import { spawn } from 'node:child_process';
import os from 'node:os';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { randint, randn, manualSeed, noGrad, setNumThreads, tidy, torchVersion, type Tensor } from '../src/tensor/index.js';
import { withKernels, type KernelChoice } from '../src/nn/kernels/choice.js';
import { Llama, llamaNumParams, type LlamaConfig } from '../src/models/llama.js';
import { llamaCriterion } from '../src/models/llama_parallel.js';
import { AdamW, type AdamWOptions } from '../src/optim/index.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { initProcessGroup } from '../src/distributed/process_group.js';
import { saveSafetensors } from '../src/checkpoint/safetensors.js';
import { autocast, type Precision } from '../src/nn/precision.js';
import { applyLora, withAdaptersDisabled } from '../src/nn/lora.js';
import { PythonPeer, median, writeSection, parseBench, runIfMain } from './report.js';
import { kernelsArg, bf16Plan, stepFlops, gemmRate, gemmShare, singleProcessTrainer, GEMM_SHARE_NOTE } from './step_measure.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..');
const BATCH = 8, SEQ = 128;
export const ADAMW: AdamWOptions = { lr: 3e-4, betas: [0.9, 0.95], eps: 1e-8, weightDecay: 0.1 };
const LORA_ALPHA = 16;

/** The model's shape and, with lora > 0, the adapters' rank (every Linear but the head). */
export interface Shape { nEmbd: number; nLayer: number; nKvHead: number; lora: number }

/** The PyTorch reference Llama (bench/llama_peer.py) on flotilla's initial weights. */
export class Peer extends PythonPeer {
  constructor(init: string, cfg: LlamaConfig, lora: number) {
    super(join(ROOT, 'bench', 'llama_peer.py'), [init, JSON.stringify({ ...cfg, adamw: ADAMW, ...(lora > 0 ? { lora: { rank: lora, alpha: LORA_ALPHA } } : {}) })]);
  }
  /** Wall and CPU seconds of each of n steps. */
  async steps(n: number, mode: 'fp32' | 'bf16'): Promise<{ wall: number[]; cpu: number[] }> {
    const r = await this.ask({ steps: n, mode });
    return { wall: r.times as number[], cpu: r.cpu as number[] };
  }
}

type Series = { wall: number[]; cpu: number[] };
/**
 * What one pair of processes measured: every timed step of each variant ("flotilla fused fp32",
 * "PyTorch fp32", ...), each flotilla variant's ratios to the adjacent PyTorch step, and the machine's
 * GEMM rate (TFLOP/s) at each precision, probed in the flotilla process during the pair.
 */
interface PairResult { cfg: LlamaConfig; torch: string; times: Record<string, Series>; ratios: Record<string, Series>; adapterParams: number; rates: Record<string, number> }
/** A precision a run measures: its label, flotilla's precision, the peer's mode and the GEMM probe's dtype. */
interface Mode { label: string; precision: Precision; peer: 'fp32' | 'bf16'; dtype: 'float32' | 'bfloat16' }
const FP32: Mode = { label: 'fp32', precision: 'fp32', peer: 'fp32', dtype: 'float32' };
const BF16: Mode = { label: 'bf16-mixed', precision: 'bf16-mixed', peer: 'bf16', dtype: 'bfloat16' };
/**
 * The precisions a run measures: float32, and bf16-mixed where the CPU has native bfloat16 (or with
 * --bf16; step_measure.ts's bf16Plan); a LoRA run float32 only, since on a CPU without native bfloat16
 * a bf16 step of the LoRA bench's larger model takes tens of seconds, mostly conversions.
 */
const modesOf = (shape: Shape, bf16: boolean): Mode[] => (shape.lora > 0 || !bf16 ? [FP32] : [FP32, BF16]);
const flotillaKey = (k: KernelChoice, m: Mode) => `flotilla ${k} ${m.label}`;
const peerKey = (m: Mode) => `PyTorch ${m.label}`;

/** The batch of the bench's Llama shape. */
export const LLAMA_BATCH = BATCH, LLAMA_SEQ = SEQ;

/** The bench's Llama (its weights from seed 0) and a batch, with the adapters of a LoRA shape. */
export function llamaBench(shape: Shape, vocabSize = 256): { model: Llama; idx: Tensor; targets: Tensor; adapterParams: number } {
  manualSeed(0);
  const { nEmbd, nLayer, nKvHead, lora } = shape;
  const model = new Llama({ vocabSize, blockSize: SEQ, nLayer, nHead: 8, nKvHead, nEmbd }, { initSeed: 0 });
  let adapterParams = 0;
  if (lora > 0) {
    const { adapters } = applyLora(model, { rank: lora, alpha: LORA_ALPHA, targets: ['all-linear'], initSeed: 0 });
    // A nonzero B (PEFT starts it at zero), so that the first losses agree only if the adapters compute the same.
    noGrad(() => { for (const a of adapters.values()) a.B.weight.copy_(randn(a.B.weight.shape).mul(0.1)); });
    for (const a of adapters.values()) adapterParams += a.A.weight.numel() + a.B.weight.numel();
  }
  const idx = randint(0, vocabSize, [BATCH, SEQ]);
  const targets = randint(0, vocabSize, [BATCH, SEQ]);
  return { model, idx, targets, adapterParams };
}

/** One pair of processes: this one runs flotilla (each of `kernels`), its child the PyTorch reference. */
async function measurePair(shape: Shape, kernels: KernelChoice[], bf16: boolean, steps: number, rounds: number, warmup: number): Promise<PairResult> {
  setNumThreads(1);
  const { lora } = shape;
  const { model, idx, targets, adapterParams } = llamaBench(shape);
  const cfg = model.cfg;
  const MODES = modesOf(shape, bf16);
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-bench-llama-'));
  const init = join(dir, 'init.safetensors');
  saveSafetensors(init, { ...Object.fromEntries(model.namedParameters()), idx, targets });
  const peer = new Peer(init, cfg, lora);
  try {
    const ready = await peer.next();
    // The first loss and the first logits (those of the first sequence's first 16 positions) agree.
    const first = () => tidy(() => {
      const out = model.call(idx);
      return { loss: llamaCriterion(out, targets).item(), logits: out.logits.select(0, 0).narrow(0, 0, 16).reshape(-1).toNumbers() };
    });
    const { loss: loss0, logits: logits0 } = first();
    if (Math.abs(loss0 - ready.loss0) > 1e-4 * Math.abs(ready.loss0)) throw new Error(`the two models differ: loss ${loss0} against PyTorch's ${ready.loss0}`);
    const apart = (a: number[], b: number[]) => Math.max(...a.map((x, i) => Math.abs(x - b[i]!)));
    const tol = 1e-4 * Math.max(...(ready.logits0 as number[]).map(Math.abs));
    if (apart(logits0, ready.logits0) > tol) throw new Error(`the two models differ: logits ${apart(logits0, ready.logits0)} apart (tolerance ${tol})`);
    if (lora > 0) {
      // The logits move far more under the adapters than the agreement's tolerance, or it would not check them.
      const moved = apart(logits0, withAdaptersDisabled(model, first).logits);
      if (!(moved > 100 * tol)) throw new Error(`the adapters move the first logits by ${moved} only, too little for their agreement (within ${tol}) to check them`);
    }
    const trainer = singleProcessTrainer(model, idx, targets, ADAMW);
    const ours = async (n: number, m: Mode, k: KernelChoice): Promise<Series> => {
      const out: Series = { wall: [], cpu: [] };
      for (let i = 0; i < n; i++) {
        const [wall, cpu] = await trainer.step(m.precision, k);
        out.wall.push(wall);
        out.cpu.push(cpu);
      }
      return out;
    };
    // Adjacent steps, one of each variant, in an order rotating step by step: this machine's speed
    // drifts by tens of percent within seconds, which a ratio of steps a few hundred milliseconds apart
    // mostly cancels and a ratio of medians taken over different seconds does not.
    const times: Record<string, Series> = {}, ratios: Record<string, Series> = {};
    const add = (m: Record<string, Series>, k: string, xs: Series) => {
      const t = m[k] ?? { wall: [], cpu: [] };
      m[k] = { wall: [...t.wall, ...xs.wall], cpu: [...t.cpu, ...xs.cpu] };
    };
    const variants: (KernelChoice | 'PyTorch')[] = [...kernels, 'PyTorch'];
    const one = (v: KernelChoice | 'PyTorch', m: Mode, n = 1): Promise<Series> => (v === 'PyTorch' ? peer.steps(n, m.peer) : ours(n, m, v));
    for (const m of MODES) for (const v of variants) await one(v, m, warmup);
    const rates: Record<string, number> = Object.fromEntries(MODES.map((m) => [m.label, gemmRate(m.dtype)]));
    for (let r = 0; r < rounds; r++) {
      for (const m of r % 2 ? [...MODES].reverse() : MODES) {
        // The first step of each variant in a round is untimed: it follows the other mode's steps.
        for (const v of variants) await one(v, m);
        for (let s = 0; s < steps; s++) {
          const got = new Map<string, Series>();
          for (let i = 0; i < variants.length; i++) {
            const v = variants[(i + r + s) % variants.length]!;
            got.set(v, await one(v, m));
          }
          const p = got.get('PyTorch')!;
          add(times, peerKey(m), p);
          for (const k of kernels) {
            const f = got.get(k)!;
            add(times, flotillaKey(k, m), f);
            add(ratios, flotillaKey(k, m), { wall: [f.wall[0]! / p.wall[0]!], cpu: [f.cpu[0]! / p.cpu[0]!] });
          }
        }
      }
    }
    for (const m of MODES) rates[m.label] = Math.max(rates[m.label]!, gemmRate(m.dtype));
    trainer.dispose();
    return { cfg, torch: ready.torch, times, ratios, adapterParams, rates };
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
  const { values: a } = parseArgs({ options: { width: { type: 'string', default: '256' }, layers: { type: 'string', default: '4' }, 'kv-heads': { type: 'string', default: '2' }, lora: { type: 'string', default: '0' }, kernels: { type: 'string', default: 'both' }, bf16: { type: 'boolean', default: false }, steps: { type: 'string', default: '3' }, rounds: { type: 'string', default: '4' }, warmup: { type: 'string', default: '2' }, processes: { type: 'string', default: '5' }, child: { type: 'boolean', default: false }, 'no-write': { type: 'boolean', default: false } } });
  const shape: Shape = { nEmbd: Number(a.width), nLayer: Number(a.layers), nKvHead: Number(a['kv-heads']), lora: Number(a.lora) };
  const steps = Number(a.steps), rounds = Number(a.rounds), warmup = Number(a.warmup), processes = Number(a.processes);
  const kernels = kernelsArg(a.kernels);
  const bf16 = bf16Plan(a.bf16!);
  if (a.child) {
    console.log(`BENCH ${JSON.stringify(await measurePair(shape, kernels, bf16.measure, steps, rounds, warmup))}`);
    return;
  }
  if (!(processes >= 1)) throw new Error(`--processes must be at least 1, not ${a.processes}`);
  if (!(Number.isInteger(shape.lora) && shape.lora >= 0)) throw new Error(`--lora must be a rank (0 = a full fine-tune), not ${a.lora}`);
  const lora = shape.lora > 0;
  const MODES = modesOf(shape, bf16.measure);
  const load0 = os.loadavg()[0]!;
  // [Note: two speeds] On this machine a flotilla process runs the same step at one of two speeds,
  // the slower 1.2-1.9x, for most of its life, and PyTorch's processes have slow steps and slow hours
  // of their own (docs/BENCHMARKS.md, below the table; bench/speeds.ts measures it): one pair of
  // processes measures which speeds its two processes drew. The pairs run one after another, each a
  // fresh flotilla process and a fresh PyTorch peer, and the ratio is their median.
  const args = ['--width', String(shape.nEmbd), '--layers', String(shape.nLayer), '--kv-heads', String(shape.nKvHead), '--lora', String(shape.lora), '--kernels', a.kernels!, ...(a.bf16 ? ['--bf16'] : []), '--steps', String(steps), '--rounds', String(rounds), '--warmup', String(warmup)];
  const pairs: PairResult[] = [];
  const ms = (s: number) => (s * 1e3).toFixed(1);
  for (let k = 0; k < processes; k++) {
    const r = await pairInChild(args);
    pairs.push(r);
    console.log(`process pair ${k + 1}/${processes}: ${MODES.map((m) => [...kernels.map((kc) => `${flotillaKey(kc, m)} ${ms(median(r.times[flotillaKey(kc, m)]!.wall))} ms (ratio ${median(r.ratios[flotillaKey(kc, m)]!.wall).toFixed(3)})`), `${peerKey(m)} ${ms(median(r.times[peerKey(m)]!.wall))} ms`].join(', ')).join('; ')}`);
  }
  const { cfg, torch } = pairs[0]!;
  const all = (k: string, w: 'wall' | 'cpu') => pairs.flatMap((r) => r.times[k]![w]);
  const perPair = (f: string, w: 'wall' | 'cpu') => pairs.map((r) => median(r.ratios[f]![w]));
  const pr = (f: string) => median(perPair(f, 'wall')), cpr = (f: string) => median(perPair(f, 'cpu'));
  const flops = stepFlops(['--model.arch=llama', `--model.vocabSize=${cfg.vocabSize}`, `--model.blockSize=${cfg.blockSize}`, `--model.nLayer=${cfg.nLayer}`, `--model.nHead=${cfg.nHead}`, `--model.nKvHead=${cfg.nKvHead}`, `--model.nEmbd=${cfg.nEmbd}`, `--model.intermediateSize=${cfg.intermediateSize}`, `--data.seqLen=${SEQ}`], BATCH * SEQ);
  const rate = (m: Mode) => median(pairs.map((r) => r.rates[m.label]!));
  const target = (k: KernelChoice, m: Mode) => (k === 'fused' ? '<= 0.80' : m === FP32 ? '<= 1.0' : '<= 0.95');
  const rows = MODES.flatMap((m) => [
    ...kernels.map((k) => {
      const f = flotillaKey(k, m), step = median(all(f, 'wall'));
      return `| ${m.label} | flotilla ${k} | ${ms(step)} ms | ${pr(f).toFixed(3)} | ${perPair(f, 'wall').map((x) => x.toFixed(3)).join(', ')} | ${ms(median(all(f, 'cpu')))} ms | ${cpr(f).toFixed(3)} | ${gemmShare(flops, step, rate(m)).toFixed(0)}% | ${target(k, m)} |`;
    }),
    `| ${m.label} | PyTorch${m === BF16 ? ' (autocast bf16)' : ''} | ${ms(median(all(peerKey(m), 'wall')))} ms | 1 | | ${ms(median(all(peerKey(m), 'cpu')))} ms | 1 | ${gemmShare(flops, median(all(peerKey(m), 'wall')), rate(m)).toFixed(0)}% | |`,
  ]);
  const table = [
    '| precision | variant | step | ratio to PyTorch (median over process pairs) | each pair\'s ratio (median of its adjacent steps) | CPU time | CPU ratio | GEMM share | target |',
    '|---|---|---:|---:|---|---:|---:|---:|---:|',
    ...rows,
  ].join('\n');
  const rates = MODES.map((m) => `${m.label} ${(rate(m) * 1e3).toFixed(1)} GFLOP/s`).join(', ');
  const what = lora ? `LoRA rank ${shape.lora} step, Llama width ${shape.nEmbd} x ${shape.nLayer} layers` : `Llama width ${shape.nEmbd}`;
  const summary = `${what}, median over ${processes} process pairs: ${MODES.flatMap((m) => kernels.map((k) => `${m.label} ${k} ${pr(flotillaKey(k, m)).toFixed(3)}x (CPU time ${cpr(flotillaKey(k, m)).toFixed(3)}x, target ${target(k, m)})`)).join(', ')} PyTorch's step`;
  console.log(summary);
  console.log(`torch.matmul (median over the pairs): ${rates}; the step ${(flops / 1e9).toFixed(2)} GFLOP; ${bf16.note}`);
  console.log(table);
  if (a['no-write']) return;
  const reproduce = `node --import tsx bench/llama.ts --width ${shape.nEmbd}${shape.nLayer !== 4 ? ` --layers ${shape.nLayer}` : ''}${shape.nKvHead !== 2 ? ` --kv-heads ${shape.nKvHead}` : ''}${lora ? ` --lora ${shape.lora}` : ''} --kernels ${a.kernels}${a.bf16 ? ' --bf16' : ''} --steps ${steps} --rounds ${rounds} --warmup ${warmup} --processes ${processes}`;
  const model = `Llama, ${cfg.nLayer} layers, ${cfg.nHead} query heads sharing ${cfg.nKvHead} key/value heads of ${cfg.headDim}, width ${cfg.nEmbd}, SwiGLU ${cfg.intermediateSize}, ` +
    `vocab ${cfg.vocabSize}, untied${lora ? ` (${(llamaNumParams(cfg) / 1e6).toFixed(1)}M parameters)` : ''}, batch ${BATCH} x ${SEQ}`;
  const kernelsText = kernels.length === 2 ? 'with its fused kernels and with the eager (op-by-op) ones' : `with its ${kernels[0]} kernels`;
  const method = `${processes} pairs of processes, one after another, each a fresh flotilla process and a fresh PyTorch peer. ` +
    `In each pair, after ${warmup} warmup steps, ${rounds} rounds; in each round, per precision, one untimed step of each variant, then ` +
    `${steps} groups of adjacent steps, one of each variant (${[...kernels.map((k) => `flotilla ${k}`), 'PyTorch'].join(', ')}), in an order rotating from group to group; ` +
    'a flotilla variant\'s ratio in the pair is the median over the groups of its step over PyTorch\'s ' +
    `(this machine's speed drifts by tens of percent within seconds, which steps a few hundred milliseconds apart share). ` +
    `The ratio is the median over the process pairs (a flotilla process runs at one of two speeds, ${lora ? 'the Llama section above' : 'below'}); step times are medians over all pairs' steps. ` +
    `libtorch ${torchVersion()}, PyTorch ${torch}. ${bf16.note}.`;
  const head = lora ? [
    '## LoRA fine-tuning: step time vs PyTorch',
    '',
    `${model}; LoRA rank ${shape.lora}, alpha ${LORA_ALPHA}, on every Linear but the output head (q, k, v, o, gate, up, down: ` +
      `${(pairs[0]!.adapterParams / 1e3).toFixed(0)}K adapter parameters); forward + backward + AdamW over the adapters only, one intra-op thread each, single process. ` +
      'flotilla runs `applyLora` (src/nn/lora.ts: the adapter attached to the Linear in place, the base frozen) on src/models/llama.ts, on the single-process path of ' +
      `\`flotilla train\` (flat buckets holding the adapters only, AdamW over them), in float32, ${kernelsText}. PyTorch runs bench/llama_peer.py (the Llama section's reference Llama) with its own ` +
      'LoRA layer around each nn.Linear (y = W x + alpha / r B(A x), W with requires_grad False, A and B nn.Linear), AdamW over A and B only, in float32. ' +
      'Same weights, adapters and batch: B starts nonzero here (PEFT starts it at zero) so that the first loss and logits, which must agree, check the adapters too. ' +
      'Float32 only: a bf16 step of this model on a CPU without native bfloat16 takes tens of seconds, mostly conversions. ' +
      'The GEMM share counts the whole model\'s 6 N as for full training although the frozen base\'s weight gradients are not computed (its weights cost 4 FLOPs per token, not 6): it overstates the share. ' +
      method,
  ] : [
    '## Llama step time vs the PyTorch reference Llama',
    '',
    `${model}; forward + backward + AdamW, one intra-op thread each, single process. ` +
      'PyTorch runs bench/llama_peer.py (the computation of transformers\' LlamaForCausalLM with eager attention: float32 RMSNorm and rotary tables, ' +
      'rotate_half, repeat_kv, an additive causal mask, softmax in float32) in float32 (and under `torch.autocast(\'cpu\', dtype=torch.bfloat16)` where bf16-mixed is measured); ' +
      `flotilla runs src/models/llama.ts on the single-process path of \`flotilla train\` (flat buckets, AdamW over them) ${kernelsText} ([Note: kernel choice] in src/nn/kernels/choice.ts). ` +
      `Same weights and batch (the first losses agree). ${method}`,
  ];
  writeSection(lora ? 'lora-step' : 'llama', [
    ...head,
    '',
    `Reproduce: \`${reproduce}\`.`,
    '',
    'Step times are medians of wall time; CPU time is each process\'s own (user + system) per step, which waiting for a core on a loaded machine inflates much less.',
    '',
    GEMM_SHARE_NOTE,
    '',
    `Load average of the machine (1 min) at the start and the end of this run: ${load0.toFixed(1)} and ${os.loadavg()[0]!.toFixed(1)} on ${os.cpus().length} cores. torch.matmul (median over the pairs): ${rates}; the step ${(flops / 1e9).toFixed(2)} GFLOP.`,
    '',
    table,
    '',
    summary,
  ].join('\n'));
}

runIfMain(import.meta.url, main);
