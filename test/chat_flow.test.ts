// The README's "Instruction and preference tuning" path through the CLI, with its example configs
// (examples/sft-chat.toml, examples/dpo.toml) on a tiny Llama: LoRA SFT on conversations of real
// text (prepared from the .jsonl before the ranks start, packed, an epoch), a merged export that
// takes the tokenizer and its chat template along, DPO with new adapters whose reference is the
// merged model (first step ln 2), a PEFT export, and generate --chat: the run, and the merged model
// with the PEFT adapter, answer alike.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setNumThreads } from '../src/tensor/index.js';
import { Llama } from '../src/models/llama.js';
import { savePretrained } from '../src/checkpoint/hf.js';
import { generate } from '../src/cli/checkpoint.js';
import { metricCharts } from '../src/report/charts.js';
import { flotilla, ROOT } from './helpers/cli.js';
import { CHAT_VOCAB, writeChatData, writeChatTokenizer } from './fixtures/chat_model.js';

setNumThreads(1);
const root = mkdtempSync(join(tmpdir(), 'flotilla-chat-flow-'));
after(() => rmSync(root, { recursive: true, force: true }));

const MODEL = { vocabSize: CHAT_VOCAB, blockSize: 128, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 64, ropeTheta: 10000, tieEmbeddings: false };
const modelArgs = [...Object.entries(MODEL).map(([k, v]) => `--model.${k}=${v}`), '--model.ropeScaling=none'];
/** The examples' settings scaled to a tiny model on 2 cores (float32: this machine may lack native bfloat16). */
const small = [
  ...modelArgs, '--data.seqLen=128', '--data.globalBatch=8', '--data.microBatches=2', '--data.valFraction=0.1', '--train.precision=fp32',
  '--lora.baseDtype=fp32', '--lora.rank=4', '--train.evalEvery=0', '--log.progress=plain', '--parallel.zero=2',
];

interface Line { step: number; loss: number; trainedTokens?: number; pairs?: number; rewardsChosen?: number; rewardsRejected?: number; rewardsAccuracy?: number; rewardsMargin?: number }
const metrics = (run: string): Line[] => readFileSync(join(run, 'metrics.jsonl'), 'utf8').trim().split('\n').map((l) => JSON.parse(l) as Line);

test('SFT with LoRA on chat data, merged export, DPO on it, PEFT export and generate --chat, as the README says', { timeout: 600_000 }, async () => {
  const tok = writeChatTokenizer(join(root, 'tok'));
  const base = join(root, 'base');
  const m = new Llama(MODEL, { initSeed: 4 });
  savePretrained(m, base, { tokenizer: join(tok, 'tokenizer.json') });
  m.dispose();
  const data = writeChatData(join(root, 'data'), 48);

  const sft = join(root, 'sft');
  const a = await flotilla(['train', join(ROOT, 'examples', 'sft-chat.toml'), '--nproc', '2', `--train.initFrom=${base}`, `--data.tokenizer=${base}`,
    `--data.source=${data.chat}`, `--train.runDir=${sft}`, '--train.epochs=1', ...small], { cwd: root, env: { FLOTILLA_CACHE_DIR: join(root, 'cache') } });
  assert.equal(a.code, 0, a.out + a.err);
  assert.match(a.out, /\[data\] \d+ examples -> \d+ rows x 128 per epoch \(packed, fill \d+\.\d%\)/);
  const sm = metrics(sft);
  assert.ok(sm.length > 0 && sm.every((l) => Number.isInteger(l.trainedTokens) && l.trainedTokens! > 0 && l.trainedTokens! < 8 * 128), 'every step trains some, not all, of its tokens');

  const merged = join(root, 'sft-merged');
  const e = await flotilla(['export', sft, merged, '--format', 'hf', '--merge']);
  assert.equal(e.code, 0, e.out + e.err);
  assert.ok(existsSync(join(merged, 'tokenizer_config.json')), 'the chat template goes with the merged model');

  const dpo = join(root, 'dpo');
  const d = await flotilla(['train', join(ROOT, 'examples', 'dpo.toml'), '--nproc', '2', `--train.initFrom=${merged}`, `--data.tokenizer=${merged}`,
    `--data.source=${data.prefs}`, `--train.runDir=${dpo}`, '--train.epochs=1', '--optim.lr=1e-2', '--optim.warmupSteps=0', ...small], { cwd: root, env: { FLOTILLA_CACHE_DIR: join(root, 'cache') } });
  assert.equal(d.code, 0, d.out + d.err);
  const dm = metrics(dpo);
  assert.ok(Math.abs(dm[0]!.loss - Math.LN2) < 1e-6, `first DPO step: ln 2, got ${dm[0]!.loss}`);
  assert.equal(dm[0]!.rewardsMargin, 0);
  assert.ok(dm.slice(1).every((l) => l.rewardsChosen !== 0 && l.rewardsRejected !== 0), 'after a step every response moved from the reference');
  assert.ok(dm.every((l) => typeof l.rewardsAccuracy === 'number' && l.trainedTokens === undefined && l.pairs === 8), 'DPO counts pairs, not tokens');
  const charts = metricCharts([{ name: 'dpo', metrics: dm as never }]).map((c) => c.id);
  assert.ok(charts.includes('dpo-margin') && charts.includes('dpo-accuracy') && !charts.includes('trained-tokens'), charts.join());
  assert.ok(dm[dm.length - 1]!.loss < Math.LN2, `DPO lowers its loss (last ${dm[dm.length - 1]!.loss})`);

  const peft = join(root, 'dpo-adapter');
  const p = await flotilla(['export', dpo, peft, '--format', 'peft']);
  assert.equal(p.code, 0, p.out + p.err);

  const o = { prompts: ['Continue: Call me Ishmael.'], tokens: 12, temperature: 0, topK: 0, topP: 1, seed: 1, ignoreEos: false, chat: '' };
  const fromRun = await generate(dpo, o);
  const fromAdapter = await generate(merged, { ...o, adapter: peft });
  assert.deepEqual(fromAdapter, fromRun);
  assert.ok(fromRun[0]!.text.length > 0);
});
