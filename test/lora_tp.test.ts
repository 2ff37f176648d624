// LoRA adapters under tensor parallelism against one process, in float64 ([Note: LoRA under tp] in
// src/parallel/tensor_parallel/styles.ts): 3 AdamW steps with clipping, 2 micro-batches per step.
// A GPT with rank-4 adapters on every linear layer but the head (the fused q, k, v split by head
// group, attention's and the MLP's projections; test/fixtures/tp_gpt_rank.ts) and a Llama with
// adapters on q, k, v, o, gate, up and down, named as Hugging Face names them
// (test/fixtures/llama_layouts_rank.ts). Every rank's losses, gradient norms, step 0's adapter
// gradients (whole, through grads.fullGrad) and every whole parameter equal one process's at tp=2:
// plain, sequence parallel, loss parallel, with the adapters' dropout, tp x dp, tp x ZeRO-3 and
// tp x pp on 4 ranks; the frozen base never moves on any rank. The adapters lie over tp as their
// base does: B by rows under a column-parallel base, A by columns under a row-parallel one, and
// merging them on a rank merges its slice of the whole merged weight. A LoRA
// checkpoint (the adapters and their optimizer state) saved at tp=2 resumes at tp=1, and one saved
// at tp=1 resumes at tp=2 with sequence parallelism, continuing exactly as one process does. Through
// the trainer: `flotilla verify` of a LoRA run from a Hugging Face Llama directory passes at tp=2
// with sequence parallelism, and across a resume from tp=2 to one process; verify of a run with
// adapter dropout under dp sets it to 0 for both runs, as it does the model's dropout.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, readdirSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Llama } from '../src/models/llama.js';
import { noGrad, tidy } from '../src/tensor/index.js';
import { applyLora, loraAdapterOf, mergeLora } from '../src/nn/lora.js';
import { parallelizeModule } from '../src/parallel/tensor_parallel/styles.js';
import type { ProcessGroup } from '../src/distributed/process_group.js';
import { savePretrained } from '../src/checkpoint/hf.js';
import { flotilla, ROOT } from './helpers/cli.js';
import { started } from './helpers/pool.js';
import { maxRelDiff } from './helpers/close.js';
import { pool } from './helpers/pool.js';
import { equivalenceSuite, type Tolerance } from './helpers/equivalence.js';
import type { Out as GptOut, Run as GptRun } from './fixtures/tp_gpt_rank.js';
import type { Out as LlamaOut, Run as LlamaRun } from './fixtures/llama_layouts_rank.js';
import type { Out as ResumeOut, Run as ResumeRun } from './fixtures/lora_tp_resume_rank.js';

test('merging adapters split by tp merges each rank\'s slice: W_r + scale B_r A under a column-parallel base, W_r + scale B A_r under a row-parallel one', () => {
  const model = new Llama({ vocabSize: 32, blockSize: 8, nLayer: 1, nHead: 4, nKvHead: 2, nEmbd: 16, intermediateSize: 24 }, { initSeed: 3 });
  applyLora(model, { rank: 2, alpha: 3, targets: ['q', 'k', 'o'], initSeed: 3 });
  const attn = model.layers.items[0]!.attn;
  for (const lin of [attn.q, attn.k, attn.o]) noGrad(() => loraAdapterOf(lin)!.B.weight.uniform_(-1, 1)); // B = 0 would merge nothing
  // The whole merged weights, then rank 1 of 2's slices of them: q's and k's rows, o's columns.
  const whole = [attn.q, attn.k, attn.o].map((lin) => tidy(() => {
    const a = loraAdapterOf(lin)!;
    return lin.weight.add(a.B.weight.matmul(a.A.weight).mul(a.scale)).toNumbers();
  }));
  const rows = (t: number[], c: number, lo: number, n: number) => t.slice(lo * c, (lo + n) * c);
  const cols = (t: number[], r: number, c: number, lo: number, n: number) => Array.from({ length: r }, (_, i) => t.slice(i * c + lo, i * c + lo + n)).flat();
  const want = [rows(whole[0]!, 16, 8, 8), rows(whole[1]!, 16, 4, 4), cols(whole[2]!, 16, 16, 8, 8)];
  const g = { rank: 1, size: 2 } as ProcessGroup; // shapes only: nothing is communicated without a forward
  const applied = parallelizeModule(model, g, { 'layers.*.attn': 'prepareInput', 'layers.*.attn.q': { kind: 'colwise', input: 'prepared' }, 'layers.*.attn.k': { kind: 'colwise', input: 'prepared' }, 'layers.*.attn.o': 'rowwise' });
  mergeLora(model);
  [attn.q, attn.k, attn.o].forEach((lin, i) => {
    const d = maxRelDiff(lin.weight.toNumbers(), want[i]!);
    assert.ok(d <= 1e-6, `${['q', 'k', 'o'][i]}: the merged slice differs from the slice of the merged weight by ${d}`);
  });
  applied.dispose();
  model.dispose();
});

