// LoRA runs through `flotilla train` ([Note: LoRA run] in src/train/lora_run.ts), from a Hugging Face
// directory the test writes: `flotilla verify` passes for dp = 2 and ZeRO-3; a checkpoint holds the
// adapters (and their optimizer state) only and names its base by size and SHA-256; the base stays
// bit for bit what the directory holds while the adapters train; a dp = 2 checkpoint resumed under
// ZeRO-3 continues to the straight run's losses and adapters; a base changed after the save is
// refused at resume; the mistakes a user can make are one message before any rank starts, with no
// run directory written; a pipeline leaves a frozen tied embedding alone. Also: each architecture's list of Linears (what the launcher checks
// targets against) is the built model's, and adapters of a model built without memory are drawn as
// a whole model draws them; a LoRA checkpoint loads as one whole model (its base and adapters), which
// sampling from the run reads.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { cpSync, existsSync, mkdtempSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { type Tensor, setNumThreads, tidy } from '../src/tensor/index.js';
import { Linear } from '../src/nn/layers.js';
import type { Module } from '../src/nn/module.js';
import { loraAdapters } from '../src/nn/lora.js';
import { Llama } from '../src/models/llama.js';
import { GPT } from '../src/models/gpt.js';
import { modelSpec } from '../src/models/registry.js';
import { hfModuleNames } from '../src/nn/lora.js';
import { GroupedExperts } from '../src/nn/moe.js';
import { EXPERT_PROJECTIONS, expertProjectionNames } from '../src/nn/lora_experts.js';
import { loadPretrained, savePretrained } from '../src/checkpoint/hf.js';
import { loadSafetensors } from '../src/checkpoint/safetensors.js';
import { consolidate } from '../src/checkpoint/export.js';
import { readMeta } from '../src/checkpoint/format.js';
import { parseConfig } from '../src/config/index.js';
import { modelConfigOf } from '../src/config/schema.js';
import { applyRunLora, loraRunModel } from '../src/train/lora_run.js';
import { generate } from '../src/cli/checkpoint.js';
import { writeReport } from '../src/report/index.js';
import { flotilla, ROOT } from './helpers/cli.js';

setNumThreads(1);
const root = mkdtempSync(join(tmpdir(), 'flotilla-lora-train-'));
after(() => rmSync(root, { recursive: true, force: true }));

const tokenizer = join(ROOT, 'examples', 'moby-dick-bpe512.json');
const LLAMA = { vocabSize: 512, blockSize: 32, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 64 };
const llamaDir = join(root, 'llama');
{
  const m = new Llama(LLAMA, { initSeed: 8 });
  savePretrained(m, llamaDir, { tokenizer });
  m.dispose();
}
const llamaConfig = join(ROOT, 'examples', 'llama-tiny.toml');
/** A LoRA run of the tiny Llama on `base` (rank 4 on every Linear but the head). */
const llamaArgs = (base: string): string[] => [
  `--train.initFrom=${base}`, '--model.blockSize=32', '--model.nLayer=2', '--model.nEmbd=32', '--model.intermediateSize=64',
  '--data.seqLen=32', '--data.globalBatch=4', '--train.evalEvery=0', '--log.progress=plain', '--log.sampleTokens=0',
  '--optim.warmupSteps=0', '--lora.rank=4',
];

interface Record_ {
  steps: { step: number; loss: number; gradNorm: number }[];
}
const readRecord = (dir: string, rank: number): Record_ => JSON.parse(readFileSync(join(dir, `rank${rank}.json`), 'utf8')) as Record_;
const sha256 = (path: string): string => createHash('sha256').update(readFileSync(path)).digest('hex');
const isAdapter = (name: string): boolean => /\.lora[AB]\.weight$/.test(name);
const rel = (a: number, b: number): number => Math.abs(a - b) / Math.max(Math.abs(b), 1e-12);
/** ||a - b|| / ||b|| in float64. */
const relDiff = (a: Tensor, b: Tensor): number => tidy(() => {
  const b64 = b.to('float64');
  return Math.sqrt(a.to('float64').sub(b64).pow(2).sum().item() / Math.max(b64.pow(2).sum().item(), 1e-300));
});

