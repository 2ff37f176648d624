// Attention alone, forward and backward, at the GPT demo's heads (4 heads of width 32, batch 1):
// the fused kernel (src/nn/kernels/attention.ts) against the eager ops of the GPT's attention
// (scores, mask, softmax, matmul) and PyTorch 1.13's eager attention (bench/attention_peer.py), each
// size and path in a fresh process (bench/attention_run.ts) so each peak memory is its own. Writes
// its section of docs/BENCHMARKS.md (between <!-- attention:begin --> and <!-- attention:end -->).
//
//   node --import tsx bench/attention.ts [--seq 512,2048,8192] [--steps 5] [--threads 2] [--no-write]
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { loadavg } from 'node:os';
import { cpuFlags } from '../src/tensor/cpu_features.js';
import { median, parseBench, writeSection } from './report.js';
import type { RunOpts, RunOut } from './attention_run.js';

const { values: a } = parseArgs({
  options: {
    seq: { type: 'string', default: '512,2048,8192' }, steps: { type: 'string', default: '5' },
    threads: { type: 'string', default: '2' }, 'no-write': { type: 'boolean', default: false },
  },
});
const root = join(import.meta.dirname, '..');
const seqs = a.seq.split(',').map(Number);
const base = { B: 1, H: 4, D: 32, steps: Number(a.steps), threads: Number(a.threads) };

function run(cmd: string, args: string[]): RunOut {
  const r = spawnSync(cmd, args, { cwd: root, encoding: 'utf8', maxBuffer: 1 << 24 });
  if (r.status !== 0) throw new Error(`${args.join(' ')} failed:\n${r.stdout}\n${r.stderr}`);
  return parseBench<RunOut>(r.stdout);
}
const ours = (mode: RunOpts['mode'], T: number) => run(process.execPath, ['--import', 'tsx', join('bench', 'attention_run.ts'), JSON.stringify({ ...base, mode, T } satisfies RunOpts)]);
const torch = (T: number) => run('/usr/bin/python3', [join('bench', 'attention_peer.py'), JSON.stringify({ ...base, T })]);

const ms = (r: RunOut) => median(r.stepMs);
const mib = (r: RunOut) => ((r.peakBytes - r.baseBytes) / 2 ** 20).toFixed(1);
const rows: string[] = [];
const loadBefore = loadavg()[0]!;
for (const T of seqs) {
  const fused = ours('fused', T), eager = ours('eager', T), pt = torch(T);
  const row = `| ${T} | ${ms(fused).toFixed(1)} | ${ms(eager).toFixed(1)} | ${ms(pt).toFixed(1)} | ${(ms(fused) / ms(eager)).toFixed(2)} | ${mib(fused)} | ${mib(eager)} | ${mib(pt)} |`;
  console.log(row);
  rows.push(row);
}
const loadAfter = loadavg()[0]!;
const flags = cpuFlags();
const isa = `${flags.has('avx2') ? 'AVX2' : 'no AVX2'}${flags.has('fma') ? ' + FMA' : ''}, ${flags.has('avx512_bf16') || flags.has('amx_bf16') ? 'native bfloat16' : 'no native bfloat16'}`;
const cmd = `node --import tsx bench/attention.ts --seq ${a.seq} --steps ${base.steps} --threads ${base.threads}`;
const body = [
  '## Fused attention',
  '',
  `Causal attention alone, forward and backward (loss = sum(out * w)), float32, batch ${base.B}, ${base.H} heads of width ${base.D} (the GPT demo's),`,
  `${base.threads} intra-op thread(s); each sequence length and path in a fresh process: one warm-up step, then ${base.steps} timed steps (median).`,
  'Fused: the blocked kernel (src/nn/kernels/attention.ts). Eager: the GPT\'s attention ops (scores, mask, softmax, matmul,',
  'autograd through each). PyTorch: 1.13\'s eager attention (bench/attention_peer.py), the same ops. Memory: the process\'s peak',
  'resident memory (VmHWM) after the steps minus its resident memory (VmRSS) before the first, so inputs and libraries are not counted.',
  `CPU: ${isa}. 1-minute load average ${loadBefore.toFixed(1)} when the run started and ${loadAfter.toFixed(1)} when it ended (other processes share the cores`,
  'when it is above the core count, and the times then vary from run to run).',
  '',
  `\`${cmd}\``,
  '',
  '| seq | fused (ms) | eager (ms) | PyTorch eager (ms) | fused / eager | fused peak (MiB) | eager peak (MiB) | PyTorch peak (MiB) |',
  '|---|---|---|---|---|---|---|---|',
  ...rows,
].join('\n');
if (!a['no-write']) writeSection('attention', body);
else console.log(body);
