// Checkpoint benchmark on 2 ranks: save and load time and bytes written per rank for the demo GPT
// and a model about 10x larger, under data parallelism, ZeRO-1 and ZeRO-3, and how long training is
// blocked by a background save against a blocking one. Writes its section of docs/BENCHMARKS.md.
//   node --import tsx bench/checkpoint.ts [--saves 3]
import { join } from 'node:path';
import { runWorld } from '../test/helpers/world.js';
import { median, writeSection, parseBench } from './report.js';

const argv = process.argv.slice(2);
const saves = argv.includes('--saves') ? Number(argv[argv.indexOf('--saves') + 1]) : 3;
const models = { demo: { nLayer: 4, nHead: 4, nEmbd: 128 }, '10x': { nLayer: 8, nHead: 8, nEmbd: 320 } };
const stages = [0, 1, 3];
const root = join(import.meta.dirname, '..');
const r = await runWorld({ nproc: 2, script: join(root, 'bench', 'checkpoint_rank.ts'), args: [JSON.stringify({ models, stages, saves })], env: { FLOTILLA_BACKEND: 'gloo' }, timeoutMs: 1_800_000 });
if (r.codes.some((c) => c !== 0)) throw new Error(`ranks failed:\n${r.outputs.join('\n')}`);
type Row = { blocking: number[]; asyncBlocked: number[]; asyncPublished: number[]; load: number[]; bytes: number[]; stepMs: number[]; stepWithSaveMs: number[]; numParams: number };
const ranks = r.outputs.map((o) => parseBench<Record<string, Row>>(o));
const MB = 2 ** 20;
const rows: string[] = [];
for (const size of Object.keys(models)) {
  for (const z of stages) {
    const k = `${size}-zero${z}`;
    const all = ranks.map((x) => x[k]!);
    const med = (f: (x: Row) => number[]) => median(all.flatMap(f));
    const blocking = med((x) => x.blocking);
    const blocked = med((x) => x.asyncBlocked);
    rows.push(
      `| ${size} (${(all[0]!.numParams / 1e6).toFixed(2)}M) | ${z === 0 ? 'data parallel' : `ZeRO-${z}`} | ${all.map((x) => (x.bytes[0]! / MB).toFixed(2)).join(' / ')} | ` +
        `${blocking.toFixed(1)} | ${blocked.toFixed(1)} (${((100 * blocked) / blocking).toFixed(1)}%) | ${med((x) => x.asyncPublished).toFixed(1)} | ` +
        `${med((x) => x.stepMs).toFixed(1)} / ${med((x) => x.stepWithSaveMs).toFixed(1)} | ${med((x) => x.load).toFixed(1)} |`,
    );
  }
}
const body = [
  '## Checkpoints: save, background save and load, 2 ranks',
  '',
  `\`node --import tsx bench/checkpoint.ts\` — GPT (vocabulary 256, context 128) with AdamW state after two steps, Gloo, one thread per rank; ${saves} saves`,
  'per mode, medians over both ranks. "Blocked" is the time the training loop waits in `save()`: for a blocking save the copy, the write,',
  'the fsync and the publication; for a background save the copy of this rank\'s pieces only (the writer thread does the rest while',
  'training continues). "Published" is from the call until meta.json is renamed into place. Step times are a training step with no',
  'save in flight and one taken while the writer thread works. Load reads this rank\'s byte ranges and verifies its files\' SHA-256.',
  '',
  '| model | layout | MiB written per rank (r0 / r1) | blocking save ms | background save: blocked ms (% of blocking) | published ms | step ms: idle / during write | load ms |',
  '|---|---|---|---|---|---|---|---|',
  ...rows,
  '',
  'Target: a background save blocks training for at most 10% of a blocking save.',
].join('\n');
writeSection('checkpoint', body);
process.stdout.write(`${body}\n`);