const queue = pool();
const gpt = equivalenceSuite<GptRun, GptOut>('lora-tp-gpt', 'test/fixtures/tp_gpt_rank.ts', { timeoutMs: 300_000, queue });
const llama = equivalenceSuite<LlamaRun, LlamaOut>('lora-tp-llama', 'test/fixtures/llama_layouts_rank.ts', { timeoutMs: 300_000, queue });
/** float64: a different summation order only. */
const F64: Tolerance = { loss: 1e-12, norm: 1e-12, param: 1e-10 };

/** Every parameter but the adapters' (applyLora freezes them; the fixture checks they never move). */
const BASE = ['^(?!.*\\.lora[AB]\\.weight$)'];
const isAdapter = (k: string): boolean => /\.lora[AB]\.weight$/.test(k);
const sp = { sequenceParallel: true }, lp = { lossParallel: true };

const gptLora = { rank: 4, alpha: 8, targets: ['all-linear'] };
const g = (name: string, layout: GptRun['layout'], lora: GptRun['lora'] = gptLora): GptRun => ({ name, layout, micro: 2, steps: 3, lora, frozen: BASE });
const gptDrop = { ...gptLora, dropout: 0.25 };
// The head too: its B is split over the vocabulary like the head's weight (left split under loss parallelism).
const gptHead = { ...gptLora, targets: ['all-linear', 'head'] };
// A base stored in bfloat16 (computed in float64), split like a float64 one.
const gptBf16 = { ...gptLora, baseDtype: 'bfloat16' as const };
const gptRef = gpt.launch(1, [
  g('ref', undefined), g('ref_drop', undefined, gptDrop), { ...g('ref_drop_ac', undefined, gptDrop), ac: 'full' }, g('ref_head', undefined, gptHead), g('ref_bf16', undefined, gptBf16),
]);
const gpt2 = gpt.launch(2, [
  g('tp2', { tp: 2 }),
  g('tp2_sp', { tp: 2, ...sp }),
  g('tp2_sp_head', { tp: 2, ...sp }, gptHead),
  g('tp2_lp_head', { tp: 2, ...lp }, gptHead),
  g('tp2_sp_lp_head', { tp: 2, ...sp, ...lp }, gptHead),
  g('tp2_sp_bf16', { tp: 2, ...sp }, gptBf16),
  g('tp2_drop', { tp: 2 }, gptDrop),
  g('tp2_sp_drop', { tp: 2, ...sp }, gptDrop),
  // A block's recompute replays its adapters' masks (against one process checkpointing alike: a
  // checkpointed block draws from a seed of its own).
  { ...g('tp2_drop_ac', { tp: 2 }, gptDrop), ac: 'full' },
]);
const gpt4 = gpt.launch(4, [
  g('tp2_dp2', { tp: 2, dp: 2 }),
  g('tp2_z3_sp', { tp: 2, zero: 3, ...sp }),
  g('tp2_pp2', { tp: 2, pp: 2, ppSchedule: '1f1b' }),
  g('tp2_pp2_zb_sp', { tp: 2, pp: 2, ppSchedule: 'zb', ...sp }),
]);

const HF_TARGETS = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'];
const llamaLora = { rank: 4, alpha: 8, targets: HF_TARGETS };
const l = (name: string, layout: LlamaRun['layout']): LlamaRun => ({ name, layout, micro: 2, steps: 3, lora: llamaLora });
const llamaRef = llama.launch(1, [l('ref', undefined)]);
const llama2 = llama.launch(2, [l('tp2', { tp: 2 }), l('tp2_sp_lp', { tp: 2, ...sp, ...lp })]);
const llama4 = llama.launch(4, [l('tp2_z3_sp', { tp: 2, zero: 3, ...sp }), l('tp2_pp2', { tp: 2, pp: 2, ppSchedule: '1f1b' }), l('tp2_pp2_zb_sp', { tp: 2, pp: 2, ppSchedule: 'zb', ...sp })]);

/**
 * Run `name` against the reference: the suite's comparison (every rank's losses, norms, whole
 * parameters), then step 0's adapter gradients, and the frozen base unmoved on every rank.
 */
