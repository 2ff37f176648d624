// Mixture-of-experts benchmark: the training step of an MoE GPT against a dense GPT of equal active
// parameters in one process, the MoE GPT at ep = 2 against ep = 1 (data parallel) on 2 ranks, and
// the bytes the expert all-to-alls move at ep = 2 against the count the routing and the layout imply.
// Ranks are bench/moe_rank.ts (Gloo on loopback, one intra-op thread each). Writes its section of
// docs/BENCHMARKS.md (between <!-- moe:begin --> and <!-- moe:end -->).
//
//   node --import tsx bench/moe.ts [--rounds 6] [--steps 4] [--warmup 2] [--no-write] [--smoke]
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { runWorld } from '../test/helpers/world.js';
import { median, writeSection, parseBench } from './report.js';
import type { Opts, RankOut } from './moe_rank.js';

const { values: a } = parseArgs({
  options: { rounds: { type: 'string', default: '6' }, steps: { type: 'string', default: '4' }, warmup: { type: 'string', default: '2' }, 'no-write': { type: 'boolean', default: false }, smoke: { type: 'boolean', default: false } },
});
const root = join(import.meta.dirname, '..');
// --smoke: a tiny model, to check the script runs (implies --no-write).
const model = a.smoke ? { vocabSize: 64, blockSize: 16, nLayer: 2, nHead: 2, nEmbd: 32 } : { vocabSize: 256, blockSize: 128, nLayer: 4, nHead: 8, nEmbd: 256 };
const C = model.nEmbd, E = 8, K = 2, H = (4 * C) / K;
// Every block MoE; topK x expert width = the dense MLP's width (4 C), so the active parameters match.
const moe = { experts: E, topK: K, hidden: H, every: 1, router: 'softmax', balance: 'aux', auxCoeff: 0.01, capacityFactor: 0 } as const;
const BATCH = 8, EP = 2;
const base = { warmup: Number(a.warmup), rounds: Number(a.rounds), steps: Number(a.steps), batch: BATCH, model, moe };

async function world(nproc: number, opts: Opts): Promise<RankOut[]> {
  const r = await runWorld({ nproc, script: join(root, 'bench', 'moe_rank.ts'), args: [JSON.stringify(opts)], timeoutMs: 600_000 });
  if (r.codes.some((c) => c !== 0)) throw new Error(`benchmark ranks failed:\n${r.outputs.join('\n')}`);
  return r.outputs.map((o) => parseBench<RankOut>(o));
}

const t0 = performance.now();
const single = (await world(1, { ...base, mode: 'single' }))[0]!;
const pair = await world(EP, { ...base, mode: 'ep' });
const wallS = (performance.now() - t0) / 1e3;

const med = (rs: RankOut[], k: string, f: 'step' | 'fwdBwd' | 'opt') => median(rs.flatMap((r) => r.timed[k]![f]));
const ms = (x: number) => x.toFixed(1);
const n = (x: number) => Math.round(x).toLocaleString('en-US');
const mib = (b: number) => (b / 2 ** 20).toFixed(3);

// Single process: MoE against dense.
const dense = single.params.dense!, moeP = single.params.moe!;
const sd = med([single], 'dense', 'step'), sm = med([single], 'moe', 'step');
// Per round ratios (each round's median), to show the spread.
const perRound = (rs: RankOut[], num: string, den: string, per: number) => {
  const out: number[] = [];
  const rounds = rs[0]!.timed[num]!.step.length / per;
  for (let i = 0; i < rounds; i++) {
    const slice = (k: string) => median(rs.flatMap((r) => r.timed[k]!.step.slice(i * per, (i + 1) * per)));
    out.push(slice(num) / slice(den));
  }
  return out.map((x) => x.toFixed(3)).join(', ');
};

// Two ranks: ep = 2 against ep = 1.
const e1 = med(pair, 'ep1', 'step'), e2 = med(pair, 'ep2', 'step');
const p1 = pair[0]!.params.ep1!;

