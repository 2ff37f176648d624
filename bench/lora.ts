// LoRA fine-tuning against a full fine-tune of the same model and layout, measured from outside: a
// random Llama written as a Hugging Face directory is the base (`train.initFrom`), and real 2-rank
// trainer runs (Gloo, one thread each) under ZeRO-2 and ZeRO-3 either train all of it or only rank-R
// adapters on every Linear but the head ([lora]). Per run: each rank's peak resident memory (VmHWM),
// the parameters + gradients + optimizer state its layout holds (the wrapper's memory report, what
// the [memory] line prints) and the step time (median of the steps after the first, wall and CPU).
//   node --import tsx bench/lora.ts [--layers 8] [--width 512] [--kv-heads 4] [--rank 8] [--steps 6] [--batch 8] [--write]
// --write replaces the "lora-memory" section of docs/BENCHMARKS.md with the table.
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { Llama, llamaNumParams, type LlamaConfig } from '../src/models/llama.js';
import { savePretrained } from '../src/checkpoint/hf.js';
import { bf16Support } from '../src/tensor/index.js';
import { measureRss, rssTimeline, stepSeconds, MiB, type RankRss } from '../test/helpers/rss.js';
import { median, writeSection } from './report.js';

const { values: a } = parseArgs({ options: { layers: { type: 'string', default: '8' }, width: { type: 'string', default: '512' }, 'kv-heads': { type: 'string', default: '4' }, rank: { type: 'string', default: '8' }, steps: { type: 'string', default: '6' }, batch: { type: 'string', default: '8' }, write: { type: 'boolean', default: false } } });
const layers = Number(a.layers), width = Number(a.width), kvHeads = Number(a['kv-heads']), rank = Number(a.rank), steps = Number(a.steps), batch = Number(a.batch);
if (!(steps >= 3)) throw new Error(`--steps must be at least 3 (the first step is not timed), not ${a.steps}`);
const ALPHA = 16;
const model: Partial<LlamaConfig> = { vocabSize: 256, blockSize: 128, nLayer: layers, nHead: 8, nKvHead: kvHeads, nEmbd: width };
const env: Record<string, string> = process.env.FLOTILLA_MALLOC ? { FLOTILLA_MALLOC: process.env.FLOTILLA_MALLOC } : {};
const dir = mkdtempSync(join(os.tmpdir(), 'flotilla-bench-lora-'));
const base = join(dir, 'base');

type Run = 'full' | 'lora';
function overrides(zero: number, run: Run): string[] {
  return [
    '--model.arch=llama', ...Object.entries(model).map(([k, v]) => `--model.${k}=${v}`),
    '--data.seqLen=128', `--data.globalBatch=${batch}`, '--data.valFraction=0.1',
    `--train.steps=${steps}`, '--train.evalEvery=0', '--train.evalBatches=1', '--train.threads=1', `--train.runDir=${join(dir, `${run}-z${zero}`)}`,
    `--train.initFrom=${base}`,
    '--optim.warmupSteps=1', '--checkpoint.every=0', '--log.progress=plain', '--log.every=1',
    '--parallel.backend=gloo', `--parallel.zero=${zero}`,
    ...(run === 'lora' ? [`--lora.rank=${rank}`, `--lora.alpha=${ALPHA}`] : []),
  ];
}

/** What the layout's buffers hold on a rank: parameters + gradients + optimizer state, bytes. */
const stateBytes = (r: RankRss): number => (r.memory ? r.memory.paramBytes + r.memory.gradBytes + r.memory.optimizerBytes : NaN);

const mib = (b: number) => (b / MiB).toFixed(1);
const load0 = os.loadavg()[0]!;
const results = new Map<string, RankRss[]>();
const key = (zero: number, run: Run) => `${run}-z${zero}`;
try {
  // The base: a random Llama as a Hugging Face directory (config.json + model.safetensors).
  savePretrained(new Llama(model, { initSeed: 1 }), base);
  for (const zero of [2, 3]) {
    for (const run of ['full', 'lora'] as const) {
      const rs = await measureRss(overrides(zero, run), { env });
      results.set(key(zero, run), rs);
      const full = results.get(key(zero, 'full'))!;
      if (run === 'lora' && !(rs[0]!.memory!.gradBytes < full[0]!.memory!.gradBytes / 10)) {
        throw new Error(`the LoRA run holds gradients of ${mib(rs[0]!.memory!.gradBytes)} MiB, the full fine-tune ${mib(full[0]!.memory!.gradBytes)} MiB: the trainer did not train the adapters alone`);
      }
      console.log(`ZeRO-${zero} ${run}: VmHWM ${rs.map((r) => `rank ${r.rank} ${r.peakMiB.toFixed(0)} MiB`).join(', ')}; state ${rs.map((r) => (stateBytes(r) / MiB).toFixed(1)).join(', ')} MiB; ` +
        `step ${rs.map((r) => `${(median(stepSeconds(r).wall) * 1e3).toFixed(0)} ms (CPU ${(median(stepSeconds(r).cpu) * 1e3).toFixed(0)} ms)`).join(', ')}`);
      for (const r of rs) console.log(`  rank ${r.rank} max VmRSS up to each marker (MiB): ${rssTimeline(r, steps)}`);
      if (rs[0]!.memoryLine) console.log(`  ${rs[0]!.memoryLine}`);
    }
  }
} finally {
  rmSync(dir, { recursive: true, force: true });
}
const load1 = os.loadavg()[0]!;