function compareLora<O extends GptOut | LlamaOut>(suite: { compare: typeof gpt.compare } | { compare: typeof llama.compare }, name: string, nproc: number, refName: string, adapters: number): O[] {
  const { ref, outs } = (suite.compare as (n: string, p: number, r: string, t: Tolerance) => { ref: O; outs: O[] })(name, nproc, refName, F64);
  const trained = Object.keys(ref.params).filter(isAdapter).sort();
  assert.equal(trained.length, adapters, `${refName}: adapters`);
  assert.deepEqual(Object.keys(ref.grads0!).sort(), trained, `${refName}: one process has gradients for the adapters only`);
  for (const k of trained.filter((n) => n.endsWith('loraB.weight'))) assert.ok(ref.params[k]!.some((x) => x !== 0), `${refName}: ${k} trained away from zero`);
  assert.deepEqual(ref.frozenMoved, []);
  for (const o of outs) {
    const who = `${name}: rank ${o.rank}`;
    assert.deepEqual(Object.keys(o.grads0!).sort(), Object.keys(o.params).filter(isAdapter).sort(), `${who}: gradients for the adapters it holds, and only for them`);
    for (const [k, v] of Object.entries(o.grads0!)) {
      const d = maxRelDiff(v, ref.grads0![k]!);
      assert.ok(d <= F64.param, `${who}: step 0 gradient of ${k} differs from one process's by ${d}`);
    }
    assert.deepEqual(o.frozenMoved, [], `${who}: the frozen base moved`);
    for (const k of Object.keys(o.params).filter((n) => !isAdapter(n))) assert.deepEqual(o.params[k], ref.params[k], `${who}: frozen ${k} is not the base`);
  }
  return outs;
}

test('LoRA on a GPT at tp=2 (plain; sequence parallel; an adapted head gathered, and left split under loss parallelism) equals one process on every rank; the adapters lie over tp as their base does', async () => {
  await Promise.all([gptRef, gpt2]);
  compareLora(gpt, 'tp2', 2, 'ref', 16);
  compareLora(gpt, 'tp2_sp', 2, 'ref', 16);
  compareLora(gpt, 'tp2_sp_head', 2, 'ref_head', 18);
  compareLora(gpt, 'tp2_lp_head', 2, 'ref_head', 18);
  const outs = compareLora<GptOut>(gpt, 'tp2_sp_lp_head', 2, 'ref_head', 18);
  for (const o of outs) {
    const t = o.shards!;
    const at = (dim: number, chunks = 1) => ({ dim, index: o.tpRank, parts: 2, chunks });
    // Column-parallel bases split B's rows (per q, k, v chunk for the fused projection), A whole.
    assert.deepEqual(t['layers.0.attn.qkv.loraB.weight'], at(0, 3));
    assert.deepEqual(t['layers.1.mlp.fc.loraB.weight'], at(0));
    assert.deepEqual(t['head.loraB.weight'], at(0));
    for (const k of ['layers.0.attn.qkv.loraA.weight', 'layers.1.mlp.fc.loraA.weight', 'head.loraA.weight']) assert.equal(t[k], null, `${k} is whole on every tp rank`);
    // Row-parallel bases split A's columns, B whole.
    assert.deepEqual(t['layers.0.attn.proj.loraA.weight'], at(1));
    assert.deepEqual(t['layers.1.mlp.proj.loraA.weight'], at(1));
    for (const k of ['layers.0.attn.proj.loraB.weight', 'layers.1.mlp.proj.loraB.weight']) assert.equal(t[k], null, `${k} is whole on every tp rank`);
  }
});

test('LoRA dropout on a GPT at tp=2 (with and without sequence parallelism; under full activation checkpointing) draws the masks one process draws: equal to one process', async () => {
  await Promise.all([gptRef, gpt2]);
  const ref = gpt.read('ref_drop', 1)[0]!, plain = gpt.read('ref', 1)[0]!;
  assert.ok(Math.abs(ref.losses[1]! - plain.losses[1]!) > 1e-6, 'the adapters\' dropout changes training');
  compareLora(gpt, 'tp2_drop', 2, 'ref_drop', 16);
  compareLora(gpt, 'tp2_sp_drop', 2, 'ref_drop', 16);
  compareLora(gpt, 'tp2_drop_ac', 2, 'ref_drop_ac', 16);
});