// Traffic per step, summed over the ranks (the timed steps align by index across ranks).
const tr = pair.map((r) => r.traffic!);
const steps = tr[0]!.rowBytes.length;
const sum = (f: (t: (typeof tr)[number], i: number) => number) => Array.from({ length: steps }, (_, i) => tr.reduce((s, t) => s + f(t, i), 0));
const rowBytes = sum((t, i) => t.rowBytes[i]!), countBytes = sum((t, i) => t.countBytes[i]!);
const remote = sum((t, i) => t.remoteRows[i]!), routed = sum((t, i) => t.routedRows[i]!);
const calls = sum((t, i) => t.calls[i]!), dispatches = sum((t, i) => t.dispatches[i]!);
const layers = tr[0]!.layers;
const a2aMs = median(tr.flatMap((t) => t.a2aMs));
// Implied by the routing: every row sent to another rank's expert goes there (dispatch) and comes
// back (combine), and backward sends its gradient both ways again; 4 bytes per float32 element.
const impliedRows = remote.map((r) => r * C * 4 * 2 * 2);
// The per-expert counts: each rank sends each other rank the counts of that rank's E / ep experts,
// once per MoE layer forward (float64, as the dispatch exchanges them).
const impliedCounts = Array.from({ length: steps }, () => EP * layers * (E / EP) * (EP - 1) * 8);
// A uniform routing: a rank's N x topK assignments land on another rank's experts with probability (ep - 1) / ep.
const N = BATCH * model.blockSize;
const uniformRows = EP * layers * N * K * ((EP - 1) / EP) * C * 4 * 2 * 2;
const mean = (xs: number[]) => xs.reduce((s, x) => s + x, 0) / xs.length;
const exactEvery = rowBytes.every((b, i) => b === impliedRows[i]) && countBytes.every((b, i) => b === impliedCounts[i]);
const mRow = mean(rowBytes), mCnt = mean(countBytes), iRow = mean(impliedRows), iCnt = mean(impliedCounts);
const remoteShare = remote.reduce((s, x) => s + x, 0) / routed.reduce((s, x) => s + x, 0);