test('flotilla verify passes for a LoRA run from a Hugging Face Llama under dp = 2 and ZeRO-3', async () => {
  const r = await flotilla(['verify', llamaConfig, '--nproc', '2', '--steps', '3', ...llamaArgs(llamaDir), '--and', '--parallel.zero=3'], { timeoutMs: 400_000 });
  assert.equal(r.code, 0, `${r.out}\n${r.err}`);
  assert.match(r.out, /^verify: 2 of 2 layouts PASS$/m);
  // The adapters are measured apart from the frozen base, which must not move at all.
  const alone = [...r.out.matchAll(/^trained parameters alone \((\d+) tensors\): (\S+); frozen tensors that differ from the single process: (\d+)$/gm)];
  assert.equal(alone.length, 2, r.out);
  for (const m of alone) {
    assert.ok(Number(m[1]) > 0 && Number(m[2]) <= 1e-4 && m[3] === '0', m[0]);
  }
});

// One straight dp = 2 run (4 steps, checkpoints at 2 and 4), and its step-2 checkpoint resumed under
// ZeRO-3: both record every rank's losses and final parameters.
const base = join(root, 'llama-base'); // its own copy: the last test changes it
cpSync(llamaDir, base, { recursive: true });
const straight = join(root, 'straight'), resumed = join(root, 'resumed');
let started: ReturnType<typeof flotilla> | undefined;
const straightRun = (): ReturnType<typeof flotilla> => (started ??= flotilla(['train', llamaConfig, '--nproc', '2', ...llamaArgs(base), '--train.steps=4', '--checkpoint.every=2', `--train.runDir=${straight}`, '--record', join(root, 'straight-record')], { timeoutMs: 300_000 }));

test('a LoRA checkpoint holds the adapters and their optimizer state only, and names its base; the base stays as the directory holds it, the adapters train', async () => {
  const r = await straightRun();
  assert.equal(r.code, 0, `${r.out}\n${r.err}`);
  assert.match(r.out, /\[model\] .*LoRA rank 4 on 14 modules: 4\.1K trainable, 51\.4K frozen/);
  assert.match(r.out, /\[init\] frozen base from .*llama-base; new adapters \(A from train\.seed, B zero\), step 0/);

  const ckpt = join(straight, 'checkpoints', 'step-000004');
  const meta = readMeta(ckpt);
  const names = Object.keys(meta.params);
  assert.equal(names.length, 2 * 7 * 2, 'A and B of 7 Linears in each of 2 layers');
  assert.ok(names.every(isAdapter), names.join(', '));
  assert.deepEqual(new Set(meta.pieces.map((p) => p.kind)), new Set(['param', 'expAvg', 'expAvgSq']));
  assert.ok(meta.pieces.every((p) => isAdapter(p.name)));
  assert.deepEqual(meta.params['layers.0.attn.k.loraA.weight']!.shape, [4, 32]);
  assert.deepEqual(meta.params['layers.0.attn.k.loraB.weight']!.shape, [16, 4]);
  assert.deepEqual(meta.base, {
    path: resolve(base),
    files: ['config.json', 'model.safetensors'].map((name) => ({ name, bytes: statSync(join(base, name)).size, sha256: sha256(join(base, name)) })),
  });
  assert.equal((meta.config.lora as { rank: number }).rank, 4);

  // Every rank's final parameters: the base bit for bit, the adapters moved (B off zero, A off its draw).
  const { model: hf, config: hfModel } = loadPretrained(base);
  const initial = parseConfig('', ['--model.arch=llama']);
  const start = applyRunLora(hf as Module, { ...initial, lora: { ...initial.lora, rank: 4 }, train: { ...initial.train, seed: 1337 } }, modelSpec('llama'), hfModel);
  const first = new Map(start.namedParameters().map(([n, p]) => [n, p]));
  const ckptTensors = consolidate(ckpt).tensors;
  for (const rank of [0, 1]) {
    const final = loadSafetensors(join(root, 'straight-record', `rank${rank}.safetensors`));
    assert.equal(Object.keys(final).length, first.size);
    for (const [name, t] of Object.entries(final)) {
      const was = first.get(name)!;
      if (!isAdapter(name)) {
        assert.deepEqual(t.toNumbers(), was.toNumbers(), `rank ${rank}: frozen ${name} unchanged`);
      } else {
        assert.ok(relDiff(t, was) > 1e-4, `rank ${rank}: adapter ${name} trained`);
        if (name.endsWith('loraB.weight')) assert.ok(tidy(() => t.abs().max().item()) > 0, `${name} is no longer zero`);
        assert.deepEqual(t.toNumbers(), ckptTensors[name]!.toNumbers(), `the checkpoint holds ${name} as trained`);
      }
    }
  }
  start.dispose();

  // The checkpoint as one whole model (generate, export): the run's base with the adapters it saved,
  // which is what the ranks held at the end; sampling from the run reads it.
  const whole = loraRunModel(ckpt);
  const final = loadSafetensors(join(root, 'straight-record', 'rank0.safetensors'));
  for (const [name, p] of whole.model.namedParameters()) assert.deepEqual(p.toNumbers(), final[name]!.toNumbers(), name);
  whole.model.dispose();
  const [sample] = await generate(straight, { prompts: ['Call me Ishmael. '], tokens: 6, temperature: 0.8, topK: 40, topP: 1, seed: 3, ignoreEos: true });
  assert.ok(sample!.text.length > 0);

  // The report gives the trainable and frozen counts: per layer r (in + out) of q, k, v, o (32 -> 32, 16, 16; 32 -> 32) and gate, up, down (32 <-> 64).
  const page = readFileSync(writeReport([straight], { out: join(root, 'report.html') }), 'utf8');
  assert.match(page, /<h3>Parameters<\/h3><p>4,096 trainable \(LoRA rank 4 on 14 modules\), 51,360 frozen<\/p>/);
});

