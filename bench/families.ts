// The model families of issue 53 under real trainer runs, measured from outside (bench/zero_rss_rank.ts
// through test/helpers/rss.ts, Gloo, one thread a rank): (1) a Mixtral-style Llama of about 30M
// parameters (8 SwiGLU experts in every block, top-2, scores renormalised over the chosen two:
// moe.normTopK) on 2 ranks with its experts split (--parallel.ep=2) against replicated (ep = 1, data
// parallel over the same 2 ranks): step time and each rank's peak memory (VmHWM, and the [memory]
// line's parameters + gradients + optimizer state); (2) a Qwen3 (model.family = "qwen3": q/k norms,
// no attention biases, as Qwen3 defaults) against the Llama of the same shape, 1 rank: the step-time
// ratio, what the q/k norms cost. The machine may be shared: runs alternate (A B B A ...) so drifting
// load falls on both sides, and the load average at the start and the end is printed.
//   node --import tsx bench/families.ts [--rounds 4] [--steps 6] [--write]
// --write replaces the "families" section of docs/BENCHMARKS.md.
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import os from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { llamaNumParams, type LlamaConfig } from '../src/models/llama_config.js';
import { defaultMoEConfig, type MoEConfig } from '../src/nn/moe_config.js';
import { measureRss, stepSeconds, MiB, type RankRss } from '../test/helpers/rss.js';
import { median, writeSection } from './report.js';

const { values: a } = parseArgs({ options: { rounds: { type: 'string', default: '4' }, steps: { type: 'string', default: '6' }, write: { type: 'boolean', default: false } } });
const rounds = Number(a.rounds), steps = Number(a.steps);
if (!(steps >= 3)) throw new Error(`--steps must be at least 3 (the first step is not timed), not ${a.steps}`);
if (!(rounds >= 1)) throw new Error(`--rounds must be at least 1, not ${a.rounds}`);
const SEQ = 64, BATCH = 4;

// (1) Mixtral-style: 6 blocks of width 256, 8 query heads sharing 2 key/value heads, every MLP 8 SwiGLU experts of 704 (the dense width).
const mixtral: Partial<LlamaConfig> = { vocabSize: 256, blockSize: SEQ, nLayer: 6, nHead: 8, nKvHead: 2, nEmbd: 256 };
const moe: MoEConfig = { ...defaultMoEConfig, experts: 8, topK: 2, normTopK: true, router: 'softmax', balance: 'aux', auxCoeff: 0.01 };
// (2) Dense: 10 blocks of width 512, 8 query heads sharing 4 key/value heads; the Qwen3 adds q/k norms.
const dense: Partial<LlamaConfig> = { vocabSize: 256, blockSize: SEQ, nLayer: 10, nHead: 8, nKvHead: 4, nEmbd: 512 };
const qwen3: Partial<LlamaConfig> = { ...dense, family: 'qwen3', qkNorm: true, attnBias: 'none' };

const dir = mkdtempSync(join(os.tmpdir(), 'flotilla-bench-families-'));
const asArgs = (prefix: string, o: object) => Object.entries(o).map(([k, v]) => `--${prefix}.${k}=${v}`);
let runNo = 0;
function overrides(model: Partial<LlamaConfig>, extra: string[]): string[] {
  return [
    '--model.arch=llama', ...asArgs('model', model),
    `--data.seqLen=${SEQ}`, `--data.globalBatch=${BATCH}`, '--data.valFraction=0.1',
    `--train.steps=${steps}`, '--train.evalEvery=0', '--train.evalBatches=1', '--train.threads=1', `--train.runDir=${join(dir, `run${runNo++}`)}`,
    '--optim.warmupSteps=1', '--checkpoint.every=0', '--log.progress=plain', '--log.every=1', '--parallel.backend=gloo', ...extra,
  ];
}
const mixtralRun = (ep: number) => overrides(mixtral, [...asArgs('moe', moe), `--parallel.ep=${ep}`]);
const denseRun = (m: Partial<LlamaConfig>) => overrides(m, []);

