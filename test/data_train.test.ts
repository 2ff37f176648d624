// Prepare, then train on several ranks: a jsonl corpus and a parquet corpus tokenized with a BPE
// trained here, blended by weight. `flotilla verify` checks that data parallel on 2 ranks and HSDP
// 2 x 2 over these (unequal) shards train exactly as one process on the same global batches, so the
// start-up partition check and the loaders agree; mismatches are errors before any rank starts.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parquetWriteBuffer } from 'hyparquet-writer';
import { REPO_ROOT } from './helpers/world.js';
import { BIN, NO_REPORT } from './helpers/cli.js';
import { pool, spawnAsync, started } from './helpers/pool.js';
import { loadMobyDick } from '../src/data/corpus.js';
import { WordCounter, trainBpe } from '../src/data/bpe_train.js';
import { prepare } from '../src/data/prepare.js';

const dir = mkdtempSync(join(tmpdir(), 'flotilla-data-train-'));
const paragraphs = loadMobyDick().slice(0, 400_000).split(/\n\s*\n/).map((p) => p.trim()).filter((p) => p.length > 40);
const half = Math.floor(paragraphs.length / 2);
const jsonl = join(dir, 'a.jsonl');
writeFileSync(jsonl, paragraphs.slice(0, half).map((text, i) => JSON.stringify({ id: i, text })).join('\n') + '\n');
const parquet = join(dir, 'b.parquet');
writeFileSync(parquet, Buffer.from(parquetWriteBuffer({ columnData: [{ name: 'text', data: paragraphs.slice(half), type: 'STRING' }], rowGroupSize: 300 })));
const counter = new WordCounter();
for (const p of paragraphs) counter.add(p);
const tokPath = join(dir, 'tokenizer.json');
writeFileSync(tokPath, JSON.stringify(trainBpe(counter.counts, 400).json));
const A = join(dir, 'A');
const B = join(dir, 'B');
const quiet = { print: () => {}, progress: false, workers: 2 };
await prepare({ sources: [jsonl], tokenizer: tokPath, out: A, shardMb: 0.05, ...quiet });
await prepare({ sources: [parquet], tokenizer: tokPath, out: B, shardMb: 0.01, ...quiet });

const data = [`--data.sources=${A}:0.7,${B}:0.3`, `--data.tokenizer=${tokPath}`, '--model.vocabSize=0'];
const small = ['--model.nLayer=1', '--model.nEmbd=32', '--model.nHead=2', '--model.blockSize=32', '--data.seqLen=32', '--data.globalBatch=8', '--parallel.bucketSizeMb=0.1'];

// Every launch is queued as soon as the data is prepared, two at a time (test/helpers/pool.ts).
const queue = pool();
function flotilla(args: string[]): Promise<{ code: number | null; out: string }> {
  return started(queue(async () => {
    const r = await spawnAsync(process.execPath, [BIN, ...args], { cwd: REPO_ROOT, env: { ...process.env, ...NO_REPORT }, timeout: 240_000 });
    return { code: r.status, out: `${r.stdout}${r.stderr}` };
  }));
}

// FLOTILLA_DATA_LAYOUT picks one layout (test/data_train_hsdp.test.ts runs this file for HSDP), so
// each file stays short on a small machine.
const layouts = {
  dp2: ['data parallel on 2 ranks', 2, []],
  hsdp: ['HSDP 2 x 2 (ZeRO-2)', 4, ['--parallel.zero=2', '--parallel.dpReplicate=2']],
} as const;
const which = (process.env.FLOTILLA_DATA_LAYOUT ?? 'dp2') as keyof typeof layouts;
const [name, nproc, layout] = layouts[which];
const verified = flotilla(['verify', 'examples/gpt-tiny.toml', '--nproc', String(nproc), '--steps', '2', ...small, ...data, ...layout]);
test(`prepare, then train under ${name} on blended jsonl + parquet shards: verify PASSes against one process`, async () => {
  const r = await verified;
  assert.equal(r.code, 0, r.out);
  assert.match(r.out, /^PASS \(tolerance/m);
});

const runDir = join(dir, 'never');
const refusals: [Promise<{ code: number | null; out: string }>, RegExp][] = which !== 'dp2' ? [] : ([
  [[`--data.sources=${A}:1`, '--data.tokenizer=gpt2'], /A\/manifest\.json was prepared with tokenizer .*tokenizer\.json .* but this run uses gpt2/],
  [[...data, '--model.vocabSize=300'], /model\.vocabSize = 300 is below the 400 ids of data\.tokenizer/],
  [[`--data.source=${join(dir, 'nothing-here')}`], /data\.source: text file .*nothing-here does not exist/],
  [[...data, `--data.valSource=${join(dir, 'a.jsonl')}x`], /data\.valSource: text file .*a\.jsonlx does not exist/],
] as [string[], RegExp][]).map(([args, re]) => [flotilla(['train', 'examples/gpt-tiny.toml', '--nproc', '2', ...small, ...args, `--train.runDir=${runDir}`]), re]);
// Checked once, with the data-parallel layout (the refusals come before any layout is applied).
if (which === 'dp2') {
  test('a tokenizer or vocabulary that does not match the data is an error before any rank starts', async () => {
    for (const [run, re] of refusals) {
      const r = await run;
      assert.equal(r.code, 2, r.out);
      assert.match(r.out, re);
      assert.doesNotMatch(r.out, /\[rank \d\]/, 'no rank started');
    }
    assert.ok(!existsSync(runDir));
  });
}
