// Cross-entropy of a language-model head: the loss and its backward from the hidden state, eager
// (head matmul, full logits, F.crossEntropy) against the chunked kernel (src/nn/kernels/
// linear_cross_entropy.ts), and PyTorch 1.13 eager (linear_ce_peer.py) on the same shapes. Each
// variant runs in a process of its own; it reports its time per loss + backward (median of the
// timed iterations after one warm-up) and its peak RSS (VmHWM), minus the RSS once its inputs exist.
//
//   node --import tsx bench/linear_ce.ts [--tokens 4096] [--dim 512] [--vocab 32000] [--iters 3] [--threads 2]
import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';

const arg = (name: string, dflt: number): number => {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? Number(process.argv[i + 1]) : dflt;
};
const o = { tokens: arg('tokens', 4096), dim: arg('dim', 512), vocab: arg('vocab', 32000), iters: arg('iters', 3), threads: arg('threads', 2) };
const here = dirname(fileURLToPath(import.meta.url));

/** Target ids: every 10th IGNORE_INDEX (-100), the rest i * 7919 mod vocab (the Python peer makes the same). */
function targetIds(): BigInt64Array {
  return BigInt64Array.from({ length: o.tokens }, (_, i) => BigInt(i % 10 === 9 ? -100 : (i * 7919) % o.vocab));
}

function rssKiB(field: 'VmRSS' | 'VmHWM'): number {
  const m = new RegExp(`${field}:\\s+(\\d+) kB`).exec(readFileSync('/proc/self/status', 'utf8'));
  return Number(m![1]);
}

async function child(kind: 'eager' | 'fused'): Promise<void> {
  const ft = await import('../src/tensor/index.js');
  const { F } = await import('../src/nn/index.js');
  const { linearCrossEntropy } = await import('../src/nn/kernels/linear_cross_entropy.js');
  ft.setNumThreads(o.threads);
  ft.manualSeed(0);
  const h = ft.randn([o.tokens, o.dim]).requiresGrad_();
  const w = ft.randn([o.vocab, o.dim]).mul(0.02).detach().requiresGrad_();
  // every 10th target ignored (IGNORE_INDEX), as a masked batch has some
  const t = ft.tensor(targetIds(), { dtype: 'int64' });
  const base = rssKiB('VmRSS');
  const times: number[] = [];
  let loss = 0;
  for (let i = 0; i <= o.iters; i++) {
    const t0 = performance.now();
    ft.tidy(() => {
      const l = kind === 'fused' ? linearCrossEntropy(h, w, t).loss : F.crossEntropy(F.linear(h, w), t, { reduction: 'sum' });
      l.backward();
      loss = l.item();
    });
    if (i > 0) times.push(performance.now() - t0);
    h.grad!.zero_();
    w.grad!.zero_();
  }
  times.sort((a, b) => a - b);
  process.stdout.write(JSON.stringify({ kind, ms: times[times.length >> 1], peakMiB: rssKiB('VmHWM') / 1024, extraMiB: (rssKiB('VmHWM') - base) / 1024, loss }) + '\n');
}

function main(): void {
  const shape = `tokens ${o.tokens}, dim ${o.dim}, vocab ${o.vocab}, float32, ${o.threads} thread(s), ${o.iters} timed iteration(s)`;
  console.log(`linear + cross-entropy (sum, 10% ignored) + backward; ${shape}`);
  const rows: { kind: string; ms: number; peakMiB: number; extraMiB: number; loss: number }[] = [];
  for (const kind of ['eager', 'fused']) {
    const r = spawnSync(process.execPath, ['--import', 'tsx', fileURLToPath(import.meta.url), '--child', kind, ...process.argv.slice(2)], { encoding: 'utf8' });
    if (r.status !== 0) throw new Error(`${kind}: ${r.stderr}`);
    rows.push(JSON.parse(r.stdout.trim().split('\n').pop()!));
  }
  const py = spawnSync('/usr/bin/python3', [join(here, 'linear_ce_peer.py'), String(o.tokens), String(o.dim), String(o.vocab), String(o.iters), String(o.threads)], { encoding: 'utf8' });
  if (py.status !== 0) throw new Error(`torch: ${py.stderr}`);
  rows.push(JSON.parse(py.stdout.trim().split('\n').pop()!));
  console.log('variant          ms/iter   peak RSS MiB   above inputs MiB   loss');
  for (const r of rows) console.log(`${r.kind.padEnd(15)} ${r.ms.toFixed(0).padStart(8)} ${r.peakMiB.toFixed(0).padStart(14)} ${r.extraMiB.toFixed(0).padStart(18)}   ${r.loss.toFixed(2)}`);
}

const ci = process.argv.indexOf('--child');
if (ci > 0) await child(process.argv[ci + 1] as 'eager' | 'fused');
else main();
