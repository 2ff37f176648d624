// LoRA adapters in and out as PEFT directories (src/checkpoint/peft.ts) and a LoRA run's checkpoint
// used whole (src/train/lora_export.ts): `flotilla export --format peft` read back by a
// reader of the test's own (test/oracle/peft_reader.py: json and a safetensors header parse) that
// checks PEFT's config fields and tensor names and merges W + scale * B A itself (transposed for
// GPT-2's Conv1D), against `--format hf --merge`; the adapter read back into any rank's ranges bit for
// bit; `generate --adapter` on the base equals generate from the merged export and from the run's
// checkpoint, for a Llama and a GPT-2; `flotilla train` end to end, from a Hugging Face Llama to a
// PEFT adapter that `[lora] adapter` continues; the mismatches a user can cause, each one clear error.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync, cpSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { manualSeed, noGrad, randn, setNumThreads, tensor, tidy, zeros } from '../src/tensor/index.js';
import { applyLora, loraAdapters } from '../src/nn/lora.js';
import { modelSpec } from '../src/models/registry.js';
import { placementsOf, type ParamPlacement } from '../src/parallel/placement.js';
import { initProcessGroup, type ProcessGroup } from '../src/distributed/process_group.js';
import { Checkpointer } from '../src/checkpoint/checkpoint.js';
import { savePretrained, readHfDir } from '../src/checkpoint/hf.js';
import { loadSafetensors } from '../src/checkpoint/safetensors.js';
import { checkPeftAdapter, loadPeftAdapter, loraHfNames, PEFT_CONFIG } from '../src/checkpoint/peft.js';
import { exportCommand, generate } from '../src/cli/checkpoint.js';
import type { ModelConfig } from '../src/config/schema.js';
import { loadConfig } from '../src/config/index.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';
import { flotilla } from './helpers/cli.js';
import { baseIdentity } from '../src/train/lora_run.js';
import { writeChatTokenizer } from './fixtures/chat_model.js';

setNumThreads(1);
const skip = oracleMissing();
const root = mkdtempSync(join(tmpdir(), 'flotilla-lora-peft-'));
after(() => rmSync(root, { recursive: true, force: true }));
let world: ProcessGroup;
before(() => {
  world = initProcessGroup();
});

interface Case {
  arch: 'llama' | 'gpt';
  model: Record<string, unknown>;
  lora: { rank: number; alpha: number; dropout: number; rsLora: boolean; targets: string[] };
  /** PEFT's target_modules for these targets. */
  peftTargets: string[];
  /** One adapted module: its PEFT A name and the flotilla parameter. */
  one: { peft: string; flotilla: string };
}

