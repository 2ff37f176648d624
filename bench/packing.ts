// Packing: trained (assistant) tokens per second on a chat dataset of mixed lengths, whole
// conversations packed into rows (`data.pack = true`, attention kept within each conversation)
// against one conversation a row padded to data.seqLen (`data.pack = false`), same tiny Llama, same
// layout, same steps. Real `flotilla train` runs, one process and 2 data-parallel ranks (Gloo, one
// thread each); the packed and padded runs alternate so that a loaded machine slows both alike.
//
// The dataset: conversations cut from Moby-Dick's sentences (the demo corpus), 1-3 turns, each turn
// a seeded log-normal number of sentences, rendered with ChatML through the demo's BPE plus
// <|im_start|>/<|im_end|> and prepared once with `flotilla prepare --format chat` (the prepare API);
// the loss is on the assistant turns.
//
//   node --import tsx bench/packing.ts [--seq-len 512,1024] [--batch 8] [--steps 10] [--reps 3] [--nproc 1,2] [--write]
// Each --seq-len is its own set of runs on the same conversations (the model's context is the largest).
// --write replaces the "packing" section of docs/BENCHMARKS.md.
import { spawn } from 'node:child_process';
import { mkdtempSync, mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import { join, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { loadMobyDick } from '../src/data/corpus.js';
import { prepare } from '../src/data/prepare.js';
import { loadTrainData } from '../src/data/sources.js';
import { ExampleLoader } from '../src/data/example_loader.js';
import { CHATML_TEMPLATE } from '../src/data/chat/template.js';
import { loadConfig } from '../src/config/index.js';
import { IGNORE_INDEX } from '../src/parallel/parallel_model.js';
import { median, writeSection } from './report.js';

const ROOT = resolve(import.meta.dirname, '..');
const { values: a } = parseArgs({
  options: {
    'seq-len': { type: 'string', default: '512,1024' }, batch: { type: 'string', default: '8' }, steps: { type: 'string', default: '10' },
    reps: { type: 'string', default: '3' }, nproc: { type: 'string', default: '1,2' }, conversations: { type: 'string', default: '3000' },
    layers: { type: 'string', default: '4' }, width: { type: 'string', default: '128' }, write: { type: 'boolean', default: false },
  },
});
const seqLens = a['seq-len']!.split(',').map(Number), batch = Number(a.batch), steps = Number(a.steps), reps = Number(a.reps), nConv = Number(a.conversations);
const layers = Number(a.layers), width = Number(a.width);
const nprocs = a.nproc!.split(',').map(Number);
const WARM = 2; // steps left out of the timing: the first ones also build caches and learn bucket readiness
if (!(steps > WARM + 1)) throw new Error(`--steps must be above ${WARM + 1} (the first ${WARM} are not timed), not ${a.steps}`);
if (nprocs.some((n) => !(n >= 1 && batch % n === 0))) throw new Error(`--nproc ${a.nproc}: each must divide --batch ${batch}`);

// ---- a seeded generator: mulberry32, and normals by Box-Muller
function rng(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rand = rng(52);
const normal = () => Math.sqrt(-2 * Math.log(1 - rand())) * Math.cos(2 * Math.PI * rand());
/** round(exp(N(ln m, sigma))), at least 1: m is the median. */
const logNormal = (m: number, sigma: number) => Math.max(1, Math.round(m * Math.exp(sigma * normal())));

// Distribution of a conversation, fixed before any measurement: 1 turn (60%), 2 (25%) or 3 (15%);
// a user turn takes a log-normal number of sentences of median 1.5 (sigma 0.7), an assistant turn
// median 3 (sigma 1.0), both consecutive sentences of the book from a random place.
const USER = { median: 1, sigma: 0.6 }, ASSISTANT = { median: 2, sigma: 0.9 };
const sentences = loadMobyDick().replace(/\s+/g, ' ').match(/[^.!?]+[.!?]+["')]*/g)!.map((s) => s.trim()).filter((s) => s.length >= 12 && s.length <= 300);
function conversation(): { role: string; content: string }[] {
  const u = rand();
  const turns = u < 0.6 ? 1 : u < 0.85 ? 2 : 3;
  let at = Math.floor(rand() * sentences.length);
  const take = (n: number) => {
    if (at + n > sentences.length) at = 0;
    const s = sentences.slice(at, at + n).join(' ');
    at += n;
    return s;
  };
  const messages: { role: string; content: string }[] = [];
  for (let t = 0; t < turns; t++) {
    messages.push({ role: 'user', content: take(logNormal(USER.median, USER.sigma)) });
    messages.push({ role: 'assistant', content: take(logNormal(ASSISTANT.median, ASSISTANT.sigma)) });
  }
  return messages;
}

const dir = mkdtempSync(join(os.tmpdir(), 'flotilla-bench-packing-'));
const env = { ...process.env, FLOTILLA_REPORT: '0' };

/** One `flotilla train` run: its rank-0 output and metrics rows. */
function trainRun(cfgPath: string, nproc: number, pack: boolean, runDir: string): Promise<{ out: string; rows: { step: number; tokensPerSec: number; trainedTokens?: number }[] }> {
  const args = [join(ROOT, 'bin', 'flotilla.js'), 'train', cfgPath, '--nproc', String(nproc), `--data.pack=${pack}`, `--train.runDir=${runDir}`];
  return new Promise((res, rej) => {
    const c = spawn(process.execPath, args, { cwd: ROOT, env, stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    c.stdout.on('data', (d: Buffer) => (out += d));
    c.stderr.on('data', (d: Buffer) => (out += d));
    c.on('exit', (code) => {
      if (code !== 0) return rej(new Error(`flotilla train (nproc ${nproc}, pack ${pack}) exited ${code}:\n${out}`));
      const rows = readFileSync(join(runDir, 'metrics.jsonl'), 'utf8').split('\n').filter((l) => l.trim() !== '').map((l) => JSON.parse(l));
      res({ out, rows });
    });
  });
}

interface Run { seqLen: number; nproc: number; pack: boolean; trainedPerSec: number; tokensPerSec: number; stepMs: number }
const runs: Run[] = [];
const key = (seqLen: number, pack: boolean) => `${seqLen}/${pack}`;
const fill: Record<string, string> = {};
const trained: Record<string, number[]> = {};
const stats: Record<number, string> = {};
let lengthStats = '';
const load0 = os.loadavg()[0]!;
try {
  // ---- the chat tokenizer: the demo BPE with ChatML's specials, and its template beside it
  const tokDir = join(dir, 'tokenizer');
  mkdirSync(tokDir);
  const bpe = JSON.parse(readFileSync(join(ROOT, 'examples', 'moby-dick-bpe512.json'), 'utf8')) as { added_tokens: object[]; model: { vocab: Record<string, number> } };
  const next = Math.max(...Object.values(bpe.model.vocab), ...bpe.added_tokens.map((t) => (t as { id: number }).id)) + 1;
  for (const [i, content] of ['<|im_start|>', '<|im_end|>'].entries()) {
    bpe.added_tokens.push({ id: next + i, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true });
  }
  writeFileSync(join(tokDir, 'tokenizer.json'), JSON.stringify(bpe));
  writeFileSync(join(tokDir, 'tokenizer_config.json'), JSON.stringify({ chat_template: CHATML_TEMPLATE, eos_token: '<|im_end|>', bos_token: null, pad_token: '<|endoftext|>' }));

  // ---- the dataset, prepared once
  const jsonl = join(dir, 'chat.jsonl');
  writeFileSync(jsonl, Array.from({ length: nConv }, () => JSON.stringify({ messages: conversation() })).join('\n') + '\n');
  const prepared = join(dir, 'prepared');
  await prepare({ sources: [jsonl], tokenizer: tokDir, out: prepared, format: 'chat', chatTemplate: 'model', trainOn: 'assistant', progress: false, print: () => {} });

  // ---- the runs: a tiny Llama, everything but data.seqLen and data.pack fixed
  const blockSize = Math.max(...seqLens);
  const cfgPath = (seqLen: number) => join(dir, `packing-${seqLen}.toml`);
  for (const seqLen of seqLens) {
    writeFileSync(cfgPath(seqLen), [
      '[model]', 'arch = "llama"', 'vocabSize = 0', `blockSize = ${blockSize}`, `nLayer = ${layers}`, 'nHead = 4', 'nKvHead = 2', `nEmbd = ${width}`,
      '[data]', `source = ${JSON.stringify(prepared)}`, 'format = "chat"', `tokenizer = ${JSON.stringify(tokDir)}`, 'chatTemplate = "model"',
      `seqLen = ${seqLen}`, `globalBatch = ${batch}`, 'valFraction = 0.02', 'overflow = "truncate"',
      '[optim]', 'lr = 1e-3', 'warmupSteps = 2',
      '[train]', `steps = ${steps}`, 'seed = 1', 'evalEvery = 0', 'evalBatches = 1', 'threads = 1',
      '[parallel]', 'backend = "gloo"',
      '[checkpoint]', 'every = 0',
      '[log]', 'every = 1', 'progress = "plain"', 'sampleTokens = 0',
    ].join('\n') + '\n');

    // Trained tokens of each step's global batch, counted from the loader's rows (the same rows
    // every layout reads: step s is global rows [s G, (s + 1) G)).
    const cfg = loadConfig(cfgPath(seqLen));
    const data = await loadTrainData(cfg.data, { modelVocab: cfg.model.vocabSize });
    const ex = data.examples!;
    const lengths = ex.train.flatMap((c) => Array.from({ length: c.units }, (_, u) => c.unitLength(u))).sort((x, y) => x - y);
    const q = (p: number) => lengths[Math.min(lengths.length - 1, Math.floor(p * lengths.length))]!;
    const mean = lengths.reduce((s, n) => s + n, 0) / lengths.length;
    lengthStats = `${lengths.length.toLocaleString('en-US')} training conversations of ${q(0)}-${q(1)} tokens: mean ${mean.toFixed(0)}, median ${q(0.5)}, 90th percentile ${q(0.9)}`;
    const longer = lengths.filter((n) => n > seqLen).length;
    stats[seqLen] = `${longer} (${((100 * longer) / lengths.length).toFixed(1)}%) longer than ${seqLen}`;
    console.log(`${lengthStats}; ${stats[seqLen]}`);
    for (const pack of [true, false]) {
      const loader = new ExampleLoader({ sources: ex.train, seed: cfg.train.seed, pack, overflow: cfg.data.overflow, padId: ex.padId, seqLen, globalBatch: batch });
      trained[key(seqLen, pack)] = Array.from({ length: steps }, (_, s) => {
        const b = loader.batch(s, 0);
        const y = b.y.toArray();
        let n = 0;
        for (let i = 0; i < y.length; i++) if (Number(y[i]) !== IGNORE_INDEX) n++;
        b.x.dispose();
        b.y.dispose();
        b.docs?.dispose();
        return n;
      });
      loader.close();
    }
    data.close();
  }

  // ---- packed and padded alternating (which goes first alternates too)
  for (let r = 0; r < reps; r++) {
    for (const seqLen of seqLens) {
      for (const nproc of nprocs) {
        for (const pack of r % 2 === 0 ? [true, false] : [false, true]) {
          const { out, rows } = await trainRun(cfgPath(seqLen), nproc, pack, join(dir, `run-${r}-${seqLen}-${nproc}-${pack}`));
          const line = out.split('\n').find((l) => /\[data\].*fill [\d.]+%/.test(l));
          if (line) fill[key(seqLen, pack)] = /fill ([\d.]+%)/.exec(line)![1]!;
          const counted = trained[key(seqLen, pack)]!;
          // The trainer's own count once it reports one, checked against the loader's.
          for (const row of rows) {
            if (row.trainedTokens !== undefined && row.trainedTokens !== counted[row.step - 1]) {
              throw new Error(`step ${row.step} (seqLen ${seqLen}, pack ${pack}): the trainer reports ${row.trainedTokens} trained tokens, the loader's rows hold ${counted[row.step - 1]}`);
            }
          }
          const timed = rows.filter((row) => row.step > WARM);
          const seconds = timed.reduce((s, row) => s + (batch * seqLen) / row.tokensPerSec, 0);
          const tokens = timed.reduce((s, row) => s + counted[row.step - 1]!, 0);
          const run: Run = { seqLen, nproc, pack, trainedPerSec: tokens / seconds, tokensPerSec: (timed.length * batch * seqLen) / seconds, stepMs: (1e3 * seconds) / timed.length };
          runs.push(run);
          console.log(`rep ${r + 1}, seqLen ${seqLen}, ${nproc} rank(s), ${pack ? 'packed' : 'padded'}: ${run.trainedPerSec.toFixed(0)} trained tokens/s, step ${run.stepMs.toFixed(0)} ms`);
        }
      }
    }
  }
} finally {
  rmSync(dir, { recursive: true, force: true });
}
const load1 = os.loadavg()[0]!;

const sel = (seqLen: number, nproc: number, pack: boolean) => runs.filter((r) => r.seqLen === seqLen && r.nproc === nproc && r.pack === pack);
const perStep = (seqLen: number, pack: boolean) => trained[key(seqLen, pack)]!.slice(WARM).reduce((s, n) => s + n, 0) / (steps - WARM);
const rows: string[] = [];
const verdicts: string[] = [];
const explain: string[] = [];
for (const seqLen of seqLens) {
  const tokenGain = perStep(seqLen, true) / perStep(seqLen, false);
  for (const nproc of nprocs) {
    const [p, d] = [sel(seqLen, nproc, true), sel(seqLen, nproc, false)];
    const ratios = p.map((x, i) => x.trainedPerSec / d[i]!.trainedPerSec); // repetition i's packed run over its padded run
    const stepRatio = median(p.map((x, i) => x.stepMs / d[i]!.stepMs));
    const f = (xs: Run[], k: 'trainedPerSec' | 'stepMs') => `${Math.min(...xs.map((x) => x[k])).toFixed(0)} / ${median(xs.map((x) => x[k])).toFixed(0)}`;
    for (const [pack, xs] of [[true, p], [false, d]] as const) {
      rows.push(`| ${seqLen} | ${nproc} | ${pack ? 'packed' : 'padded to seqLen'} | ${fill[key(seqLen, pack)] ?? '-'} | ${perStep(seqLen, pack).toFixed(0)} (${((100 * perStep(seqLen, pack)) / (batch * seqLen)).toFixed(1)}%) | ` +
        `${f(xs, 'stepMs')} | ${f(xs, 'trainedPerSec')} | ${pack ? `**${median(ratios).toFixed(2)}x** (${ratios.map((x) => x.toFixed(2)).join(', ')})` : ''} |`);
    }
    // A packed step computes the same rows x seqLen as a padded one (and the documents' mask besides), so
    // a measured ratio above the trained-tokens ratio is the load's doing, not packing's.
    const holds = median(ratios) >= 2 && tokenGain >= 2;
    verdicts.push(`seqLen ${seqLen}, ${nproc} rank${nproc > 1 ? 's' : ''}: ${median(ratios).toFixed(2)}x (${holds ? 'meets' : 'misses'} the >= 2x goal` +
      `${!holds && median(ratios) >= 2 ? `: above 2x by the load's noise only, with ${tokenGain.toFixed(2)}x the trained tokens a step at the same step shape` : ''})`);
    explain.push(`seqLen ${seqLen}, ${nproc} rank${nproc > 1 ? 's' : ''}: ${tokenGain.toFixed(2)}x the trained tokens a step, a packed step ${stepRatio.toFixed(2)}x a padded one`);
  }
}
const cpu = `${os.cpus()[0]?.model.trim() ?? 'cpu'} x ${os.cpus().length}`;
const body = [
  '## Packing: trained tokens per second, packed against padded',
  '',
  `\`node --import tsx bench/packing.ts --seq-len ${seqLens.join(',')} --batch ${batch} --steps ${steps} --reps ${reps} --nproc ${nprocs.join(',')} --conversations ${nConv} --write\` — ` +
    `a chat dataset of mixed lengths: ${nConv.toLocaleString('en-US')} conversations cut from Moby-Dick's sentences (1 turn 60%, 2 turns 25%, 3 turns 15%; ` +
    `each user turn a log-normal number of consecutive sentences of median ${USER.median} (sigma ${USER.sigma}), each assistant turn median ${ASSISTANT.median} (sigma ${ASSISTANT.sigma}), seeded), ` +
    'rendered with ChatML through the demo\'s 512-id BPE plus <|im_start|> and <|im_end|>, prepared once (`flotilla prepare --format chat`), the loss on the assistant turns. ' +
    `${lengthStats}; ${seqLens.map((n) => stats[n]).join(', ')} (truncated, \`data.overflow = "truncate"\`). ` +
    `The same random Llama (${layers} layers, width ${width}, 4 query heads sharing 2 key/value heads, context ${Math.max(...seqLens)}), float32, AdamW, ` +
    `global batch ${batch} rows of data.seqLen, ${steps} steps of real \`flotilla train\` runs on Gloo ranks of one thread each, under each layout: \`data.pack = true\` ` +
    '(whole conversations first-fit into rows, attention and positions restarting at each one) against `data.pack = false` (one conversation a row). ' +
    '**The padded baseline pads every row to data.seqLen, not to the longest row of its batch**: that is what flotilla\'s loader does (a fixed batch shape); ' +
    'a loader padding each batch to its longest row would do less wasted work than this baseline, and narrow the gap. ' +
    `Trained tokens are the targets the loss is taken on (y != ${IGNORE_INDEX}), counted from the loader's rows of each step (the same global rows under every layout); ` +
    `a run's rate is the trained tokens of steps ${WARM + 1}-${steps} over their step times (metrics.jsonl; the first ${WARM} steps left out). ` +
    `Packed and padded runs alternate (${reps} repetitions, which mode goes first alternating), so a loaded machine slows both alike; the ratio is the median over repetitions of ` +
    'each packed run\'s rate over the padded run beside it. Fill is what the trainer\'s `[data]` line prints (the conversations\' tokens over rows x seqLen, first epoch); ' +
    'trained tokens a step are the mean over the timed steps, with their share of the batch\'s tokens.',
  '',
  `CPU: ${cpu}; load average (1 min) at the start and the end of this run: ${load0.toFixed(1)} and ${load1.toFixed(1)}${load0 > 2 || load1 > 2 ? ' (a loaded machine: other processes ran beside the benchmark)' : ''}.`,
  '',
  '| seqLen | ranks | rows | fill | trained tokens a step | step ms, min / median | trained tokens/s, min / median | packed / padded (each repetition) |',
  '|---:|---:|---|---:|---:|---:|---:|---|',
  ...rows,
  '',
  `Packed over padded, trained tokens/s: ${verdicts.join('; ')}. Where it comes from: ${explain.join('; ')}.`,
].join('\n');
console.log(`\n${body}`);
if (a.write) writeSection('packing', body);
