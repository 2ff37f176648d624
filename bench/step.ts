// Benchmark: one GPT training step (forward, backward, AdamW) in flotilla and in PyTorch, in the same
// run, on the same weights and batch, one intra-op thread each. flotilla runs with its fused kernels
// and with the eager (op-by-op) ones ([Note: kernel choice] in src/nn/kernels/choice.ts), PyTorch 1.13
// eager. The variants alternate in rounds, in a rotating order, so that all see the same machine; warmup
// steps are excluded; the report is each one's median step time, its ratio to PyTorch's, a forward /
// backward / optimizer breakdown and the share of the machine's GEMM rate the step reaches.
//
//   node --import tsx bench/step.ts [--shape demo|bench|25m] [--kernels fused|eager|both] [--steps 5] [--rounds 6] [--warmup 3] [--bf16] [--no-yield] [--no-write]
//
// Shapes: demo = examples/gpt-tiny.toml's model and global batch (16 x 128 on one process); bench (the
// default) = STEP_CONFIG below, batch 8 x 128; 25m = docs/BENCHMARKS.md's planner 25M GPT (8 blocks,
// width 512, 8 heads, the demo's BPE-512 vocabulary, context 128), batch 8 x 128. Float32; bf16-mixed
// (against torch.autocast) too on a CPU with native bfloat16, or with --bf16.
//
// Writes its section of docs/BENCHMARKS.md (<!-- step:begin --> for the bench shape, <!-- step-demo:begin -->
// and <!-- step-25m:begin --> for the others).
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir, cpus, loadavg } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { PerformanceObserver, type PerformanceEntry } from 'node:perf_hooks';
import { randint, manualSeed, setNumThreads, getNumThreads, tidy, noGrad, torchVersion, describeBlas } from '../src/tensor/index.js';
import { GPT, type GPTConfig } from '../src/models/gpt.js';
import { AdamW, type AdamWOptions } from '../src/optim/index.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { initProcessGroup } from '../src/distributed/process_group.js';
import { saveSafetensors } from '../src/checkpoint/safetensors.js';
import { parseConfig } from '../src/config/index.js';
import { loadTokenizer } from '../src/data/tokenizer.js';
import { autocast, type Precision } from '../src/nn/precision.js';
import { withKernels, type KernelChoice } from '../src/nn/kernels/choice.js';
import { PythonPeer, median, writeSection, runIfMain } from './report.js';
import { kernelsArg, bf16Plan, stepFlops, gemmRate, gemmShare, GEMM_SHARE_NOTE } from './step_measure.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..');

export const STEP_CONFIG: GPTConfig = {
  vocabSize: 256, blockSize: 128, nLayer: 4, nHead: 8, nEmbd: 256, dropout: 0, bias: true, tieEmbeddings: false,
};
const ADAMW: AdamWOptions = { lr: 3e-4, betas: [0.9, 0.95], eps: 1e-8, weightDecay: 0.1 };

export type ShapeName = 'demo' | 'bench' | '25m';
export interface StepShape { cfg: GPTConfig; batch: number; what: string }

/** The model and batch of a --shape. */
export async function stepShape(name: string): Promise<StepShape> {
  if (name === 'bench') return { cfg: STEP_CONFIG, batch: 8, what: 'the step benchmark\'s GPT' };
  if (name === 'demo' || name === '25m') {
    // The demo's config as the CLI reads it, its vocabulary the tokenizer's (model.vocabSize = 0).
    const toml = join(ROOT, 'examples', 'gpt-tiny.toml');
    const demo = parseConfig(readFileSync(toml, 'utf8'), [], toml, dirname(toml));
    const vocabSize = demo.model.vocabSize || (await loadTokenizer(demo.data.tokenizer)).vocabSize;
    const m = demo.model as unknown as GPTConfig;
    const base: GPTConfig = { vocabSize, blockSize: m.blockSize, nLayer: m.nLayer, nHead: m.nHead, nEmbd: m.nEmbd, dropout: 0, bias: m.bias, tieEmbeddings: m.tieEmbeddings };
    if (name === 'demo') return { cfg: base, batch: demo.data.globalBatch, what: 'the demo\'s GPT (examples/gpt-tiny.toml, its global batch on one process)' };
    return { cfg: { ...base, nLayer: 8, nEmbd: 512, nHead: 8, blockSize: 128 }, batch: 8, what: 'the 25M GPT of the planner\'s rows (8 blocks, width 512, 8 heads, the demo\'s vocabulary)' };
  }
  throw new Error(`--shape must be demo, bench or 25m, not ${name}`);
}