test('LoRA on a GPT at tp=2 x dp=2, tp=2 x ZeRO-3 (sequence parallel) and tp=2 x pp=2 (1F1B; zero bubble with sequence parallelism) on 4 ranks equals one process on every rank', async () => {
  await Promise.all([gptRef, gpt4]);
  compareLora(gpt, 'tp2_dp2', 4, 'ref', 16);
  compareLora(gpt, 'tp2_z3_sp', 4, 'ref', 16);
  compareLora(gpt, 'tp2_pp2', 4, 'ref', 16);
  compareLora(gpt, 'tp2_pp2_zb_sp', 4, 'ref', 16);
});

test('LoRA on a Llama (q, k, v, o, gate, up, down by their Hugging Face names) at tp=2 (plain; sequence + loss parallel), tp=2 x ZeRO-3 and tp=2 x pp=2 (1F1B; zero bubble with sequence parallelism) equals one process on every rank', async () => {
  await Promise.all([llamaRef, llama2, llama4]);
  for (const [name, nproc] of [['tp2', 2], ['tp2_sp_lp', 2], ['tp2_z3_sp', 4], ['tp2_pp2', 4], ['tp2_pp2_zb_sp', 4]] as const) compareLora(llama, name, nproc, 'ref', 4 * 7 * 2);
});

// Checkpoints across layouts (test/fixtures/lora_tp_resume_rank.ts): 4 steps in one process; 2 steps
// at tp=2 saved and resumed for steps 2-3 in one process; 2 steps in one process saved and resumed
// at tp=2 with sequence parallelism.
const resume = equivalenceSuite<ResumeRun, ResumeOut>('lora-tp-resume', 'test/fixtures/lora_tp_resume_rank.ts', { timeoutMs: 300_000, queue });
const firstHalves = Promise.all([
  resume.launch(1, [{ name: 'ref', from: 0, to: 4 }, { name: 'one_0_2', from: 0, to: 2, save: 'ck_one' }]),
  resume.launch(2, [{ name: 'tp2_0_2', layout: { tp: 2 }, from: 0, to: 2, save: 'ck_tp2' }]),
]);
const secondHalves = firstHalves.then(() => Promise.all([
  resume.launch(1, [{ name: 'one_2_4', from: 2, to: 4, load: 'ck_tp2' }]),
  resume.launch(2, [{ name: 'tp2_sp_2_4', layout: { tp: 2, ...sp }, from: 2, to: 4, load: 'ck_one' }]),
]));

test('a LoRA checkpoint saved at tp=2 resumes at tp=1, and one saved at tp=1 resumes at tp=2 (+ sequence parallel): it holds the adapters whole-shaped and only them, and training continues as one process\'s', async () => {
  await secondHalves;
  const ref = resume.read('ref', 1)[0]!;
  const meta = (ck: string) => {
    const dir = join(resume.dir, ck);
    const step = readdirSync(dir).find((d) => d.startsWith('step-'))!;
    return JSON.parse(readFileSync(join(dir, step, 'meta.json'), 'utf8')) as { params: Record<string, { shape: number[] }>; pieces: { name: string; kind: string; file: string }[] };
  };
  for (const ck of ['ck_tp2', 'ck_one']) {
    const m = meta(ck);
    const names = Object.keys(m.params).sort();
    assert.deepEqual(names, Object.keys(ref.params).filter(isAdapter).sort(), `${ck}: the adapters and nothing else`);
    assert.deepEqual(m.params['layers.0.attn.qkv.loraB.weight']!.shape, [48, 4], `${ck}: the fused projection's B, whole`);
    assert.deepEqual(m.params['layers.1.mlp.proj.loraA.weight']!.shape, [4, 64], `${ck}: a row-parallel base's A, whole`);
    assert.ok(m.pieces.some((p) => p.kind !== 'param' && p.name === 'layers.0.attn.qkv.loraB.weight'), `${ck}: optimizer state saved`);
    if (ck === 'ck_tp2') {
      // Split adapters are written by both tp ranks (a slice each), replicated ones by tp rank 0.
      const files = (name: string) => new Set(m.pieces.filter((p) => p.kind === 'param' && p.name === name).map((p) => p.file)).size;
      assert.equal(files('layers.0.attn.qkv.loraB.weight'), 2);
      assert.equal(files('layers.0.attn.proj.loraA.weight'), 2);
      assert.equal(files('layers.0.attn.qkv.loraA.weight'), 1);
    }
  }
  for (const [first, second, nproc] of [['tp2_0_2', 'one_2_4', 1], ['one_0_2', 'tp2_sp_2_4', 2]] as const) {
    const a = resume.read(first, first.startsWith('tp2') ? 2 : 1), b = resume.read(second, nproc);
    for (const [outs, at] of [[a, 0], [b, 2]] as const) {
      for (const o of outs) {
        const who = `${at === 0 ? first : second}: rank ${o.rank}`;
        o.losses.forEach((v, i) => assert.ok(Math.abs(v - ref.losses[at + i]!) <= F64.loss * Math.abs(ref.losses[at + i]!), `${who}: loss at step ${at + i} ${v} vs one process ${ref.losses[at + i]}`));
        o.norms.forEach((v, i) => assert.ok(Math.abs(v - ref.norms[at + i]!) <= F64.norm * ref.norms[at + i]!, `${who}: norm at step ${at + i} ${v} vs one process ${ref.norms[at + i]}`));
      }
    }
    for (const o of b) {
      for (const [k, v] of Object.entries(ref.params)) {
        const d = maxRelDiff(o.params[k]!, v);
        assert.ok(d <= F64.param, `${second}: rank ${o.rank}: ${k} after step 3 differs from one process's by ${d}`);
      }
    }
  }
});