// Each configuration's runs, in the order they ran.
const results = new Map<string, RankRss[][]>();
const record = (k: string, rs: RankRss[]) => results.set(k, [...(results.get(k) ?? []), rs]);
const loadavg = () => readFileSync('/proc/loadavg', 'utf8').trim().split(/\s+/).slice(0, 3).join(' ');
const load0 = loadavg();
const t0 = performance.now();
const orders: string[] = [];
try {
  for (let r = 0; r < rounds; r++) {
    // A B in even rounds, B A in odd ones.
    const eps = r % 2 === 0 ? [1, 2] : [2, 1];
    for (const ep of eps) {
      const rs = await measureRss(mixtralRun(ep), { nproc: 2 });
      record(`ep${ep}`, rs);
      orders.push(`ep=${ep}`);
      console.log(`round ${r + 1} Mixtral ep=${ep}: VmHWM ${rs.map((x) => x.peakMiB.toFixed(0)).join(' / ')} MiB, step ${rs.map((x) => (median(stepSeconds(x).wall) * 1e3).toFixed(0)).join(' / ')} ms`);
      if (rs[0]!.memoryLine) console.log(`  ${rs[0]!.memoryLine}`);
    }
    const fams: [string, Partial<LlamaConfig>][] = r % 2 === 0 ? [['llama', dense], ['qwen3', qwen3]] : [['qwen3', qwen3], ['llama', dense]];
    for (const [name, m] of fams) {
      const rs = await measureRss(denseRun(m), { nproc: 1 });
      record(name, rs);
      orders.push(name);
      console.log(`round ${r + 1} ${name}: VmHWM ${rs[0]!.peakMiB.toFixed(0)} MiB, step ${(median(stepSeconds(rs[0]!).wall) * 1e3).toFixed(0)} ms (CPU ${(median(stepSeconds(rs[0]!).cpu) * 1e3).toFixed(0)} ms)`);
    }
  }
} finally {
  rmSync(dir, { recursive: true, force: true });
}
const load1 = loadavg();
const wallS = (performance.now() - t0) / 1e3;

// The CPU's model name as lscpu gives it (os.cpus() where lscpu is missing).
function cpuModel(): string {
  try {
    const line = execFileSync('lscpu', { encoding: 'utf8' }).split('\n').find((l) => l.startsWith('Model name:'));
    if (line) return line.slice('Model name:'.length).trim();
  } catch { /* no lscpu */ }
  return os.cpus()[0]?.model.trim() ?? 'cpu';
}
const ms = (s: number) => (s * 1e3).toFixed(0);
const mib = (b: number) => (b / MiB).toFixed(1);
const all = (k: string) => results.get(k)!.flat();
// Median over every rank and run of the steps after each run's first.
const step = (k: string, w: 'wall' | 'cpu') => median(all(k).flatMap((r) => stepSeconds(r)[w]));
// Per rank: the largest VmHWM over the runs; the state from the [memory] report (the same every run).
const peakOf = (k: string, rank: number) => Math.max(...all(k).filter((r) => r.rank === rank).map((r) => r.peakMiB));
const stateOf = (k: string, rank: number) => {
  const m = all(k).find((r) => r.rank === rank)!.memory;
  return m ? `${mib(m.paramBytes)} + ${mib(m.gradBytes)} + ${mib(m.optimizerBytes)} = ${mib(m.paramBytes + m.gradBytes + m.optimizerBytes)}` : '-';
};
// Each run's own ratio against the other side's run of the same round, to show the spread.
const perRound = (num: string, den: string, w: 'wall' | 'cpu' = 'wall') =>
  results.get(num)!.map((rs, i) => median(rs.flatMap((r) => stepSeconds(r)[w])) / median(results.get(den)![i]!.flatMap((r) => stepSeconds(r)[w]))).map((x) => x.toFixed(2)).join(', ');

const Pm = llamaNumParams({ ...mixtral, moe }), Pd = llamaNumParams(dense), Pq = llamaNumParams(qwen3);
const activeM = llamaNumParams({ ...mixtral, moe: { ...moe, experts: moe.topK } });
const epRows = [1, 2].map((ep) => `| ep = ${ep}${ep === 1 ? ' (data parallel, experts replicated)' : ' (4 experts a rank)'} | ${ms(step(`ep${ep}`, 'wall'))} | ${ms(step(`ep${ep}`, 'cpu'))} | ` +
  `${peakOf(`ep${ep}`, 0).toFixed(0)} / ${peakOf(`ep${ep}`, 1).toFixed(0)} | ${stateOf(`ep${ep}`, 0)} |`);
const famRows = (['llama', 'qwen3'] as const).map((f) => `| ${f === 'llama' ? 'Llama (LlamaForCausalLM)' : 'Qwen3 (q/k norms, no attention biases)'} | ${(f === 'llama' ? Pd : Pq).toLocaleString('en-US')} | ` +
  `${ms(step(f, 'wall'))} | ${ms(step(f, 'cpu'))} | ${peakOf(f, 0).toFixed(0)} |`);
