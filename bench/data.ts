// Data pipeline benchmark: `flotilla prepare` throughput (MB of text per second, one worker and all
// of them), the loader's tokens/s against what a training step of the demo model consumes, and the
// resident memory of a process reading batches from corpora of 1x, 4x and 16x the size.
//
//   node --import tsx bench/data.ts [--no-write]
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { availableParallelism, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { loadMobyDick } from '../src/data/corpus.js';
import { prepare } from '../src/data/prepare.js';
import { WordCounter, trainBpe } from '../src/data/bpe_train.js';
import { loadTrainData } from '../src/data/sources.js';
import { DataLoader } from '../src/data/loader.js';
import { tidy } from '../src/tensor/index.js';
import { parseConfig } from '../src/config/index.js';
import { train } from '../src/train/trainer.js';
import { makeDataset, measure } from '../test/fixtures/data_rss.js';
import { writeSection } from './report.js';

const write = !process.argv.includes('--no-write');
const root = mkdtempSync(join(tmpdir(), 'flotilla-bench-data-'));
const cores = availableParallelism();
const lines: string[] = [];
const log = (l: string) => {
  console.log(l);
  lines.push(l);
};

try {
  // ---- corpus: Moby-Dick's paragraphs as jsonl documents, 8 copies (about 10 MB of text)
  const paragraphs = loadMobyDick().split(/\n\s*\n/).map((p) => p.trim()).filter((p) => p.length > 0);
  const jsonl = join(root, 'moby.jsonl');
  const copies = 8;
  writeFileSync(jsonl, Array.from({ length: copies }, (_, c) => paragraphs.map((text, i) => JSON.stringify({ id: `${c}-${i}`, text })).join('\n')).join('\n') + '\n');
  const counter = new WordCounter();
  counter.add(loadMobyDick());
  const bpe = join(root, 'bpe1024.json');
  writeFileSync(bpe, JSON.stringify(trainBpe(counter.counts, 1024).json));

  // ---- prepare throughput
  const prepRows: string[] = [];
  const dirs: Record<string, string> = {};
  for (const [label, tok] of [['GPT-2 (gpt-tokenizer)', 'gpt2'], ['BPE 1,024 from tokenizer.json (@huggingface/tokenizers)', bpe], ['bytes', 'byte']] as const) {
    const per: Record<number, number> = {};
    for (const workers of [1, cores]) {
      dirs[`${tok}/${workers}`] = join(root, `prepared-${prepRows.length}-${workers}`);
      const r = await prepare({ sources: [jsonl], tokenizer: tok, out: dirs[`${tok}/${workers}`]!, workers, shardMb: 1, print: () => {}, progress: false });
      per[workers] = r.bytes / 1e6 / r.seconds;
      console.log(`prepare ${label}, ${workers} worker(s): ${per[workers]!.toFixed(2)} MB/s (${r.manifest.tokens.toLocaleString('en-US')} tokens)`);
    }
    prepRows.push(`| ${label} | ${per[1]!.toFixed(2)} | ${per[cores]!.toFixed(2)} | ${(per[cores]! / per[1]!).toFixed(2)}x |`);
  }

  // ---- the trainer's demand: the demo model (examples/gpt-tiny.toml) in one process
  const cfg = parseConfig('[model]\nvocabSize = 0\nblockSize = 128\nnLayer = 4\nnHead = 4\nnEmbd = 128\n[data]\nseqLen = 128\nglobalBatch = 16\n', [
    '--train.steps=12', '--train.evalEvery=0', '--train.evalBatches=1', '--log.progress=off', '--log.metrics=', `--train.runDir=${join(root, 'run')}`,
  ]);
  const summary = await train(cfg, { print: () => {} });
  const demand = summary.tokensPerSec;

  // ---- the loader alone over GPT-2 shards of the corpus (next(): windows, int64 tensors)
  const gptDir = dirs['gpt2/1']!;
  const loaderRows: string[] = [];
  for (const prefetch of [0, 2]) {
    const data = await loadTrainData({ source: gptDir, sources: [], tokenizer: 'gpt2', valSource: '', valFraction: 0.05, seqLen: 128 }, { modelVocab: 0 });
    const l = new DataLoader({ sources: data.train, seqLen: 128, globalBatch: 16, seed: 1, prefetch });
    for (let i = 0; i < 50; i++) tidy(() => l.next());
    const n = 3000;
    const t0 = performance.now();
    for (let i = 0; i < n; i++) tidy(() => l.next());
    const tps = (n * 16 * 128) / ((performance.now() - t0) / 1000);
    l.close();
    data.close();
    loaderRows.push(`| ${prefetch === 0 ? 'inline (prefetch = 0)' : 'worker thread (prefetch = 2)'} | ${Math.round(tps).toLocaleString('en-US')} | ${(tps / demand).toFixed(0)}x |`);
    console.log(`loader ${prefetch}: ${Math.round(tps)} tokens/s, demand ${Math.round(demand)}`);
  }

  // ---- resident memory against corpus size
  const rssRows: string[] = [];
  for (const [mult, tokens] of [[1, 64 << 20], [4, 256 << 20], [16, 1024 << 20]] as const) {
    const ds = makeDataset(root, `rss${mult}`, tokens, 4);
    const m = await measure(ds, 300);
    rssRows.push(`| ${mult}x | ${(m.tokens / 1e6).toFixed(0)}M | ${((m.tokens * 2) / 1e9).toFixed(2)} GB | ${(m.hwmKb / 1024).toFixed(1)} | ${(m.rssKb / 1024).toFixed(1)} |`);
    console.log(`rss ${mult}x: ${m.hwmKb} kB`);
    rmSync(ds, { recursive: true, force: true });
  }

  log('## Data: prepare, loader and memory');
  log('');
  log(`Load average (1 min) at the end of the run: ${loadavg()[0]!.toFixed(1)} on ${cores} cores; other work on the machine slows the prepare and training numbers, not the memory ones.`);
  log('');
  log(`Corpus: Moby-Dick's paragraphs as jsonl documents, ${copies} copies (${(paragraphs.reduce((a, p) => a + Buffer.byteLength(p), 0) * copies / 1e6).toFixed(1)} MB of text). Command: \`node --import tsx bench/data.ts\`.`);
  log('');
  log('### `flotilla prepare` throughput (MB of text per second, wall clock including start-up and the manifest)');
  log('');
  log(`| tokenizer | 1 worker | ${cores} workers | speed-up |`);
  log('|---|---:|---:|---:|');
  for (const r of prepRows) log(r);
  log('');
  log('### Loader tokens/s against the trainer\'s demand');
  log('');
  log(`The demo model (examples/gpt-tiny.toml: 4 layers, width 128, 16 x 128 tokens per step) trains at ${Math.round(demand).toLocaleString('en-US')} tokens/s in one process (12 steps, one thread). The loader alone, reading windows from the GPT-2 shards by byte range and building the int64 (x, y) tensors:`);
  log('');
  log('| loader | tokens/s | / training demand |');
  log('|---|---:|---:|');
  for (const r of loaderRows) log(r);
  log('');
  log('### Resident memory against corpus size');
  log('');
  log('A process opens a prepared dataset through the trainer\'s data path (every shard\'s checksum verified), reads 300 batches of 16 x 256 tokens with the prefetch worker, then its VmHWM and VmRSS are read from /proc/PID/status:');
  log('');
  log('| corpus | tokens | on disk | VmHWM (MiB) | VmRSS (MiB) |');
  log('|---|---:|---:|---:|---:|');
  for (const r of rssRows) log(r);
  if (write) writeSection('data', lines.join('\n'));
} finally {
  rmSync(root, { recursive: true, force: true });
}
