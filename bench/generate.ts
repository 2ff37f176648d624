// Benchmark: tokens per second of greedy generation, 300 new tokens after a 16-token prompt, one
// intra-op thread: flotilla with its key/value cache, flotilla recomputing the whole context for
// every token, and a PyTorch loop with a cache (bench/generate_peer.py) on the same weights. Both
// decode the same tokens (checked). Rounds alternate between the two sides.
//
//   node --import tsx bench/generate.ts [--tokens 300] [--rounds 5] [--no-write]
//
// Writes its section of docs/BENCHMARKS.md (between <!-- generate:begin --> and <!-- generate:end -->).
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { setNumThreads, torchVersion } from '../src/tensor/index.js';
import { GPT, type GPTConfig } from '../src/models/gpt.js';
import { generate } from '../src/inference/generate.js';
import { saveSafetensors } from '../src/checkpoint/safetensors.js';
import { median, writeSection } from './report.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..');
const { values: args } = parseArgs({ options: { tokens: { type: 'string', default: '300' }, rounds: { type: 'string', default: '5' }, 'no-write': { type: 'boolean', default: false } } });
const N = Number(args.tokens), ROUNDS = Number(args.rounds);

const cfg: GPTConfig = { vocabSize: 512, blockSize: 512, nLayer: 4, nHead: 8, nEmbd: 256, dropout: 0, bias: true, tieEmbeddings: false };
setNumThreads(1);
const model = new GPT(cfg, { initSeed: 7 });
const prompt = Array.from({ length: 16 }, (_, i) => (i * 37 + 11) % cfg.vocabSize);
const dir = mkdtempSync(join(tmpdir(), 'flotilla-generate-'));
const weights = join(dir, 'gpt.safetensors');
saveSafetensors(weights, Object.fromEntries(model.namedParameters()), { format: 'pt' });

const timed = (cache: boolean, n: number): { s: number; cpu: number; tokens: number[] } => {
  const t0 = performance.now();
  const c0 = process.cpuUsage();
  const [tokens] = generate(model, [prompt], { maxNewTokens: n, temperature: 0, cache });
  const c = process.cpuUsage(c0);
  return { s: (performance.now() - t0) / 1000, cpu: (c.user + c.system) / 1e6, tokens: tokens! };
};

const peer = (rounds: number): { tokens: number[]; seconds: number[]; cpu: number[]; torch: string } => {
  const r = spawnSync('/usr/bin/python3', [join(ROOT, 'bench', 'generate_peer.py'), weights, JSON.stringify(cfg), JSON.stringify(prompt), String(N), String(rounds)], {
    encoding: 'utf8', env: { ...process.env, OMP_NUM_THREADS: '1', MKL_NUM_THREADS: '1' },
  });
  if (r.status !== 0) throw new Error(`PyTorch peer failed:\n${r.stderr}`);
  return JSON.parse(r.stdout.trim().split('\n').pop()!);
};

timed(true, 20); // warm-up
const cached: number[] = [], torch: number[] = [], cachedCpu: number[] = [], torchCpu: number[] = [];
let same = true;
for (let i = 0; i < ROUNDS; i++) {
  const f = timed(true, N);
  cached.push(f.s);
  cachedCpu.push(f.cpu);
  const p = peer(1);
  torch.push(p.seconds[0]!);
  torchCpu.push(p.cpu[0]!);
  same &&= JSON.stringify(p.tokens) === JSON.stringify(f.tokens);
}
// The uncached path is slow (the whole context per token): one round on fewer tokens is enough for its rate.
const UNCACHED = Math.min(N, 100);
const uncached = timed(false, UNCACHED);
const rate = (s: number, n = N) => n / s;
const rows = [
  ['flotilla, key/value cache', rate(median(cached)), rate(median(cachedCpu))],
  ['flotilla, no cache (whole context per token)', rate(uncached.s, UNCACHED), rate(uncached.cpu, UNCACHED)],
  ['PyTorch loop with a cache (torch.cat)', rate(median(torch)), rate(median(torchCpu))],
] as const;
const lines = [
  '## Generation',
  '',
  `\`node --import tsx bench/generate.ts --tokens ${N} --rounds ${ROUNDS}\`: greedy decoding of ${N} tokens after a 16-token prompt, one thread, GPT ${cfg.nLayer} layers x width ${cfg.nEmbd}, ${cfg.nHead} heads, vocabulary ${cfg.vocabSize}, float32; libtorch ${torchVersion()}. Median of ${ROUNDS} rounds alternating flotilla and PyTorch${same ? '; both decoded the same tokens' : '; THE TOKENS DIFFERED'}.`,
  '',
  '| side | tokens/s (wall) | tokens per CPU second |',
  '|---|---|---|',
  ...rows.map(([k, v, c]) => `| ${k} | ${v.toFixed(1)} | ${c.toFixed(1)} |`),
  '',
  `flotilla with the cache / PyTorch with the cache: **${(rate(median(cached)) / rate(median(torch))).toFixed(2)}x** the tokens per second of wall time, **${(rate(median(cachedCpu)) / rate(median(torchCpu))).toFixed(2)}x** per CPU second (load average ${loadavg()[0]!.toFixed(1)} when written; on a busy machine the CPU-time ratio is the steadier one); the cache / no cache: ${(rate(median(cached)) / rate(uncached.s, UNCACHED)).toFixed(1)}x (the no-cache rate is over ${UNCACHED} tokens, where its context is shortest).`,
];
console.log(lines.join('\n'));
if (!args['no-write']) writeSection('generate', lines.join('\n'));
model.dispose();
rmSync(dir, { recursive: true, force: true });