const rEp = step('ep2', 'wall') / step('ep1', 'wall'), rEpCpu = step('ep2', 'cpu') / step('ep1', 'cpu');
const rQ = step('qwen3', 'wall') / step('llama', 'wall'), rQCpu = step('qwen3', 'cpu') / step('llama', 'cpu');
const body = [
  '## Model families: Mixtral-style experts split over ranks, Qwen3\'s q/k norms',
  '',
  `\`node --import tsx bench/families.ts --rounds ${rounds} --steps ${steps} --write\` — real trainer runs (\`train()\`, as \`flotilla train\` runs it; ` +
    `bench/zero_rss_rank.ts), Gloo on loopback, one intra-op thread a rank, float32, AdamW, random init, global batch ${BATCH} x ${SEQ} tokens, ${steps} steps a run. ` +
    'A step is the time between two step ends, the median over all ranks and runs of the steps after each run\'s first, wall and the process\'s own CPU time. ' +
    'Peak RSS is each rank\'s VmHWM after its run (the larger over the runs); the state is the [memory] line\'s parameters + gradients + optimizer state on rank 0. ' +
    `The machine was shared with other work: the configurations ran alternately (${orders.join(', ')}), ${rounds} run(s) of each, ` +
    `so load drifting during the bench falls on both sides of each comparison; the per-run ratios show how much it moved. Load average (/proc/loadavg, 1/5/15 min) at the start: ${load0}; at the end: ${load1}. ` +
    `The whole bench took ${wallS.toFixed(0)} s. Under such load a step's wall time also holds the time a rank waited for a core, ` +
    'which the CPU time does not: where the two disagree, the CPU ratio is the one to read for the work a step does.',
  '',
  `CPU (lscpu): ${cpuModel()} x ${os.cpus().length}.`,
  '',
  `### Mixtral-style, 2 ranks: ep = 2 against ep = 1`,
  '',
  `A Llama with \`[moe]\` as Mixtral: ${(Pm / 1e6).toFixed(1)}M parameters (${(activeM / 1e6).toFixed(1)}M active a token), ${mixtral.nLayer} blocks of width ${mixtral.nEmbd}, ` +
    `${mixtral.nHead} query heads sharing ${mixtral.nKvHead} key/value heads, vocab ${mixtral.vocabSize}; every MLP ${moe.experts} SwiGLU experts of width 704, ` +
    `top-${moe.topK}, softmax router, the chosen scores renormalised (\`moe.normTopK = true\`), auxiliary loss ${moe.auxCoeff}, dropless. ` +
    `ep = 2: \`--parallel.ep=2\` (each rank holds 4 experts; tokens go to their experts' rank and back by all-to-all); ep = 1: the same 2 ranks as plain data parallel.`,
  '',
  '| layout | step ms | step CPU ms | VmHWM MiB, rank 0 / rank 1 | parameters + gradients + optimizer state MiB (rank 0) |',
  '|---|---:|---:|---|---|',
  ...epRows,
  '',
  `**ep = 2 / ep = 1 step: ${rEp.toFixed(2)}** (CPU ${rEpCpu.toFixed(2)}; per run: ${perRound('ep2', 'ep1')}); peak RSS rank 0 ${(peakOf('ep2', 0) / peakOf('ep1', 0)).toFixed(2)}x.`,
  '',
  '### Qwen3 against the Llama of the same shape, 1 rank',
  '',
  `${dense.nLayer} blocks of width ${dense.nEmbd}, ${dense.nHead} query heads sharing ${dense.nKvHead} key/value heads of ${dense.nEmbd! / dense.nHead!}, SwiGLU 1408, vocab ${dense.vocabSize}, untied. ` +
    'The Qwen3 is `--model.family=qwen3 --model.qkNorm=true --model.attnBias=none` (an RMSNorm over every query and key head before the rotary positions); nothing else differs.',
  '',
  '| model | parameters | step ms | step CPU ms | VmHWM MiB |',
  '|---|---:|---:|---:|---:|',
  ...famRows,
  '',
  `**Qwen3 / Llama step: ${rQ.toFixed(3)}** (CPU ${rQCpu.toFixed(3)}; per run: ${perRound('qwen3', 'llama')}).`,
].join('\n');
console.log(`\n${body}`);
if (a.write) writeSection('families', body);
