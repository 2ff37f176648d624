// ZeRO peak memory, measured from outside: VmHWM of every rank process of a real 2-rank training run
// (the trainer, Gloo) per ZeRO stage, against data parallel and against theory; and the timeline of
// VmRSS through construction and the steps.
//   node --import tsx bench/zero_rss.ts [--layers 8] [--width 512] [--steps 3] [--batch 16] [--write]
// --write replaces the "zero-rss" section of docs/BENCHMARKS.md with the table.
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { measureRss, rssTimeline, theoryBytesPerParam, MiB, type RankRss } from '../test/helpers/rss.js';
import { writeSection } from './report.js';

const argv = process.argv.slice(2);
const arg = (name: string, dflt: number): number => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const layers = arg('--layers', 8), width = arg('--width', 512), steps = arg('--steps', 3), batch = arg('--batch', 8);
const env: Record<string, string> = process.env.FLOTILLA_MALLOC ? { FLOTILLA_MALLOC: process.env.FLOTILLA_MALLOC } : {};
const dir = mkdtempSync(join(tmpdir(), 'flotilla-zero-rss-'));

function overrides(zero: number): string[] {
  return [
    `--model.nLayer=${layers}`, `--model.nEmbd=${width}`, `--model.nHead=${Math.max(1, width / 64)}`, '--model.vocabSize=256', '--model.blockSize=128',
    '--data.seqLen=128', `--data.globalBatch=${batch}`, '--data.valFraction=0.1',
    `--train.steps=${steps}`, '--train.evalEvery=0', '--train.evalBatches=1', '--train.threads=1', `--train.runDir=${join(dir, `z${zero}`)}`,
    '--optim.warmupSteps=1', '--checkpoint.every=0', '--log.progress=plain', '--log.every=1',
    '--parallel.backend=gloo', `--parallel.zero=${zero}`,
  ];
}

const results: Record<number, RankRss[]> = {};
try {
  for (const zero of [0, 1, 2, 3]) {
    results[zero] = await measureRss(overrides(zero), { env });
    const rs = results[zero]!;
    console.log(`zero ${zero}: VmHWM ${rs.map((r) => `rank ${r.rank} ${r.peakMiB.toFixed(0)} MiB`).join(', ')}`);
    for (const r of rs) console.log(`  rank ${r.rank} max VmRSS up to each marker (MiB): ${rssTimeline(r, steps)}`);
    if (rs[0]!.memoryLine) console.log(`  ${rs[0]!.memoryLine}`);
  }
} finally {
  rmSync(dir, { recursive: true, force: true });
}

const P = results[0]![0]!.numParams;
const rows = [0, 1, 2, 3].map((z) => {
  const rs = results[z]!;
  const save = (16 - theoryBytesPerParam(z, 2)) * P / MiB;
  const cells = rs.map((r) => {
    const saved = results[0]![r.rank]!.peakMiB - r.peakMiB;
    return z === 0 ? `${r.peakMiB.toFixed(0)}` : `${r.peakMiB.toFixed(0)} (saves ${saved.toFixed(0)}, ${((100 * saved) / save).toFixed(0)}%)`;
  });
  const rep = rs[0]!.memory;
  return `| ${z === 0 ? 'data parallel' : `ZeRO-${z}`} | ${cells.join(' | ')} | ${z === 0 ? '-' : save.toFixed(0)} | ${rep ? (rep.peakBytes / MiB).toFixed(0) : '-'} |`;
});
const body = [
  '## ZeRO peak memory (2 ranks, peak RSS from outside)',
  '',
  `\`node --import tsx bench/zero_rss.ts --layers ${layers} --width ${width} --steps ${steps} --batch ${batch} --write\` — a ${(P / 1e6).toFixed(1)}M-parameter GPT`,
  `(vocab 256, context 128), AdamW, float32, global batch ${batch} x 128, ${steps} steps through the trainer on 2 Gloo ranks, one thread each.`,
  'Peak is VmHWM of each rank process read from /proc/<pid>/status after the run (construction included); the saving is',
  'against data parallel on the same rank, and the theory is AdamW in float32 (4 B parameters + 4 B gradients + 8 B state',
  'per parameter) over 2 shards: ZeRO-1 saves 4 B/param, ZeRO-2 6 B/param, ZeRO-3 8 B/param.',
  '',
  '| layout | rank 0 VmHWM MiB | rank 1 VmHWM MiB | theory saves MiB | memory line: step peak MiB (rank 0) |',
  '|---|---|---|---|---|',
  ...rows,
].join('\n');
console.log(`\n${body}`);
if (argv.includes('--write')) writeSection('zero-rss', body);