/** The --model.* overrides of a GPT config, for the FLOP count. */
export function gptOverrides(c: GPTConfig, seqLen: number): string[] {
  return [`--model.vocabSize=${c.vocabSize}`, `--model.blockSize=${c.blockSize}`, `--model.nLayer=${c.nLayer}`, `--model.nHead=${c.nHead}`,
    `--model.nEmbd=${c.nEmbd}`, `--model.bias=${c.bias}`, `--model.tieEmbeddings=${c.tieEmbeddings}`, `--data.seqLen=${seqLen}`];
}

/**
 * Seconds for [forward (with zeroGrad and the loss), backward, optimizer step (and, for flotilla, freeing the
 * step's temporaries)] (wall) and the step's CPU time (all threads of the process).
 */
type Phases = [number, number, number, number];
type PeerMode = 'fp32' | 'bf16';

/** The PyTorch side (bench/step.py), alive for the whole run: asks for n steps, gets their phase times back. */
export class TorchPeer extends PythonPeer {
  constructor(initPath: string, cfg: GPTConfig) {
    super(join(ROOT, 'bench', 'step.py'), [initPath, JSON.stringify({ ...cfg, adamw: ADAMW })]);
  }
  async steps(n: number, mode: PeerMode = 'fp32'): Promise<Phases[]> {
    return (await this.ask({ steps: n, mode })).times as Phases[];
  }
}

/** What took the eager step below PyTorch's, kept with the bench shape's section. */
const HISTORY = [
  'flotilla runs the single-process path of `flotilla train`: parameters and gradients in flat buckets, AdamW over',
  'each bucket in cache-sized chunks ([Note: update chunks] in src/optim/optimizer.ts; PyTorch 1.13\'s default AdamW',
  'makes about ten kernel calls per parameter). Three things took flotilla\'s eager step from 1.02-1.04x to below PyTorch\'s,',
  'measured one at a time on this machine:',
  '- a forward\'s intermediates are released when its module call returns ([Note: forward scope] in src/nn/module.ts),',
  '  so backward reuses the memory of the activations it has consumed, as in PyTorch: backward 172 -> 156 ms;',
  '- flotilla processes keep freed tensor memory for the next step ([Note: allocator tuning] in',
  '  src/tensor/allocator.ts): glibc\'s defaults had a flotilla step fault in ~7,400 fresh pages (PyTorch: ~900),',
  '  now none in steady state; backward a further 3-5% faster;',
  '- AdamW over 1 MiB chunks instead of whole buckets: 6.1 -> 5.0 ms over a 13 MB bucket.',
  'V8 learns the native bytes of a tensor only when it may outlive its scope ([Note: external memory] in',
  'src/tensor/scope.ts), so the activations a step frees again do not drive garbage collections.',
].join('\n');