test('a dp = 2 LoRA checkpoint resumed under ZeRO-3 continues to the straight run\'s losses and adapters', async () => {
  assert.equal((await straightRun()).code, 0);
  const r = await flotilla([
    'train', llamaConfig, '--nproc', '2', ...llamaArgs(base), '--train.steps=4', '--parallel.zero=3',
    `--train.runDir=${resumed}`, `--resume=${join(straight, 'checkpoints', 'step-000002')}`, '--record', join(root, 'resumed-record'),
  ], { timeoutMs: 300_000 });
  assert.equal(r.code, 0, `${r.out}\n${r.err}`);
  assert.match(r.out, /\[resume\] resumed from step 2 .*saved by 2 rank\(s\), data parallel 2/);
  assert.match(r.out, /\[init\] frozen base from .*llama-base; adapters from step 2/);
  const want = readRecord(join(root, 'straight-record'), 0).steps.filter((s) => s.step > 2);
  assert.equal(want.length, 2);
  const wantParams = loadSafetensors(join(root, 'straight-record', 'rank0.safetensors'));
  for (const rank of [0, 1]) {
    const got = readRecord(join(root, 'resumed-record'), rank).steps;
    assert.deepEqual(got.map((s) => s.step), [3, 4]);
    got.forEach((s, i) => {
      assert.ok(rel(s.loss, want[i]!.loss) < 1e-5, `rank ${rank} step ${s.step}: loss ${s.loss} vs ${want[i]!.loss}`);
      assert.ok(rel(s.gradNorm, want[i]!.gradNorm) < 1e-4, `rank ${rank} step ${s.step}: grad norm ${s.gradNorm} vs ${want[i]!.gradNorm}`);
    });
    const params = loadSafetensors(join(root, 'resumed-record', `rank${rank}.safetensors`));
    for (const [name, t] of Object.entries(params)) {
      const d = relDiff(t, wantParams[name]!);
      assert.ok(isAdapter(name) ? d < 1e-5 : d === 0, `rank ${rank}: ${name} differs by ${d}`);
    }
  }
});

test('a LoRA run from a GPT-2 directory adapts c_attn and both c_proj (attention and MLP) by their Hugging Face names; in a pipeline the frozen tied embedding and its head copy stay the base\'s', async () => {
  const gptDir = join(root, 'gpt2');
  const g = new GPT({ vocabSize: 512, blockSize: 32, nLayer: 2, nHead: 2, nEmbd: 32, tieEmbeddings: true }, { initSeed: 9 });
  savePretrained(g, gptDir, { tokenizer });
  const wte = g.namedParameters().find(([n]) => n === 'wte.weight')![1].toNumbers();
  g.dispose();
  const run = join(root, 'gpt2-run'), record = join(root, 'gpt2-record');
  const r = await flotilla([
    'train', join(ROOT, 'examples', 'gpt-tiny.toml'), '--nproc', '2', '--parallel.pp=2', `--train.initFrom=${gptDir}`, '--model.blockSize=32', '--model.nLayer=2', '--model.nHead=2', '--model.nEmbd=32',
    '--model.tieEmbeddings=true', '--data.seqLen=32', '--data.globalBatch=4', '--train.steps=2', '--train.evalEvery=0', '--log.progress=plain', '--log.sampleTokens=0', '--optim.warmupSteps=0',
    '--lora.rank=2', '--lora.targets=c_attn,c_proj', '--checkpoint.every=2', `--train.runDir=${run}`, '--record', record,
  ], { timeoutMs: 200_000 });
  assert.equal(r.code, 0, `${r.out}\n${r.err}`);
  const meta = readMeta(join(run, 'checkpoints', 'step-000002'));
  const want = [0, 1].flatMap((i) => ['attn.qkv', 'attn.proj', 'mlp.proj'].flatMap((m) => [`layers.${i}.${m}.loraA.weight`, `layers.${i}.${m}.loraB.weight`]));
  assert.deepEqual(Object.keys(meta.params).sort(), want.sort());
  assert.deepEqual(meta.params['layers.0.attn.qkv.loraB.weight']!.shape, [96, 2]);
  assert.deepEqual(meta.params['layers.1.mlp.proj.loraA.weight']!.shape, [2, 128]);
  assert.match(r.out, /LoRA rank 2 on 6 modules: 1\.41K trainable/); // 2 x (2 (32 + 96) + 2 (32 + 32) + 2 (128 + 32))
  // The first stage's embedding and the last stage's head copy of it: both the directory's.
  for (const rank of [0, 1]) assert.deepEqual(loadSafetensors(join(record, `rank${rank}.safetensors`))['wte.weight']!.toNumbers(), wte, `rank ${rank}`);
});