const cmd = `node --import tsx bench/moe.ts --rounds ${base.rounds} --steps ${base.steps} --warmup ${base.warmup}${a.smoke ? ' --smoke' : ''}`;
const body = [
  '## Mixture of experts',
  '',
  `GPT of ${model.nLayer} layers, width ${C}, ${model.nHead} heads, context ${model.blockSize}, vocab ${model.vocabSize}, ${BATCH} x ${model.blockSize} tokens per rank, AdamW, float32, one`,
  `intra-op thread per process. The MoE GPT has an MoE MLP in every block: ${E} experts of hidden width ${H}, topK = ${K}, softmax`,
  `router, auxiliary loss (coefficient 0.01), dropless; the dense GPT's MLP has hidden width ${4 * C} = topK x ${H}, so a token`,
  `meets the same number of weights (the MoE adds its router, ${E} x ${C} per block). Both run as the trainer runs them`,
  '(`parallelize`, `model.step`, AdamW over the flat buckets); a step is forward, backward, gradient sync and the optimizer.',
  `${base.warmup} warm-up steps each, then ${base.rounds} alternating rounds of ${base.steps} steps of each model in the same process(es); medians.`,
  '',
  '### One process: MoE against dense of equal active parameters',
  '',
  '| model | parameters | active per token | step (ms) | forward + backward (ms) | optimizer (ms) | step / dense |',
  '|---|---:|---:|---:|---:|---:|---:|',
  `| dense GPT (MLP ${C} -> ${4 * C} -> ${C}) | ${n(dense.total)} | ${n(dense.active)} | ${ms(sd)} | ${ms(med([single], 'dense', 'fwdBwd'))} | ${ms(med([single], 'dense', 'opt'))} | 1.000 |`,
  `| MoE GPT (${E} experts ${C} -> ${H} -> ${C}, top-${K}) | ${n(moeP.total)} | ${n(moeP.active)} | ${ms(sm)} | ${ms(med([single], 'moe', 'fwdBwd'))} | ${ms(med([single], 'moe', 'opt'))} | ${(sm / sd).toFixed(3)} |`,
  '',
  `**MoE / dense step: ${(sm / sd).toFixed(3)}** (per round: ${perRound([single], 'moe', 'dense', base.steps)}).`,
  '',
  `### Two ranks: experts split (ep = ${EP}) against replicated (ep = 1, data parallel)`,
  '',
  `The same MoE GPT on 2 ranks (Gloo on loopback), each rank its own ${BATCH} x ${model.blockSize} tokens, both layouts built in the same`,
  'two processes and timed in alternating rounds. At ep = 1 every rank holds all experts and all-reduces every gradient; at',
  `ep = ${EP} a rank holds ${E / EP} experts per block, its tokens reach the others' experts by all-to-all, and only the dense gradients are all-reduced`,
  '(an expert\'s gradient is whole on its one rank).',
  '',
  '| layout | step (ms) | forward + backward + sync (ms) | optimizer (ms) | gradient elements all-reduced per rank | step / ep = 1 |',
  '|---|---:|---:|---:|---:|---:|',
  `| ep = 1, data parallel over 2 | ${ms(e1)} | ${ms(med(pair, 'ep1', 'fwdBwd'))} | ${ms(med(pair, 'ep1', 'opt'))} | ${n(p1.total)} | 1.000 |`,
  `| ep = ${EP} | ${ms(e2)} | ${ms(med(pair, 'ep2', 'fwdBwd'))} | ${ms(med(pair, 'ep2', 'opt'))} | ${n(p1.total - p1.experts)} | ${(e2 / e1).toFixed(3)} |`,
  '',
  `**ep = ${EP} / ep = 1 step: ${(e2 / e1).toFixed(3)}** (per round: ${perRound(pair, 'ep2', 'ep1', base.steps)}).`,
  '',
  `### Bytes the expert all-to-alls move at ep = ${EP}`,
  '',
  `Measured: the ep group's \`allToAll\` wrapped in the rank script, counting the bytes each call sends to the other rank (its own`,
  'split excluded), per step summed over both ranks; the calls with split sizes are the row exchanges, the ones without are the',
  `per-expert count exchanges. Implied by the routing that happened: for each of the ${layers} MoE blocks, the rows each rank routed to`,
  `experts held by the other rank x ${C} x 4 bytes, x 2 (dispatch and combine) x 2 (forward and backward); the counts: per block and`,
  `rank, ${E / EP} counts for the other rank, 8 bytes each (the dispatch exchanges them as float64). Uniform routing: ${N} tokens x topK ${K}`,
  `x (ep - 1) / ep rows per rank and block, the same factors. Means over the ${steps} timed steps.`,
  '',
  '| per step, both ranks | rows exchanged (MiB) | count exchanges (bytes) | total (MiB) | measured / this |',
  '|---|---:|---:|---:|---:|',
  `| measured | ${mib(mRow)} | ${n(mCnt)} | ${mib(mRow + mCnt)} | 1.000 |`,
  `| implied by the routing | ${mib(iRow)} | ${n(iCnt)} | ${mib(iRow + iCnt)} | ${((mRow + mCnt) / (iRow + iCnt)).toFixed(4)} |`,
  `| implied by a uniform routing | ${mib(uniformRows)} | ${n(iCnt)} | ${mib(uniformRows + iCnt)} | ${((mRow + mCnt) / (uniformRows + iCnt)).toFixed(4)} |`,
  '',
  `Measured equals the routing's count ${exactEvery ? 'exactly on every timed step' : '**not** on every timed step'}. ` +
    `${(remoteShare * 100).toFixed(1)}% of the routed rows went to the other rank's experts (uniform: ${(100 * (EP - 1) / EP).toFixed(0)}%). ` +
    `${mean(calls) / EP} all-to-all calls per rank and step (${mean(dispatches) / EP} MoE forwards: a count exchange and two row exchanges each, two more row exchanges in backward); ` +
    `from issuing them to the end of their waits they took ${ms(a2aMs)} ms of a rank's ep = ${EP} step (median over ranks and steps).`,
  '',
  `Reproduce: \`${cmd}\` (${wallS.toFixed(0)} s here).`,
].join('\n');
if (!a['no-write'] && !a.smoke) writeSection('moe', body);
console.log(body);
