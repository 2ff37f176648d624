// Context-parallelism benchmark: the demo-width GPT at sequence length 2048 (4 layers, width 128, 4
// heads, vocabulary 512, as examples/gpt-tiny.toml but with a 2048-token context) on one global
// batch under three layouts, each in fresh processes so that each peak resident memory is its own:
//   cp = 1 in one process (every sequence whole, plain attention),
//   cp = 1, dp = 2 on 2 ranks (each rank whole sequences, half the batch: the same tokens per rank as cp = 2),
//   cp = 2 on 2 ranks (each rank two chunks of every sequence, ring attention).
// Ranks are bench/cp_rank.ts (Gloo on loopback, one intra-op thread each). Writes its section of
// docs/BENCHMARKS.md (between <!-- cp:begin --> and <!-- cp:end -->).
//
//   node --import tsx bench/cp.ts [--seq 2048] [--batch 2] [--steps 4] [--warmup 1] [--no-write] [--smoke]
import { join } from 'node:path';
import { cpus, loadavg } from 'node:os';
import { parseArgs } from 'node:util';
import { runWorld } from '../test/helpers/world.js';
import { median, writeSection, parseBench } from './report.js';
import type { Opts, RankOut } from './cp_rank.js';

const { values: a } = parseArgs({
  options: {
    seq: { type: 'string', default: '2048' }, batch: { type: 'string', default: '2' }, steps: { type: 'string', default: '4' }, warmup: { type: 'string', default: '1' },
    'no-write': { type: 'boolean', default: false }, smoke: { type: 'boolean', default: false },
  },
});
const root = join(import.meta.dirname, '..');
// --smoke: a short sequence, to check the script runs (implies --no-write).
const seqLen = a.smoke ? 64 : Number(a.seq);
const model = { vocabSize: 512, nLayer: 4, nHead: 4, nEmbd: 128 };
const base = { warmup: Number(a.warmup), steps: Number(a.steps), globalBatch: Number(a.batch), seqLen, model };

async function world(nproc: number, layout: Opts['layout']): Promise<RankOut[]> {
  const r = await runWorld({ nproc, script: join(root, 'bench', 'cp_rank.ts'), args: [JSON.stringify({ ...base, layout } satisfies Opts)], timeoutMs: 1_200_000 });
  if (r.codes.some((c) => c !== 0)) throw new Error(`benchmark ranks failed:\n${r.outputs.join('\n')}`);
  return r.outputs.map((o) => parseBench<RankOut>(o));
}

const one = await world(1, {});
const dp2 = await world(2, { dp: 2 });
const cp2 = await world(2, { cp: 2 });
const load = loadavg()[0]!;

const step = (rs: RankOut[]) => median(rs.flatMap((r) => r.stepMs));
const peak = (rs: RankOut[]) => Math.max(...rs.map((r) => r.peakBytes));
const mib = (b: number) => (b / 2 ** 20).toFixed(0);
const rows = [
  { name: 'cp = 1, one process', rs: one },
  { name: 'cp = 1, dp = 2 (2 ranks)', rs: dp2 },
  { name: 'cp = 2 (2 ranks, ring attention)', rs: cp2 },
];
const cmd = `node --import tsx bench/cp.ts --seq ${seqLen} --batch ${base.globalBatch} --steps ${base.steps} --warmup ${base.warmup}${a.smoke ? ' --smoke' : ''}`;
const body = [
  '## Context parallelism (long sequences)',
  '',
  `GPT of ${model.nLayer} layers, width ${model.nEmbd}, ${model.nHead} heads, vocabulary ${model.vocabSize} (the demo's widths) with a ${seqLen}-token context;`,
  `global batch ${base.globalBatch} x ${seqLen} tokens per step, AdamW, float32, one intra-op thread per process, Gloo on loopback.`,
  'Each layout runs in its own fresh process(es), built as the trainer builds it (`parallelize`, `model.step`, AdamW over',
  `the flat buckets); ${base.warmup} warm-up step(s), then ${base.steps} timed steps (median; every step starts at a barrier, so it is the`,
  'slowest rank\'s). Peak memory is VmHWM of each process at the end (the largest rank\'s), libtorch and the model included.',
  '',
  '| layout | tokens per rank per step | step (ms) | step / cp = 1, dp = 2 | peak resident memory per rank (MiB) | peak / one process |',
  '|---|---:|---:|---:|---:|---:|',
  ...rows.map(({ name, rs }) => `| ${name} | ${rs[0]!.tokensPerRank.toLocaleString('en-US')} | ${step(rs).toFixed(0)} | ${(step(rs) / step(dp2)).toFixed(3)} | ${mib(peak(rs))} | ${(peak(rs) / peak(one)).toFixed(3)} |`),
  '',
  `**cp = 2 peak resident memory per rank / one process: ${(peak(cp2) / peak(one)).toFixed(3)}**; a cp = 2 step takes ${(step(cp2) / step(dp2)).toFixed(3)}x the time of a`,
  `data-parallel step over the same two ranks (the same tokens per rank) and ${(step(cp2) / step(one)).toFixed(3)}x the one-process step.`,
  'One process computes the whole (T, T) scores of every head and keeps the probabilities for backward; a cp = 2 rank computes',
  `blocks of (T/4, T/4) and keeps only q, k, v, the output and the log-sum-exp of its ${seqLen / 2} tokens. Per-step times (ms):`,
  ...rows.map(({ name, rs }) => `${name}: ${rs.map((r) => `rank ${r.rank} [${r.stepMs.map((x) => x.toFixed(0)).join(', ')}]`).join('; ')}.`),
  '',
  'The ring is faster than plain attention, not only smaller: of the 16 (T/4)-square blocks of a sequence\'s scores it',
  'computes the 10 the causal mask does not hide entirely (two of them half masked), where one process computes and masks',
  'all 16, and its softmax runs over blocks instead of whole rows. The transfers (Gloo send/recv of each key/value chunk,',
  'and in backward of their gradients) are inside these times; this benchmark does not time them apart.',
  `Load average (1 minute) when the last layout finished: ${load.toFixed(1)} on ${cpus().length} cores; above ${cpus().length}, other work`,
  'shared the cores and the two-rank rows did not get two of their own (the layouts run one after another under that load).',
  '',
  `Command: \`${cmd}\`.`,
].join('\n');
console.log(body);
if (!a['no-write'] && !a.smoke) writeSection('cp', body);