test('a base changed after the save: --resume refuses with one message naming the file and the fix, and changes nothing', async () => {
  assert.equal((await straightRun()).code, 0);
  const weights = join(base, 'model.safetensors');
  const bytes = readFileSync(weights);
  bytes.writeUInt8(bytes.readUInt8(bytes.length - 1) ^ 0x01, bytes.length - 1); // one bit of the last weight
  writeFileSync(weights, bytes);
  const before = readdirSync(join(straight, 'checkpoints')).sort();
  const r = await flotilla(['train', llamaConfig, '--nproc', '2', ...llamaArgs(base), '--train.steps=6', `--train.runDir=${straight}`, '--resume'], { timeoutMs: 200_000 });
  assert.notEqual(r.code, 0);
  assert.match(r.out + r.err, /the base changed since the checkpoint .*step-000004 was saved: .*llama-base\/model\.safetensors is \d+ bytes with SHA-256 [0-9a-f]{16}\.\.\., and the adapters were trained on \d+ bytes with SHA-256 [0-9a-f]{16}\.\.\.; restore the base the adapters were trained on/);
  assert.deepEqual(readdirSync(join(straight, 'checkpoints')).sort(), before);
  assert.ok(!readdirSync(straight).some((f) => f.startsWith('config.resumed')), 'no resumed run recorded');
});

test('LoRA mistakes are one message before any rank starts, and no run directory is written', async () => {
  const cases: [string[], RegExp][] = [
    [['--train.initFrom='], /LoRA trains adapters on a frozen base: set train\.initFrom to a Hugging Face directory or a checkpoint/],
    [['--lora.targets=q_proj,qkv'], /lora\.targets: target "qkv" matches no Linear of this model; its Linears are named "down", "down_proj", .*"q", "q_proj", "up", "up_proj", "v", "v_proj" \(or use "all-linear"\)/],
    [['--lora.rank=20', '--lora.targets=k_proj'], /lora\.rank: rank 20 is larger than the smaller dimension of layers\.0\.attn\.k \(16 x 32\); use a rank of at most 16/],
    [['--lora.targets='], /lora\.targets is empty; name the modules to adapt/],
  ];
  for (const [i, [extra, message]] of cases.entries()) {
    const run = join(root, `refused-${i}`);
    const r = await flotilla(['train', llamaConfig, '--nproc', '2', ...llamaArgs(llamaDir), '--train.steps=2', `--train.runDir=${run}`, ...extra]);
    assert.notEqual(r.code, 0, extra.join(' '));
    assert.match(r.err, message);
    assert.doesNotMatch(r.out + r.err, /\[rank \d\]/, 'no rank started');
    assert.ok(!existsSync(run), `${run} was not written`);
  }
  // A LoRA checkpoint is not a base: merge it first.
  assert.equal((await straightRun()).code, 0);
  const run = join(root, 'refused-lora-base');
  const r = await flotilla(['train', llamaConfig, ...llamaArgs(join(straight, 'checkpoints', 'step-000002')), '--train.steps=2', `--train.runDir=${run}`]);
  assert.notEqual(r.code, 0);
  assert.match(r.err, /train\.initFrom: .*step-000002 is a LoRA checkpoint \(adapters on the base .*llama-base\), not a model; merge its adapters into the base first \(flotilla export .* OUT --format hf --merge\)/);
  assert.ok(!existsSync(run));
  // A LoRA checkpoint resumed without [lora]: its adapters are not a model either.
  const run2 = join(root, 'refused-lora-resume');
  const r2 = await flotilla(['train', llamaConfig, ...llamaArgs(llamaDir), '--lora.rank=0', '--train.steps=3', `--train.runDir=${run2}`, `--resume=${join(straight, 'checkpoints', 'step-000002')}`]);
  assert.notEqual(r2.code, 0);
  assert.match(r2.err, /the checkpoint .*step-000002 holds LoRA adapters \(rank 4\) on the base .*llama-base, and this run has lora\.rank = 0; resume it with the \[lora\] section and train\.initFrom it was saved with/);
  assert.ok(!existsSync(run2));
});

