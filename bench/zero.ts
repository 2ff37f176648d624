// Sharding benchmark on 2 ranks: per-rank memory of each ZeRO stage against theory, the step time
// of each stage relative to flotilla's plain data parallelism, and PyTorch 1.13's DDP and
// ZeroRedundancyOptimizer (ZeRO-1) on the same GPT and batch, alternating trials in one run.
// Writes its section of docs/BENCHMARKS.md.
//   node --import tsx bench/zero.ts [--steps 8] [--trials 2] [--bucket-mb 2]
import { join } from 'node:path';
import { runWorld } from '../test/helpers/world.js';
import { median, writeSection, runTorchPeers, parseBench } from './report.js';

const argv = process.argv.slice(2);
const arg = (name: string, dflt: number) => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const opts = { steps: arg('--steps', 8), warmup: 2, bucketMb: arg('--bucket-mb', 2), stages: [0, 1, 2, 3] };
const trials = arg('--trials', 2);
const root = join(import.meta.dirname, '..');

interface Mem { paramBytes: number; gradBytes: number; optimizerBytes: number; peakBytes: number }
type FlRank = Record<string, { times: number[]; memory: Mem; peak: number; numParams: number }>;
type PtRank = Record<string, { times: number[]; optimizerBytes: number }>;

async function flotilla(): Promise<FlRank[]> {
  const r = await runWorld({ nproc: 2, script: join(root, 'bench', 'zero_rank.ts'), args: [JSON.stringify(opts)], timeoutMs: 900_000 });
  if (r.codes.some((c) => c !== 0)) throw new Error(`flotilla ranks failed:\n${r.outputs.join('\n')}`);
  return r.outputs.map((o) => parseBench<FlRank>(o));
}

async function pytorch(): Promise<PtRank[]> {
  return (await runTorchPeers(join(root, 'bench', 'zero_peer.py'), [JSON.stringify(opts)])).map((o) => parseBench<PtRank>(o));
}

const fl: FlRank[] = [], pt: PtRank[] = [];
for (let t = 0; t < trials; t++) {
  fl.push(...(await flotilla()));
  pt.push(...(await pytorch()));
}
const fMed = (k: string) => median(fl.flatMap((r) => r[k]!.times));
const pMed = (k: string) => median(pt.flatMap((r) => r[k]!.times));
const dp = fMed('zero0');
const N = 2;
const theory: Record<string, [number, number, number]> = { zero0: [4, 4, 8], zero1: [4, 4, 8 / N], zero2: [4, 4 / N, 8 / N], zero3: [4 / N, 4 / N, 8 / N] };
const targets: Record<string, string> = { zero0: '', zero1: '<= 1.05', zero2: '<= 1.05', zero3: '<= 1.25' };
const rows = opts.stages.map((z) => {
  const k = `zero${z}`;
  const r0 = fl[0]![k]!;
  const per = (b: number) => (b / r0.numParams).toFixed(2);
  const [tp, tg, to] = theory[k]!;
  const ratio = fMed(k) / dp;
  const peak = Math.max(...fl.map((r) => r[k]!.peak));
  return `| ${z === 0 ? 'data parallel' : `ZeRO-${z}`} | ${fMed(k).toFixed(1)} | ${ratio.toFixed(3)}${targets[k] ? ` (target ${targets[k]}${ratio <= Number(targets[k]!.slice(3)) ? ', met' : ', missed'})` : ''} | ` +
    `${per(r0.memory.paramBytes)} / ${per(r0.memory.gradBytes)} / ${per(r0.memory.optimizerBytes)} | ${tp} / ${tg} / ${to} | ${per(peak)} |`;
});
const ptDdp = pMed('ddp'), ptZ1 = pMed('zero1');
const body = [
  '## Sharded data parallelism (ZeRO-1/2/3), 2 ranks',
  '',
  '`node --import tsx bench/zero.ts` — the 3.3M-parameter GPT of the DDP benchmark, 8 x 128 tokens per rank, AdamW, float32, 2 MiB buckets',
  `(ZeRO-3: one bucket per block, embedding and head), one intra-op thread per rank; ${trials} alternating trials of ${opts.steps} timed steps`,
  'after 2 warm-up steps, medians over both ranks. Memory is what rank 0 holds after a step (resident storage, bytes per',
  'parameter: parameters / gradients / optimizer state), against theory for AdamW in float32 over N = 2 shards; the peak',
  'is the most parameter + gradient bytes held at once during a step, plus optimizer state.',
  '',
  '| layout | step ms | vs data parallel | held B/param (p / g / opt) | theory | step peak B/param |',
  '|---|---|---|---|---|---|',
  ...rows,
  '',
  'PyTorch 1.13 peers in the same run (Gloo, same model and batch):',
  '',
  '| PyTorch | step ms | flotilla counterpart / PyTorch |',
  '|---|---|---|',
  `| DistributedDataParallel + AdamW | ${ptDdp.toFixed(1)} | data parallel ${(dp / ptDdp).toFixed(3)} |`,
  `| DDP + ZeroRedundancyOptimizer(AdamW) (ZeRO-1) | ${ptZ1.toFixed(1)} | ZeRO-1 ${(fMed('zero1') / ptZ1).toFixed(3)} |`,
  '',
  'PyTorch FSDP (FULL_SHARD) could not be measured: Debian\'s PyTorch 1.13 fails to import torch.distributed.fsdp under',
  'Python 3.11 (a dataclass with a mutable default in torch.distributed._shard).',
].join('\n');
writeSection('zero', body);
console.log(body);