const CASES: Case[] = [
  {
    arch: 'llama',
    model: { arch: 'llama', vocabSize: 128, blockSize: 32, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 16, intermediateSize: 24 },
    lora: { rank: 4, alpha: 8, dropout: 0.1, rsLora: false, targets: ['q_proj', 'v_proj', 'down_proj'] },
    peftTargets: ['down_proj', 'q_proj', 'v_proj'],
    one: { peft: 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight', flotilla: 'layers.0.attn.q.loraA.weight' },
  },
  {
    arch: 'gpt',
    model: { arch: 'gpt', vocabSize: 128, blockSize: 32, nLayer: 2, nHead: 2, nEmbd: 12, gelu: 'tanh', tieEmbeddings: true },
    lora: { rank: 3, alpha: 5, dropout: 0, rsLora: true, targets: ['all-linear'] },
    peftTargets: ['c_attn', 'c_fc', 'c_proj'],
    one: { peft: 'base_model.model.transformer.h.0.attn.c_attn.lora_A.weight', flotilla: 'layers.0.attn.qkv.loraA.weight' },
  },
];

interface Made {
  c: Case;
  base: string;
  model: ModelConfig;
  run: string;
  /** The checkpoint's adapters by flotilla name, as saved. */
  adapters: Map<string, number[]>;
}

/** A Hugging Face base directory of the case's model (random weights). */
function makeBase(c: Case, dir: string, seed: number, dtype: 'float32' | 'bfloat16' = 'float32'): ModelConfig {
  const m = modelSpec(c.arch).build(c.model, { initSeed: seed });
  savePretrained(m, dir, { dtype });
  m.dispose();
  return readHfDir(dir).model;
}

/**
 * A LoRA run's checkpoint made through the API: the base's model with adapters (B made nonzero), the
 * adapters alone saved, and a meta.config that says how it was built.
 */
async function makeLoraRun(c: Case, base: string, model: ModelConfig, run: string, tokenizer = 'byte'): Promise<Map<string, number[]>> {
  const spec = modelSpec(c.arch);
  const m = spec.build(model, { initSeed: 0 });
  try {
    applyLora(m, { ...c.lora, hfNames: loraHfNames(spec, model as unknown as Record<string, unknown>), initSeed: 11 });
    manualSeed(5);
    for (const [, a] of loraAdapters(m)) noGrad(() => a.B.weight.copy_(randn(a.B.weight.shape).mul(0.2)));
    const adapters = m.namedParameters().filter(([n]) => /\.lora[AB]\.weight$/.test(n));
    const config = { model: { ...model }, lora: { ...c.lora, baseDtype: 'fp32', adapter: '' }, train: { initFrom: base, seed: 11 }, data: { tokenizer } };
    await new Checkpointer({ dir: join(run, 'checkpoints'), keep: 1, async: false, world }).save(3, { placements: placementsOf(adapters) }, { config, base: baseIdentity(base) });
    return new Map(adapters.map(([n, t]) => [n, t.toNumbers()]));
  } finally {
    m.dispose();
  }
}

const made = new Map<string, Made>();
async function setup(c: Case): Promise<Made> {
  const have = made.get(c.arch);
  if (have) return have;
  const base = join(root, `${c.arch}-base`);
  const model = makeBase(c, base, 3);
  const run = join(root, `${c.arch}-run`);
  const adapters = await makeLoraRun(c, base, model, run);
  const m: Made = { c, base, model, run, adapters };
  made.set(c.arch, m);
  return m;
}

function cli(args: string[]): string[] {
  const lines: string[] = [];
  assert.equal(exportCommand(args, (l) => lines.push(l)), 0);
  return lines;
}

test('a chat run whose data.tokenizer is a Hugging Face directory: export --format peft and --merge carry its tokenizer.json and tokenizer_config.json (the chat template)', async () => {
  const c = CASES[0]!;
  const m = await setup(c);
  const tokenizer = writeChatTokenizer(join(root, 'chat-tokenizer'));
  const run = join(root, 'chat-run');
  await makeLoraRun(c, m.base, m.model, run, tokenizer);
  const peft = join(root, 'chat-peft'), merged = join(root, 'chat-merged');
  cli([run, peft, '--format', 'peft']);
  cli([run, merged, '--format', 'hf', '--merge']);
  for (const out of [peft, merged]) {
    for (const f of ['tokenizer.json', 'tokenizer_config.json']) {
      assert.ok(existsSync(join(out, f)), `${out} has ${f}: ${readdirSync(out).join(', ')}`);
      assert.equal(readFileSync(join(out, f), 'utf8'), readFileSync(join(tokenizer, f), 'utf8'), `${out}/${f}`);
    }
  }
});

const greedy = (prompt: string) => ({ prompts: [prompt], tokens: 12, temperature: 0, topK: 0, topP: 1, seed: 1, ignoreEos: true });

for (const c of CASES) {
  test(`${c.arch}: the PEFT export has PEFT's config and names; the merged export is W + scale * B A as the reader computes it`, { skip }, async () => {
    const m = await setup(c);
    const peft = join(root, `${c.arch}-peft`), merged = join(root, `${c.arch}-merged`);
    cli([m.run, peft, '--format', 'peft']);
    cli([m.run, merged, '--format', 'hf', '--merge']);
    assert.deepEqual(readdirSync(peft).sort(), ['adapter_config.json', 'adapter_model.safetensors']);

    const r = runOracle('peft_reader', {}, { adapter: peft, base: m.base });
    const config = JSON.parse(r.metadata.config!) as Record<string, unknown>;
    assert.deepEqual(config, {
      alpha_pattern: {}, base_model_name_or_path: m.base, bias: 'none', fan_in_fan_out: c.arch === 'gpt', inference_mode: true,
      init_lora_weights: true, layers_to_transform: null, lora_alpha: c.lora.alpha, lora_dropout: c.lora.dropout, modules_to_save: null,
      peft_type: 'LORA', r: c.lora.rank, rank_pattern: {}, revision: null, target_modules: c.peftTargets, task_type: 'CAUSAL_LM',
      use_dora: false, use_rslora: c.lora.rsLora,
    });
    const names = JSON.parse(r.metadata.names!) as Record<string, number[]>;
    assert.equal(Object.keys(names).length, m.adapters.size);
    const oneShape = names[c.one.peft];
    assert.ok(oneShape, `${c.one.peft} in ${Object.keys(names).join(', ')}`);
    assert.equal(oneShape[0], c.lora.rank);
    // Every stored A and B is the checkpoint's adapter, bit for bit, under its PEFT name.
    const spec = modelSpec(c.arch);
    const hf = loraHfNames(spec, m.model as unknown as Record<string, unknown>);
    for (const [name, values] of m.adapters) {
      const mm = /^(.+)\.lora([AB])\.weight$/.exec(name)!;
      const t = r.tensors[`${mm[2]}.${hf.get(mm[1]!)}`];
      assert.ok(t, `${name} under its PEFT name`);
      assert.deepEqual(t.toNumbers(), values, name);
      assert.deepEqual(names[`base_model.model.${hf.get(mm[1]!)}.lora_${mm[2]}.weight`], mm[2] === 'A' ? [c.lora.rank, t.shape[1]] : [t.shape[0], c.lora.rank]);
    }
    // The merged export: every adapted weight as the reader merged it, every other one the base's.
    const mergedT = loadSafetensors(join(merged, 'model.safetensors'));
    const baseT = loadSafetensors(join(m.base, 'model.safetensors'));
    const mergedHere = Object.keys(r.tensors).filter((k) => k.startsWith('merged.'));
    assert.equal(mergedHere.length, m.adapters.size / 2);
    for (const [name, t] of Object.entries(mergedT)) {
      assert.equal(t.dtype, 'float32', name);
      const want = r.tensors[`merged.${name}`];
      if (!want) {
        assert.deepEqual(t.toNumbers(), baseT[name]!.toNumbers(), `${name} is not adapted: the base's`);
        continue;
      }
      const err = tidy(() => t.to('float64').sub(want).abs().max().item());
      assert.ok(err <= 1e-6, `${name}: merged differs from the reader's W + scale * B A by ${err}`);
      const moved = tidy(() => t.sub(baseT[name]!).abs().max().item());
      assert.ok(moved > 1e-3, `${name}: the adapter moved the weight (${moved})`);
    }
    assert.equal(JSON.parse(readFileSync(join(merged, 'config.json'), 'utf8')).torch_dtype, 'float32');
  });

  test(`${c.arch}: generate with --adapter on the base equals generate from the merged export and from the run`, async () => {
    const m = await setup(c);
    const peft = join(root, `${c.arch}-peft-gen`), merged = join(root, `${c.arch}-merged-gen`);
    cli([m.run, peft, '--format', 'peft']);
    cli([m.run, merged, '--format', 'hf', '--merge']);
    const withAdapter = await generate(m.base, { ...greedy('The whale'), adapter: peft });
    const fromMerged = await generate(merged, greedy('The whale'));
    const fromRun = await generate(m.run, greedy('The whale'));
    const baseAlone = await generate(m.base, greedy('The whale'));
    assert.equal(withAdapter[0]!.text, fromMerged[0]!.text);
    assert.equal(fromRun[0]!.text, fromMerged[0]!.text);
    assert.notEqual(baseAlone[0]!.text, withAdapter[0]!.text, 'the adapter changes what the base samples');
  });
}

test('[lora] adapter: the PEFT tensors load into any range or tensor-parallel slice of each adapter bit for bit, after checking rank, alpha, rsLora and targets', async () => {
  const c = CASES[0]!;
  const m = await setup(c);
  const peft = join(root, 'llama-peft-load');
  cli([m.run, peft, '--format', 'peft']);
  const run = { model: m.model as unknown as Record<string, unknown>, lora: c.lora };
  // Ranges of each adapter as ZeRO-3 shards hold them (uneven thirds), and the whole tensor.
  let loaded = 0;
  for (const [name, values] of m.adapters) {
    const n = values.length;
    const cuts = [0, Math.floor(n / 3) + 1, Math.floor((2 * n) / 3) - 1, n];
    for (let k = 0; k < 3; k++) {
      const held = { offset: cuts[k]!, numel: cuts[k + 1]! - cuts[k]! };
      const buf = zeros([held.numel]);
      const shape = name.includes('loraA') ? [c.lora.rank, n / c.lora.rank] : [n / c.lora.rank, c.lora.rank];
      const p: ParamPlacement = { name, param: buf, shape, dtype: 'float32', held, stateHeld: held, writes: held, values: () => buf };
      loaded += loadPeftAdapter(peft, [p], run);
      assert.deepEqual(buf.toNumbers(), values.slice(held.offset, held.offset + held.numel), `${name}: range ${k}`);
      buf.dispose();
    }
  }
  assert.equal(loaded, 3 * m.adapters.size);
  // Tensor-parallel slices: a column-parallel q splits B by output rows, a row-parallel down_proj
  // splits A by input columns; each of two ranks reads its slice.
  for (const [name, dim] of [['layers.1.attn.q.loraB.weight', 0], ['layers.0.mlp.down.loraA.weight', 1]] as const) {
    const values = m.adapters.get(name)!;
    const shape = name.includes('loraA') ? [c.lora.rank, values.length / c.lora.rank] : [values.length / c.lora.rank, c.lora.rank];
    const whole = tidy(() => tensor(Float32Array.from(values), { shape }));
    for (let index = 0; index < 2; index++) {
      const want = tidy(() => whole.narrow(dim, (index * shape[dim]!) / 2, shape[dim]! / 2).contiguous());
      const local = zeros(want.shape);
      const held = { offset: 0, numel: local.numel() };
      const p: ParamPlacement = { name, param: local, shape, dtype: 'float32', held, stateHeld: held, writes: held, values: () => local.view(-1), tp: { dim, chunks: 1, parts: 2, index } };
      loadPeftAdapter(peft, [p], run);
      assert.deepEqual(local.toNumbers(), want.toNumbers(), `${name}: tp slice ${index} of 2 along dim ${dim}`);
      local.dispose();
      want.dispose();
    }
    whole.dispose();
  }
  // targets written differently but adapting the same modules are the same adapter.
  assert.doesNotThrow(() => checkPeftAdapter(peft, run.model, { ...c.lora, targets: ['v_proj', 'down_proj', 'q_proj'] }));
  // Each field that differs is named, with the fix.
  assert.throws(() => checkPeftAdapter(peft, run.model, { ...c.lora, rank: 2 }), /has rank r = 4, and lora.rank = 2: set lora.rank = 4/);
  assert.throws(() => checkPeftAdapter(peft, run.model, { ...c.lora, alpha: 16 }), /has lora_alpha = 8, and lora.alpha = 16: set lora.alpha = 8/);
  assert.throws(() => checkPeftAdapter(peft, run.model, { ...c.lora, rsLora: true }), /has use_rslora = false, and lora.rsLora = true/);
  assert.throws(() => checkPeftAdapter(peft, run.model, { ...c.lora, targets: ['all-linear'] }), /target_modules = \["down_proj","q_proj","v_proj"\], and lora.targets = \["all-linear"\] adapts .*set lora.targets/);
  // A GPT-2's adapter for a Llama run: the module, before any field.
  const gptPeft = join(root, 'gpt-peft-for-llama');
  cli([(await setup(CASES[1]!)).run, gptPeft, '--format', 'peft']);
  assert.throws(() => checkPeftAdapter(gptPeft, run.model, c.lora), /holds weights for module 'transformer\.h\.0\.attn\.c_attn', which this LlamaForCausalLM does not have; the adapter was made for another base model/);
  // The same targets on a wider Llama: the first tensor whose shape differs.
  assert.throws(() => checkPeftAdapter(peft, { ...run.model, intermediateSize: 32 }, c.lora), /'base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_A\.weight' is \[4, 24\], this model's is \[4, 32\].*another base model/);
});

test('the merged export is stored in the base\'s dtype (bfloat16 here) unless --dtype says otherwise', { skip }, async () => {
  const c = CASES[1]!;
  const base = join(root, 'gpt-base-bf16'), run = join(root, 'gpt-run-bf16');
  const model = makeBase(c, base, 6, 'bfloat16');
  await makeLoraRun(c, base, model, run);
  const merged = join(root, 'gpt-merged-bf16'), peft = join(root, 'gpt-peft-bf16'), wide = join(root, 'gpt-merged-bf16-fp32');
  cli([run, merged, '--format', 'hf', '--merge']);
  cli([run, wide, '--format', 'hf', '--merge', '--dtype', 'fp32']);
  cli([run, peft, '--format', 'peft']);
  assert.equal(JSON.parse(readFileSync(join(merged, 'config.json'), 'utf8')).torch_dtype, 'bfloat16');
  assert.equal(JSON.parse(readFileSync(join(wide, 'config.json'), 'utf8')).torch_dtype, 'float32');
  const r = runOracle('peft_reader', {}, { adapter: peft, base });
  const bf = loadSafetensors(join(merged, 'model.safetensors')), f32 = loadSafetensors(join(wide, 'model.safetensors'));
  for (const [name, t] of Object.entries(bf)) {
    assert.equal(t.dtype, 'bfloat16', name);
    assert.equal(f32[name]!.dtype, 'float32', name);
    const want = r.tensors[`merged.${name}`];
    if (!want) continue;
    // float32 merge of the bfloat16 base, then one bfloat16 rounding (8 bits of mantissa).
    const { err, top } = tidy(() => ({ err: t.to('float64').sub(want).abs().max().item(), top: want.abs().max().item() }));
    assert.ok(err <= top * 2 ** -8, `${name}: ${err} from the reader's merge`);
    const err32 = tidy(() => f32[name]!.to('float64').sub(want).abs().max().item());
    assert.ok(err32 <= 1e-6, `${name} in float32: ${err32}`);
  }
});

test('mismatches: an adapter for another base, a rank its tensors do not have, a config flotilla cannot honour, a non-LoRA checkpoint', async () => {
  const llama = await setup(CASES[0]!), gpt = await setup(CASES[1]!);
  const peft = join(root, 'llama-peft-bad');
  cli([llama.run, peft, '--format', 'peft']);
  const g = greedy('x');
  // A Llama's adapter on a GPT-2: the first module it names.
  await assert.rejects(generate(gpt.base, { ...g, adapter: peft }), /holds weights for module 'model\.layers\.0\.mlp\.down_proj', which this GPT2LMHeadModel does not have; the adapter was made for another base model/);
  // On a Llama of another width: the first shape.
  const wide = join(root, 'llama-wide');
  makeBase({ ...CASES[0]!, model: { ...CASES[0]!.model, intermediateSize: 32 } }, wide, 4);
  await assert.rejects(generate(wide, { ...g, adapter: peft }), /'base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_A\.weight' is \[4, 24\], this model's is \[4, 32\]/);
  // adapter_config.json's r is not its tensors' rank.
  const badRank = join(root, 'llama-peft-rank');
  cpSync(peft, badRank, { recursive: true });
  const cfg = JSON.parse(readFileSync(join(badRank, PEFT_CONFIG), 'utf8')) as Record<string, unknown>;
  writeFileSync(join(badRank, PEFT_CONFIG), JSON.stringify({ ...cfg, r: 2 }));
  await assert.rejects(generate(llama.base, { ...g, adapter: badRank }), /down_proj\.lora_A\.weight' is \[4, 24\], this model's is \[2, 24\] \(rank 2/);
  // What flotilla's adapters cannot be.
  for (const [field, value, says] of [['bias', 'all', /bias = "all" is not supported/], ['rank_pattern', { q_proj: 8 }, /rank_pattern = .* is not supported/], ['peft_type', 'IA3', /peft_type = "IA3" is not supported; flotilla reads LoRA adapters/], ['target_modules', '.*q_proj', /regular expression/]] as const) {
    const dir = join(root, `llama-peft-${field}`);
    cpSync(peft, dir, { recursive: true });
    writeFileSync(join(dir, PEFT_CONFIG), JSON.stringify({ ...cfg, [field]: value }));
    await assert.rejects(generate(llama.base, { ...g, adapter: dir }), says);
  }

  // A checkpoint of a whole model has no adapters to export.
  const whole = join(root, 'whole-run');
  const m = modelSpec('llama').build(llama.model, { initSeed: 1 });
  await new Checkpointer({ dir: join(whole, 'checkpoints'), keep: 1, async: false, world }).save(1, { placements: placementsOf(m.namedParameters()) }, { config: { model: { ...llama.model }, lora: { rank: 0 } } });
  m.dispose();
  const out = join(root, 'never');
  assert.throws(() => cli([whole, out, '--format', 'peft']), /is not a LoRA run's checkpoint \(its lora.rank is 0: it holds the whole model\), so it has no adapters to export/);
  assert.throws(() => cli([whole, out, '--format', 'hf', '--merge']), /--merge merges a LoRA run's adapters into its base, and .* is not a LoRA run's checkpoint/);
  // A LoRA run's checkpoint is not a whole model: it says how to export it.
  assert.throws(() => cli([llama.run, out, '--format', 'hf']), /is a LoRA run's checkpoint \(adapters only\); add --format hf --merge .* or use --format peft/);
  assert.throws(() => cli([llama.run, `${out}.safetensors`]), /add --format hf --merge/);
  assert.throws(() => cli([llama.run, out, '--format', 'peft', '--merge']), /--merge goes with --format hf/);
  assert.equal(existsSync(out), false, 'nothing written');
  // --adapter on a LoRA run's checkpoint: it has its own.
  await assert.rejects(generate(llama.run, { ...g, adapter: peft }), /brings its own adapters; --adapter goes with a base model/);
});

test('lora.adapter is an input path: relative to its config file, or on the command line to the current directory', () => {
  const dir = join(root, 'configs');
  mkdirSync(dir, { recursive: true });
  const file = join(dir, 'run.toml');
  writeFileSync(file, '[train]\ninitFrom = "/abs/base"\n[lora]\nrank = 4\nadapter = "adapters/mine"\n');
  assert.equal(loadConfig(file, []).lora.adapter, join(dir, 'adapters', 'mine'));
  assert.equal(loadConfig(file, ['--lora.adapter=other']).lora.adapter, resolve('other'));
  assert.equal(loadConfig(file, ['--lora.adapter=']).lora.adapter, '');
});

test('flotilla train --nproc 2 fine-tunes LoRA adapters on a Hugging Face Llama; export --format peft, --merge and generate agree; [lora] adapter continues it under ZeRO-3 from the same tensors', async () => {
  const c: Case = { ...CASES[0]!, model: { ...CASES[0]!.model, vocabSize: 256 } };
  const base = join(root, 'e2e-base');
  const model = makeBase(c, base, 9);
  const toml = join(root, 'e2e.toml');
  const m = model as unknown as Record<string, unknown>;
  writeFileSync(toml, [
    '[model]', 'arch = "llama"', ...['vocabSize', 'blockSize', 'nLayer', 'nHead', 'nKvHead', 'nEmbd', 'intermediateSize'].map((k) => `${k} = ${String(m[k])}`),
    '[data]', 'tokenizer = "byte"', 'source = "moby-dick"', 'seqLen = 32', 'globalBatch = 4',
    '[train]', 'steps = 2', 'evalEvery = 0', `initFrom = ${JSON.stringify(base)}`,
    '[optim]', 'lr = 1e-2', 'minLr = 1e-2', 'warmupSteps = 0',
    '[lora]', 'rank = 4', 'alpha = 8', 'targets = ["q_proj", "v_proj", "down_proj"]',
    '[checkpoint]', 'every = 2',
    '[log]', 'progress = "plain"', '',
  ].join('\n'));
  const run = join(root, 'e2e-run');
  const r = await flotilla(['train', toml, '--nproc', '2', `--train.runDir=${run}`, '--parallel.zero=2'], { timeoutMs: 240_000 });
  assert.equal(r.code, 0, `${r.out}\n${r.err}`);
  const peft = join(root, 'e2e-peft'), merged = join(root, 'e2e-merged');
  cli([run, peft, '--format', 'peft']);
  cli([run, merged, '--format', 'hf', '--merge']);
  const stored = loadSafetensors(join(peft, 'adapter_model.safetensors'));
  assert.equal(Object.keys(stored).length, 2 * 3 * 2);
  assert.ok(Object.entries(stored).every(([n, t]) => !n.includes('lora_B') || tidy(() => t.abs().max().item()) > 0), 'B trained away from zero');
  const withAdapter = await generate(base, { ...greedy('Call me'), adapter: peft });
  assert.equal(withAdapter[0]!.text, (await generate(merged, greedy('Call me')))[0]!.text);
  assert.equal(withAdapter[0]!.text, (await generate(run, greedy('Call me')))[0]!.text);

  // A second run continues the exported adapter under another layout (ZeRO-3 shards of each
  // adapter), at a learning rate too small to move a float32 value: its checkpoint holds the same tensors.
  const again = join(root, 'e2e-again');
  const r2 = await flotilla(['train', toml, '--nproc', '2', `--train.runDir=${again}`, '--parallel.zero=3', `--lora.adapter=${peft}`, '--train.steps=1', '--checkpoint.every=1', '--optim.lr=1e-30', '--optim.minLr=0'], { timeoutMs: 240_000 });
  assert.equal(r2.code, 0, `${r2.out}\n${r2.err}`);
  assert.match(r2.out, /adapters from .*e2e-peft/);
  const peft2 = join(root, 'e2e-peft-again');
  cli([again, peft2, '--format', 'peft']);
  const stored2 = loadSafetensors(join(peft2, 'adapter_model.safetensors'));
  for (const [n, t] of Object.entries(stored)) assert.deepEqual(stored2[n]!.toNumbers(), t.toNumbers(), n);

  // An adapter the run cannot continue is refused before any rank starts.
  const r3 = await flotilla(['train', toml, '--nproc', '2', `--train.runDir=${join(root, 'e2e-refused')}`, `--lora.adapter=${peft}`, '--lora.rank=2'], { timeoutMs: 120_000 });
  assert.notEqual(r3.code, 0);
  assert.match(`${r3.out}${r3.err}`, /has rank r = 4, and lora\.rank = 2: set lora\.rank = 4/);
  assert.doesNotMatch(`${r3.out}${r3.err}`, /\[model\]/, 'no rank started');

  // A base that changed since the adapters trained on it is named, not merged into or sampled with.
  writeFileSync(join(base, 'config.json'), `${readFileSync(join(base, 'config.json'), 'utf8')}\n`);
  assert.throws(() => cli([run, join(root, 'e2e-merged-changed'), '--format', 'hf', '--merge']), /the base changed since the checkpoint .* was saved: .*config\.json is \d+ bytes/);
  await assert.rejects(generate(run, greedy('Call me')), /the base changed since the checkpoint/);
});
