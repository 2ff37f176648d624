// The demo's tokenizer: bytes against a small BPE trained on Moby-Dick, the demo model
// (examples/gpt-tiny.toml) trained the same number of steps on each, validation loss compared at
// the same wall time in bits per byte of text (nats per token x tokens per byte / ln 2), so the two
// vocabularies are comparable.
//
//   node --import tsx bench/datademo.ts [--steps 300] [--vocab 512] [--no-write]
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { loadMobyDick } from '../src/data/corpus.js';
import { WordCounter, trainBpe } from '../src/data/bpe_train.js';
import { loadTokenizer } from '../src/data/tokenizer.js';
import { loadConfig } from '../src/config/index.js';
import { train } from '../src/train/trainer.js';
import { readMetrics } from '../src/train/metrics.js';
import { writeSection } from './report.js';

const arg = (name: string, dflt: number): number => {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? Number(process.argv[i + 1]) : dflt;
};
const steps = arg('steps', 300);
const vocab = arg('vocab', 512);
const write = !process.argv.includes('--no-write');
const root = mkdtempSync(join(tmpdir(), 'flotilla-bench-demo-'));

try {
  const text = loadMobyDick();
  const counter = new WordCounter();
  counter.add(text);
  const tokPath = join(root, `bpe${vocab}.json`);
  writeFileSync(tokPath, JSON.stringify(trainBpe(counter.counts, vocab).json));
  const runs: { label: string; tokenizer: string; tokensPerByte: number; rows: ReturnType<typeof readMetrics>; seconds: number }[] = [];
  for (const [label, tokenizer] of [['bytes (256)', 'byte'], [`BPE ${vocab} trained on Moby-Dick`, tokPath]] as const) {
    // Tokens per byte of the validation split (the last 10% of the tokens), as the trainer holds it out.
    const tok = await loadTokenizer(tokenizer);
    const ids = Array.from(tok.encode(text));
    const val = ids.slice(ids.length - Math.floor(ids.length * 0.1));
    const tokensPerByte = val.length / Buffer.byteLength(tok.decode(val));
    const runDir = join(root, `run-${runs.length}`);
    const cfg = loadConfig('examples/gpt-tiny.toml', [
      `--data.tokenizer=${tokenizer}`, '--model.vocabSize=0', `--train.steps=${steps}`, '--train.evalEvery=25', '--log.progress=off', `--train.runDir=${runDir}`,
    ]);
    const t0 = performance.now();
    await train(cfg, { print: () => {} });
    const seconds = (performance.now() - t0) / 1000;
    runs.push({ label, tokenizer, tokensPerByte, rows: readMetrics(join(runDir, 'metrics.jsonl')), seconds });
    console.log(`${label}: ${seconds.toFixed(0)} s, ${tokensPerByte.toFixed(3)} tokens/byte`);
  }
  // The same wall time: the shorter run's; each run's last validation at or before it.
  const budget = Math.min(...runs.map((r) => r.rows[r.rows.length - 1]!.elapsedS!));
  const lines = [
    '## Demo tokenizer: bytes or a small BPE (bits per byte at the same wall time)',
    '',
    `examples/gpt-tiny.toml (4 layers, width 128, context 128, 16 x 128 tokens per step) in one process, ${steps} steps on each tokenizer, validation every 25 steps on the held-out last 10% of Moby-Dick; compared at ${budget.toFixed(0)} s of training (the shorter run's length). Bits per byte = validation loss (nats per token) x tokens per byte of the validation text / ln 2. Command: \`node --import tsx bench/datademo.ts --steps ${steps} --vocab ${vocab}\`.`,
    '',
    '| tokenizer | tokens per byte | steps done at the budget | val loss (nats/token) | bits per byte | train tokens/s |',
    '|---|---:|---:|---:|---:|---:|',
  ];
  const bpb: number[] = [];
  for (const r of runs) {
    const evals = r.rows.filter((x) => x.valLoss !== undefined && x.elapsedS! <= budget + 1e-9);
    const last = evals[evals.length - 1]!;
    const b = (last.valLoss! * r.tokensPerByte) / Math.LN2;
    bpb.push(b);
    const tps = r.rows.reduce((a, x) => a + x.tokensPerSec, 0) / r.rows.length;
    lines.push(`| ${r.label} | ${r.tokensPerByte.toFixed(3)} | ${last.step} | ${last.valLoss!.toFixed(4)} | ${b.toFixed(3)} | ${Math.round(tps).toLocaleString('en-US')} |`);
  }
  const better = bpb[1]! < bpb[0]! ? 1 : 0;
  lines.push('', `Lower bits per byte at the same wall time: **${runs[better]!.label}** (${bpb[better]!.toFixed(3)} against ${bpb[1 - better]!.toFixed(3)}).`);
  console.log(lines.join('\n'));
  if (write) writeSection('datademo', lines.join('\n'));
} finally {
  rmSync(root, { recursive: true, force: true });
}