async function main(): Promise<void> {
  const { values: a } = parseArgs({
    options: {
      shape: { type: 'string', default: 'bench' }, kernels: { type: 'string', default: 'both' }, bf16: { type: 'boolean', default: false },
      'no-yield': { type: 'boolean', default: false }, steps: { type: 'string', default: '5' }, rounds: { type: 'string', default: '6' },
      warmup: { type: 'string', default: '3' }, 'no-write': { type: 'boolean', default: false },
    },
  });
  const steps = Number(a.steps), rounds = Number(a.rounds), warmup = Number(a.warmup);
  const kernels = kernelsArg(a.kernels);
  const { cfg, batch, what } = await stepShape(a.shape!);
  const bf16 = bf16Plan(a.bf16!);
  const precisions: [Precision, PeerMode, string][] = [['fp32', 'fp32', 'float32'], ...(bf16.measure ? [['bf16-mixed', 'bf16', 'bf16-mixed / autocast bf16'] as [Precision, PeerMode, string]] : [])];
  const yieldEachStep = !a['no-yield'];
  const load0 = loadavg()[0]!;
  setNumThreads(1);
  manualSeed(0);
  const model = new GPT(cfg);
  const idx = randint(0, cfg.vocabSize, [batch, cfg.blockSize]);
  const targets = randint(0, cfg.vocabSize, [batch, cfg.blockSize]);
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-bench-'));
  const initPath = join(dir, 'init.safetensors');
  saveSafetensors(initPath, { ...Object.fromEntries(model.namedParameters()), idx, targets });
  const peer = new TorchPeer(initPath, cfg);
  try {
    const hello = await peer.next();
    const loss0 = noGrad(() => tidy(() => model.forward(idx, targets).loss!.item()));
    const lossGap = Math.abs(loss0 - hello.loss0) / Math.abs(hello.loss0);
    if (!(lossGap < 1e-5)) throw new Error(`the two models disagree before training: loss ${loss0} vs PyTorch ${hello.loss0}`);

    // The single-process path of `flotilla train`: parameters and gradients in flat buckets (a world
    // of one runs no collective), AdamW over each bucket ([Note: flat step] in src/optim/optimizer.ts).
    // The kernels are chosen around forward + backward and around the optimizer's step, as the trainer does.
    const dp = new DataParallel(model, { group: initProcessGroup() });
    const opt = new AdamW(model.parameters(), ADAMW, { grads: dp });
    // GC pauses inside timed flotilla steps: V8 collects when native memory reported to it grows.
    const gcEntries: PerformanceEntry[] = [];
    const gcObserver = new PerformanceObserver((l) => gcEntries.push(...l.getEntries()));
    gcObserver.observe({ entryTypes: ['gc'] });
    const timed: [number, number][] = [];
    // Between steps the event loop runs, as in any trainer that awaits data, logging or collectives:
    // that is when N-API runs the finalizers of disposed handles (see test/memory_training.test.ts,
    // [Note: handle finalizers]); a loop that never yields fragments the heap (see docs/BENCHMARKS.md).
    const flotilla = async (n: number, k: KernelChoice, precision: Precision, record = true): Promise<Phases[]> => {
      const out: Phases[] = [];
      for (let i = 0; i < n; i++) {
        if (yieldEachStep) await new Promise((res) => setImmediate(res));
        // The clock runs until tidy() has freed the step's temporaries: PyTorch frees them inside its step.
        const c0 = process.cpuUsage();
        const t0 = performance.now();
        let t1 = 0, t2 = 0;
        tidy(() => {
          opt.zeroGrad();
          autocast(precision, () => withKernels(k, () => {
            const { loss } = dp.forward(idx, targets);
            t1 = performance.now();
            loss!.backward();
            dp.finishGradSync();
            t2 = performance.now();
            loss!.item();
          }));
          withKernels(k, () => opt.step());
        });
        const t3 = performance.now();
        const c = process.cpuUsage(c0);
        if (record) timed.push([t0, t3]);
        out.push([(t1 - t0) / 1e3, (t2 - t1) / 1e3, (t3 - t2) / 1e3, (c.user + c.system) / 1e6]);
      }
      return out;
    };
    const variants = [...kernels.map((k) => `flotilla ${k}`), 'PyTorch'];
    const run = (v: string, n: number, p: [Precision, PeerMode, string], record = true): Promise<Phases[]> =>
      v === 'PyTorch' ? peer.steps(n, p[1]) : flotilla(n, v.slice('flotilla '.length) as KernelChoice, p[0], record);
    for (const p of precisions) for (const v of variants) await run(v, warmup, p, false);
    // The machine's GEMM rate, probed in this process before and after the timed rounds (the best of them).
    const dtypeOf = (p: Precision): 'float32' | 'bfloat16' => (p === 'fp32' ? 'float32' : 'bfloat16');
    const rate = new Map(precisions.map(([p]) => [p, gemmRate(dtypeOf(p))]));
    const res = new Map<string, Phases[]>();
    for (let r = 0; r < rounds; r++) {
      for (const p of precisions) {
        // Rotate the order so that no variant always runs on a warmer (or busier) machine.
        const order = variants.map((_, i) => variants[(i + r) % variants.length]!);
        for (const v of order) {
          const key = `${p[0]} ${v}`;
          res.set(key, [...(res.get(key) ?? []), ...(await run(v, steps, p))]);
        }
      }
    }
    for (const [p] of precisions) rate.set(p, Math.max(rate.get(p)!, gemmRate(dtypeOf(p))));
    await new Promise((res) => setTimeout(res, 50)); // let the last GC entries arrive
    gcObserver.disconnect();
    const inStep = gcEntries.filter((e) => timed.some(([b, en]) => e.startTime >= b && e.startTime < en));
    const gcPerStep = inStep.reduce((acc, e) => acc + e.duration, 0) / timed.length / 1e3;
    const gcCount = inStep.length / timed.length;
    const total = (p: Phases) => p[0] + p[1] + p[2];
    const stat = (xs: Phases[]) => ({
      step: median(xs.map(total)), fwd: median(xs.map((p) => p[0])), bwd: median(xs.map((p) => p[1])), opt: median(xs.map((p) => p[2])),
      min: Math.min(...xs.map(total)), cpu: median(xs.map((p) => p[3])),
    });
    const flops = stepFlops(gptOverrides(cfg, cfg.blockSize), batch * cfg.blockSize);
    const ms = (s: number) => (s * 1e3).toFixed(1);
    const cpu = cpus();
    const machine = `${cpu.length} cores (${cpu[0]?.model.trim() ?? 'unknown CPU'}), Node ${process.versions.node}, ` +
      `libtorch ${torchVersion()} (flotilla), PyTorch ${hello.torch} (peer), intra-op threads ${getNumThreads()} / ${hello.threads}, ` +
      `${describeBlas()} on both sides`;
    const target = (v: string) => (v === 'flotilla fused' ? '<= 0.80' : v === 'flotilla eager' ? '<= 1.00' : '');
    const summary: string[] = [];
    const tables = precisions.map(([p, , label]) => {
      const t = stat(res.get(`${p} PyTorch`)!);
      const rows = variants.map((v) => {
        const s = stat(res.get(`${p} ${v}`)!);
        const ratio = v === 'PyTorch' ? '1' : `**${(s.step / t.step).toFixed(3)}**`;
        if (v !== 'PyTorch') summary.push(`${label} ${v} / PyTorch = ${(s.step / t.step).toFixed(3)} (target ${target(v)}: ${s.step / t.step <= Number(target(v).slice(3)) ? 'met' : 'missed'})`);
        return `| ${v} | ${ms(s.step)} ms | ${ratio} | ${ms(s.fwd)} ms | ${ms(s.bwd)} ms | ${ms(s.opt)} ms | ${ms(s.min)} ms | ${ms(s.cpu)} ms | ${gemmShare(flops, s.step, rate.get(p)!).toFixed(0)}% | ${target(v)} |`;
      });
      return [
        `${label}: torch.matmul ${(rate.get(p)! * 1e3).toFixed(1)} GFLOP/s at ${getNumThreads()} thread(s); the step ${(flops / 1e9).toFixed(2)} GFLOP`,
        '',
        '| | step (median) | / PyTorch | forward | backward | optimizer (+ freeing) | fastest step | CPU time per step | GEMM share | target |',
        '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
        ...rows,
      ].join('\n');
    });
    const params = model.numParams();
    const head = `GPT training step, ${what}: nLayer ${cfg.nLayer}, nEmbd ${cfg.nEmbd}, nHead ${cfg.nHead}, vocab ${cfg.vocabSize}, context ${cfg.blockSize}; ` +
      `${(params / 1e6).toFixed(2)}M parameters; batch ${batch} x ${cfg.blockSize} tokens, AdamW`;
    const gcLine = `flotilla GC pauses inside steps: ${gcCount.toFixed(1)} per step, ${ms(gcPerStep)} ms per step`;
    console.log(head);
    console.log(`${rounds} rounds x ${steps} steps per variant after ${warmup} warmup steps; ${machine}; ${bf16.note}`);
    for (const t of tables) console.log(`${t}\n`);
    console.log(gcLine);
    for (const s of summary) console.log(s);
    console.log(`loss before training ${loss0.toFixed(6)} (PyTorch ${Number(hello.loss0).toFixed(6)})`);
    if (a['no-write']) return;
    const section = a.shape === 'bench' ? 'step' : `step-${a.shape}`;
    const reproduce = `node --import tsx bench/step.ts --shape ${a.shape} --kernels ${a.kernels} --steps ${steps} --rounds ${rounds} --warmup ${warmup}${a.bf16 ? ' --bf16' : ''}`;
    writeSection(section, [
      `## Training step: flotilla (fused and eager kernels) vs PyTorch, ${a.shape === 'bench' ? 'the step benchmark\'s GPT' : a.shape === 'demo' ? 'the demo\'s GPT' : 'a 25M GPT'}`,
      '',
      `${head}; forward + backward + optimizer, one intra-op thread on each side. ${bf16.note}. Both start from the same weights and batch ` +
        `(loss before training: ${loss0.toFixed(6)} vs ${Number(hello.loss0).toFixed(6)}). flotilla runs the single-process path of \`flotilla train\` ` +
        '(flat buckets, AdamW over each bucket) with `[train] kernels = "fused"` and `"eager"` ([Note: kernel choice] in src/nn/kernels/choice.ts), ' +
        'PyTorch 1.13 bench/step.py, eager. ' +
        `The variants alternate in ${rounds} rounds of ${steps} steps each (in an order rotating by round) after ${warmup} warmup steps each; ` +
        `numbers are medians over the ${rounds * steps} timed steps of each.`,
      '',
      `Reproduce: \`${reproduce}\`${a.shape === 'bench' ? ' (or `npm run bench`)' : ''}.`,
      '',
      `Machine: ${machine}. Load average (1 min) at the start and the end of this run: ${load0.toFixed(1)} and ${loadavg()[0]!.toFixed(1)}.`,
      '',
      GEMM_SHARE_NOTE,
      '',
      ...tables.flatMap((t) => [t, '']),
      ...(a.shape === 'bench' ? [HISTORY, ''] : []),
      `${gcLine}. This run yields to the event loop once per step, as the trainer does; \`--no-yield\` runs a loop that never yields.`,
      '',
      ...summary.map((s) => `- ${s}`),
    ].join('\n'));
    console.log(`wrote the ${section} section of docs/BENCHMARKS.md`);
  } finally {
    peer.close();
    rmSync(dir, { recursive: true, force: true });
  }
}

runIfMain(import.meta.url, main);