const P = llamaNumParams(model);
const ms = (s: number) => (s * 1e3).toFixed(0);
// A rank's figures: the largest of the ranks' peaks and states, the median of all ranks' step times.
const peak = (rs: RankRss[]) => Math.max(...rs.map((r) => r.peakMiB));
const state = (rs: RankRss[]) => Math.max(...rs.map(stateBytes));
const step = (rs: RankRss[], w: 'wall' | 'cpu') => median(rs.flatMap((r) => stepSeconds(r)[w]));
const rows: string[] = [];
const verdicts: string[] = [];
for (const zero of [2, 3]) {
  const full = results.get(key(zero, 'full'))!, lora = results.get(key(zero, 'lora'))!;
  for (const [run, rs] of [['full fine-tune', full], [`LoRA rank ${rank}`, lora]] as const) {
    const isLora = rs === lora;
    const ratio = (x: number, y: number, goal?: number) => (isLora ? ` (${(x / y).toFixed(2)}x${goal === undefined ? '' : x / y <= goal ? ', meets' : ', misses'})` : '');
    const m = rs[0]!.memory;
    rows.push(`| ZeRO-${zero} | ${run} | ${rs.map((r) => r.peakMiB.toFixed(0)).join(' / ')}${ratio(peak(rs), peak(full), 0.6)} | ` +
      `${m ? `${mib(m.paramBytes)} + ${mib(m.gradBytes)} + ${mib(m.optimizerBytes)}` : '-'} = ${mib(state(rs))}${ratio(state(rs), state(full), 0.3)} | ` +
      `${ms(step(rs, 'wall'))}${ratio(step(rs, 'wall'), step(full, 'wall'))} | ${ms(step(rs, 'cpu'))}${ratio(step(rs, 'cpu'), step(full, 'cpu'))} |`);
  }
  verdicts.push(`ZeRO-${zero}: state ${(state(lora) / state(full)).toFixed(2)}x (goal <= 0.30), peak RSS ${(peak(lora) / peak(full)).toFixed(2)}x (goal <= 0.6), step ${(step(lora, 'wall') / step(full, 'wall')).toFixed(2)}x`);
}
const body = [
  '## LoRA fine-tuning: memory and step time vs a full fine-tune (2 ranks)',
  '',
  `\`node --import tsx bench/lora.ts --layers ${layers} --width ${width} --kv-heads ${kvHeads} --rank ${rank} --steps ${steps} --batch ${batch} --write\` — ` +
    `a random ${(P / 1e6).toFixed(1)}M-parameter Llama (${layers} layers, width ${width}, 8 query heads sharing ${kvHeads} key/value heads, vocab 256, context 128) ` +
    'written as a Hugging Face directory (savePretrained) is `train.initFrom` of real trainer runs on 2 Gloo ranks, one thread each, float32, AdamW, ' +
    `global batch ${batch} x 128, ${steps} steps: a full fine-tune, and LoRA rank ${rank}, alpha ${ALPHA}, on every Linear but the head (\`--lora.rank=${rank}\`), ` +
    'under the same layout. Peak RSS is VmHWM of each rank process after the run (loading the base included); the state is what the layout\'s buffers hold on a rank ' +
    '(the wrapper\'s memory report, the [memory] line: parameters + gradients + optimizer state; the larger rank\'s); a step is the time between two step ends, ' +
    'the median over both ranks of the steps after the first, wall and the process\'s own CPU time. Ratios are LoRA over the full fine-tune of the same layout; ' +
    'goals: state <= 0.30x, peak RSS <= 0.6x.',
  '',
  `CPU: ${os.cpus()[0]?.model.trim() ?? 'cpu'} x ${os.cpus().length} (${bf16Support().native ? 'native' : 'no native'} bfloat16); ` +
    `load average (1 min) at the start and the end of this run: ${load0.toFixed(1)} and ${load1.toFixed(1)}.`,
  '',
  '| layout | run | VmHWM MiB, rank 0 / rank 1 | parameters + gradients + optimizer state MiB (rank 0) | step ms | step CPU ms |',
  '|---|---|---|---|---:|---:|',
  ...rows,
  '',
  verdicts.join('; ') + '.',
].join('\n');
console.log(`\n${body}`);
if (a.write) writeSection('lora-memory', body);