test('each architecture\'s list of Linears is the built model\'s (paths, shapes, Hugging Face names)', () => {
  const llama = ['--model.arch=llama', '--model.vocabSize=64', '--model.nLayer=2', '--model.nEmbd=32', '--model.nHead=4', '--model.nKvHead=2', '--model.intermediateSize=48'];
  const gpt = ['--data.seqLen=16', '--model.vocabSize=64', '--model.blockSize=16', '--model.nLayer=2', '--model.nHead=2', '--model.nEmbd=16'];
  const cases = [llama, [...llama, '--model.tieEmbeddings=true', '--moe.experts=2', '--moe.topK=1', '--moe.every=2'], gpt, [...gpt, '--model.tieEmbeddings=false', '--moe.experts=2', '--moe.topK=1', '--moe.every=2']];
  for (const args of cases) {
    const c = parseConfig('', args);
    const spec = modelSpec(c.model.arch);
    const mc = modelConfigOf(c);
    const m = spec.build(mc, { initSeed: 0, deferInit: true });
    const hf = hfModuleNames(spec.hf!.tensors(mc));
    const built = m.namedModules().filter(([p, x]) => p !== '' && x instanceof Linear).map(([path, x]) => {
      const l = x as Linear;
      return { path, ...(hf.has(path) ? { hf: hf.get(path)! } : {}), inFeatures: l.inFeatures, outFeatures: l.outFeatures };
    });
    const listed = spec.linears!(mc);
    assert.deepEqual(listed.filter((l) => l.experts === undefined), built, args.join(' '));
    // The Llama's experts' projections, stacks of per-expert Linears ([Note: LoRA on experts]): the built stacks' shapes.
    const stacks = m.namedModules().filter((e): e is [string, GroupedExperts] => e[1] instanceof GroupedExperts).flatMap(([path, g]) => expertProjectionNames(g).map((n) => {
      const w = g[EXPERT_PROJECTIONS[n]!]!;
      return { path: `${path}.${n}`, ...(hf.has(`${path}.${n}`) ? { hf: hf.get(`${path}.${n}`)! } : {}), inFeatures: w.shape[1]!, outFeatures: w.shape[2]!, experts: g.groups };
    }));
    if (c.model.arch === 'llama') assert.deepEqual(listed.filter((l) => l.experts !== undefined), stacks, args.join(' '));
    m.dispose();
  }
});

test('adapters of a model built without memory (ZeRO-3) are drawn as a whole model draws them: A from the seed and its name, B zero', () => {
  const spec = modelSpec('llama');
  const c = parseConfig('', ['--model.arch=llama', '--lora.rank=3', '--lora.targets=q_proj,down_proj', '--train.initFrom=/b', '--train.seed=5']);
  const mc = { ...c.model, ...LLAMA };
  const whole = applyRunLora(spec.build(mc, { initSeed: 5 }), c, spec, mc);
  const deferred = applyRunLora(spec.build(mc, { initSeed: 5, deferInit: true }), c, spec, mc);
  assert.ok(deferred.namedParameters().filter(([n]) => isAdapter(n)).every(([, p]) => p.storageNbytes() === 0), 'no adapter memory until the shards are made');
  deferred.materialize();
  const a = whole.namedParameters(), b = new Map(deferred.namedParameters());
  assert.equal(loraAdapters(whole).length, 4);
  assert.equal(a.filter(([n]) => isAdapter(n)).length, 8);
  for (const [name, p] of a) assert.deepEqual(b.get(name)!.toNumbers(), p.toNumbers(), name);
  assert.ok(a.some(([n, p]) => n.endsWith('loraA.weight') && tidy(() => p.abs().max().item()) > 0));
  whole.dispose();
  deferred.dispose();
});
