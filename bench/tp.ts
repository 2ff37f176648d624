// Tensor-parallel benchmark on 2 ranks: bytes the tp collectives send per step against Megatron's
// count, and the step time of tp=2 (plain, + sequence parallel, + loss parallel) against dp=2 on the
// same GPT and global batch. Writes its section of docs/BENCHMARKS.md.
//   node --import tsx bench/tp.ts [--steps 6] [--trials 2] [--width 256]
//
// Megatron's count, per layer and micro-batch of B x T tokens at width C: 2 all-reduces of B*T*C
// forward and 2 backward without sequence parallelism; with it the same bytes as all-gathers and
// reduce-scatters. As ring bus bytes over n = 2 ranks: 4 * 2(n-1)/n * B*T*C*4 bytes = 8(n-1)/n*BTC*4.
// The rest is the embedding's and the head's collectives (and, under sequence parallelism, the
// LayerNorm and row-parallel bias gradients), which the table accounts for exactly.
import { join } from 'node:path';
import { runWorld } from '../test/helpers/world.js';
import { median, writeSection, parseBench } from './report.js';

const argv = process.argv.slice(2);
const arg = (name: string, dflt: number) => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const C = arg('--width', 256);
const L = 4, V = 512, B = 16, T = 128, m = 2, n = 2;
const opts = {
  steps: arg('--steps', 6), warmup: 2, batch: B, seqLen: T, micro: m,
  model: { vocabSize: V, blockSize: T, nLayer: L, nHead: 8, nEmbd: C, dropout: 0, bias: true, tieEmbeddings: false },
  layouts: [
    ['dp2', {}],
    ['tp2', { tp: 2 }],
    ['tp2_sp', { tp: 2, sequenceParallel: true }],
    ['tp2_sp_lp', { tp: 2, sequenceParallel: true, lossParallel: true }],
  ],
};
const trials = arg('--trials', 2);
const root = join(import.meta.dirname, '..');

type Traffic = { allReduce: number; allGather: number; reduceScatter: number; calls: number };
type Rank = Record<string, { times: number[]; traffic: Traffic; held: number; microRows: number }>;

const runs: Rank[] = [];
for (let t = 0; t < trials; t++) {
  const r = await runWorld({ nproc: 2, script: join(root, 'bench', 'tp_rank.ts'), args: [JSON.stringify(opts)], timeoutMs: 900_000 });
  if (r.codes.some((c) => c !== 0)) throw new Error(`ranks failed:\n${r.outputs.join('\n')}`);
  runs.push(...r.outputs.map((o) => parseBench<Rank>(o)));
}
const med = (k: string) => median(runs.flatMap((r) => r[k]!.times));
const k = (n - 1) / n, f = 4;
const mb = (x: number) => (x / 2 ** 20).toFixed(2);
// Per micro-batch (tp ranks all see b rows): E = b*T*C*4 bytes.
const b = B / m; // tp=2 leaves dp=1: each micro-batch holds B/m rows
const E = b * T * C * f, BT = b * T * f;
const blocks = m * 8 * k * L * E; // Megatron's count
const extra: Record<string, [number, string]> = {
  tp2: [m * (2 * k * E + 2 * k * E + k * b * T * V * f), 'embedding all-reduce, head input-gradient all-reduce, logits all-gather'],
  tp2_sp: [m * (2 * k * E + k * E + 2 * k * E + k * b * T * V * f + (2 * L + 1) * 2 * C * f * 2 * k + 2 * L * C * f * 2 * k),
    'embedding all-reduce + token scatter\'s gather, head token all-gather/reduce-scatter, logits all-gather, LayerNorm and row-parallel bias gradients'],
  tp2_sp_lp: [m * (2 * k * E + k * E + 2 * k * E + 3 * 2 * k * BT + (2 * L + 1) * 2 * C * f * 2 * k + 2 * L * C * f * 2 * k),
    'as above, but 3 all-reduces of one number per token (max, sum of exp, target logit) instead of the logits all-gather'],
};
const dp = med('dp2');
const rows = ['tp2', 'tp2_sp', 'tp2_sp_lp'].map((name) => {
  const r = runs[0]![name]!;
  const total = r.traffic.allReduce + r.traffic.allGather + r.traffic.reduceScatter;
  const [want, what] = extra[name]!;
  return `| ${name.replace(/_/g, ' + ').replace('tp2', 'tp=2').replace('sp', 'sequence parallel').replace('lp', 'loss parallel')} | ${mb(r.traffic.allReduce)} / ${mb(r.traffic.allGather)} / ${mb(r.traffic.reduceScatter)} | ` +
    `${mb(total)} | ${mb(blocks)} | ${mb(total - blocks)} (expected ${mb(want)}: ${what}) | ${med(name).toFixed(1)} | ${(med(name) / dp).toFixed(3)} |`;
});
const body = [
  '## Tensor parallelism, 2 ranks',
  '',
  `\`node --import tsx bench/tp.ts --width ${C}\` — GPT ${L} layers, width ${C}, 8 heads, vocabulary ${V}, global batch ${B} x ${T} in ${m} micro-batches,`,
  `AdamW, float32, one intra-op thread per rank, Gloo; ${trials} trials of ${opts.steps} timed steps after 2 warm-up steps, medians over both ranks.`,
  'Bytes are what the tensor-parallel collectives sent from one rank in one step, as a ring sends them (an all-reduce of S',
  'bytes 2(n-1)/n S, an all-gather or reduce-scatter (n-1)/n S). Megatron\'s count is the transformer blocks\' share',
  '(per layer and micro-batch 2 all-reduces of B*T*C forward and 2 backward, or the same bytes as all-gathers and',
  'reduce-scatters with sequence parallelism); the rest is accounted for term by term.',
  '',
  `| layout | MiB sent: all-reduce / all-gather / reduce-scatter | total | Megatron's count (blocks) | rest | step ms | vs dp=2 (${dp.toFixed(1)} ms) |`,
  '|---|---|---|---|---|---|---|',
  ...rows,
  '',
  `Each tp rank holds ${runs[0]!.tp2!.held.toLocaleString('en-US')} of the ${runs[0]!.dp2!.held.toLocaleString('en-US')} parameters; dp=2 trains ${B / 2} rows per rank per step where tp=2 trains all ${B} on both ranks with half the weights each.`,
].join('\n');
writeSection('tp', body);
console.log(body);