// The trainer's LoRA run ([lora] rank > 0 on train.initFrom, a Hugging Face Llama directory) under
// tp=2 with sequence parallelism, against one process and across a resume into one process.
const work = mkdtempSync(join(tmpdir(), 'flotilla-lora-tp-cli-'));
const hfDir = join(work, 'base');
{
  const src = new Llama({ vocabSize: 512, blockSize: 32, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 64 }, { initSeed: 8 });
  savePretrained(src, hfDir, { tokenizer: join(ROOT, 'examples', 'moby-dick-bpe512.json') });
  src.dispose();
}
const LORA_RUN = [
  '--model.blockSize=32', '--model.nLayer=2', '--model.nEmbd=32', '--model.intermediateSize=64', '--data.seqLen=32', '--data.globalBatch=4',
  '--train.evalEvery=0', '--log.progress=plain', '--log.sampleTokens=0', `--train.initFrom=${hfDir}`, '--lora.rank=4', '--lora.alpha=8',
];
const verify = (args: string[]) => started(queue(() => flotilla(['verify', join(ROOT, 'examples', 'llama-tiny.toml'), '--steps', '4', ...LORA_RUN, ...args], { timeoutMs: 300_000 })));
const TP_SP = ['--parallel.tp=2', '--parallel.sequenceParallel=true'];
const verifyTpSp = verify(['--nproc', '2', ...TP_SP]);
const verifyDpDropout = verify(['--nproc', '2', '--lora.dropout=0.1']);
const resumeTpIntoOne = verify(['--nproc', '2', ...TP_SP, '--resume', '2', '--then', '--nproc', '1', '--parallel.tp=1', '--parallel.sequenceParallel=false']);

test('flotilla verify PASSes for a LoRA run from a Hugging Face Llama directory at tp=2 with sequence parallelism; only adapters differ from one process at all', async () => {
  const r = await verifyTpSp;
  assert.equal(r.code, 0, r.out + r.err);
  assert.match(r.out, /tp 2 \+ sequence parallel/);
  assert.match(r.out, /^PASS \(tolerance/m);
  assert.match(r.out, /worst tensor .*\.lora[AB]\.weight\)/);
});

test('a LoRA run\'s checkpoint saved by the trainer at tp=2 (+ sequence parallel) resumes in one process with the straight run\'s numbers', async () => {
  const r = await resumeTpIntoOne;
  assert.equal(r.code, 0, r.out + r.err);
  assert.match(r.out, /^PASS \(tolerance: loss 0\.00001/m);
  assert.match(r.out, /lora[AB]\.weight/);
});

test('flotilla verify of a LoRA run with lora.dropout > 0 under dp sets it to 0 for both runs, as it does model.dropout, and PASSes', async () => {
  const r = await verifyDpDropout;
  assert.equal(r.code, 0, r.out + r.err);
  assert.match(r.out, /verify: lora\.dropout=0\.1 set to 0 for both runs/);
  assert.match(r.out, /^PASS \(tolerance/m);
});

test('LoRA on a GPT whose base is stored in bfloat16, at tp=2 with sequence parallelism, equals one process with the same base', async () => {
  await Promise.all([gptRef, gpt2]);
  const ref = gpt.read('ref_bf16', 1)[0]!, f64 = gpt.read('ref', 1)[0]!;
  assert.notDeepEqual(ref.params['layers.0.attn.qkv.weight'], f64.params['layers.0.attn.qkv.weight'], 'the base is rounded to bfloat16');
  compareLora(gpt, 'tp2_sp_bf16', 2, 'ref_bf16', 16);
});
