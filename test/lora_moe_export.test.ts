// A LoRA run on a Mixtral and on a Qwen3-MoE (adapters on attention Linears and on the experts'
// projections, [Note: LoRA on experts]) exported in one process (src/train/lora_export.ts):
// `--format hf --merge` merges each expert's adapter into its own slice of the stacks and writes the
// family's names in the base's dtype; loaded as a plain model it gives the adapted model's logits
// (float64). `--format peft` writes one lora_A and lora_B per expert under PEFT's names
// (`...block_sparse_moe.experts.E.w1`, `...mlp.experts.E.gate_proj`), which a reader of the test's own
// (test/oracle/peft_reader.py) merges into each expert's weight as --merge did; `generate BASE
// --adapter DIR` reads them back into the stacks, as does `[lora] adapter` into any range of a stack.
// End to end: `flotilla train --nproc 2` with expert parallelism from a Hugging Face Mixtral with
// expert targets, `export --format peft`, and `generate BASE --adapter DIR` samples what the run does.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { manualSeed, noGrad, randint, randn, setNumThreads, tensor, zeros, type Tensor } from '../src/tensor/index.js';
import { applyLora, expertLoraAdapters, loraAdapters } from '../src/nn/lora.js';
import { defaultMoEConfig } from '../src/nn/moe_config.js';
import { modelSpec } from '../src/models/registry.js';
import { placementsOf } from '../src/parallel/placement.js';
import { initProcessGroup, type ProcessGroup } from '../src/distributed/process_group.js';
import { Checkpointer } from '../src/checkpoint/checkpoint.js';
import { loadPretrained, readHfDir, savePretrained } from '../src/checkpoint/hf.js';
import { loadSafetensors } from '../src/checkpoint/safetensors.js';
import { attachPeftAdapter, checkPeftAdapter, loadPeftAdapter, loraHfNames } from '../src/checkpoint/peft.js';
import { exportCommand, generate } from '../src/cli/checkpoint.js';
import type { ParamPlacement } from '../src/parallel/placement.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';
import { flotilla } from './helpers/cli.js';
import { baseIdentity } from '../src/train/lora_run.js';
import { withFloat64 } from './oracle/check.js';

setNumThreads(1);
const skip = oracleMissing();
const root = mkdtempSync(join(tmpdir(), 'flotilla-lora-moe-export-'));
after(() => rmSync(root, { recursive: true, force: true }));
let world: ProcessGroup;
before(() => {
  world = initProcessGroup();
});

interface Case {
  name: string;
  architecture: string;
  model: Record<string, unknown>;
  targets: string[];
  /** Hugging Face weights an adapter moves, and one it leaves alone. */
  moved: string[];
  kept: string;
  /** PEFT's target_modules, and one expert's tensor with its shape. */
  peftTargets: string[];
  oneExpert: [string, number[]];
}

const MOE = { ...defaultMoEConfig, experts: 4, topK: 2, router: 'softmax', normTopK: true, capacityFactor: 0, auxCoeff: 0 };
export const MOE_CASES: Case[] = [
  {
    name: 'mixtral', architecture: 'MixtralForCausalLM',
    model: { arch: 'llama', family: 'llama', vocabSize: 128, blockSize: 16, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 16, intermediateSize: 12, moe: MOE },
    targets: ['q_proj', 'v_proj', 'w1', 'w2', 'w3'],
    moved: ['model.layers.0.self_attn.q_proj.weight', 'model.layers.1.block_sparse_moe.experts.3.w1.weight', 'model.layers.0.block_sparse_moe.experts.0.w2.weight', 'model.layers.1.block_sparse_moe.experts.2.w3.weight'],
    kept: 'model.layers.0.block_sparse_moe.gate.weight',
    peftTargets: ['q_proj', 'v_proj', 'w1', 'w2', 'w3'],
    oneExpert: ['base_model.model.model.layers.1.block_sparse_moe.experts.3.w2.lora_B.weight', [16, 2]],
  },
  {
    // Layer 0 dense (decoder_sparse_step 2): gate_proj names its MLP's Linear and layer 1's experts.
    name: 'qwen3-moe', architecture: 'Qwen3MoeForCausalLM',
    model: { arch: 'llama', family: 'qwen3', qkNorm: true, vocabSize: 128, blockSize: 16, nLayer: 2, nHead: 2, nKvHead: 1, nEmbd: 16, headDim: 8, intermediateSize: 20, moe: { ...MOE, every: 2, hidden: 10, normTopK: false } },
    targets: ['o_proj', 'gate_proj', 'up_proj', 'down_proj'],
    moved: ['model.layers.1.self_attn.o_proj.weight', 'model.layers.0.mlp.gate_proj.weight', 'model.layers.1.mlp.experts.1.gate_proj.weight', 'model.layers.1.mlp.experts.3.down_proj.weight', 'model.layers.1.mlp.experts.0.up_proj.weight'],
    kept: 'model.layers.1.mlp.gate.weight',
    peftTargets: ['down_proj', 'gate_proj', 'o_proj', 'up_proj'],
    oneExpert: ['base_model.model.model.layers.1.mlp.experts.2.down_proj.lora_A.weight', [2, 10]],
  },
];
const LORA = { rank: 2, alpha: 6, dropout: 0, rsLora: false };

export interface MadeRun {
  base: string;
  run: string;
  /** The base's [model] section with its moe. */
  model: Record<string, unknown>;
  /** The run's adapters by flotilla name, as saved. */
  adapters: Map<string, number[]>;
}

/**
 * A Hugging Face base of the case's model (random weights) and a LoRA run's checkpoint on it made
 * through the API: every adapter's B made nonzero, the adapters alone saved, with a meta.config that
 * says how the model was built.
 */
export async function makeMoeLoraRun(c: Case, dir: string, pg: ProcessGroup): Promise<MadeRun> {
  const spec = modelSpec('llama');
  const base = join(dir, `${c.name}-base`), run = join(dir, `${c.name}-run`);
  const b = spec.build(c.model, { initSeed: 3 });
  savePretrained(b, base);
  b.dispose();
  const { moe, ...model } = readHfDir(base).model as unknown as Record<string, Record<string, unknown>>;
  const m = spec.build({ ...model, moe }, { initSeed: 0 });
  try {
    const targets = c.targets;
    applyLora(m, { ...LORA, targets, hfNames: loraHfNames(spec, { ...model, moe }), initSeed: 11 });
    manualSeed(5);
    noGrad(() => {
      for (const [, a] of loraAdapters(m)) a.B.weight.copy_(randn(a.B.weight.shape).mul(0.3));
      for (const [, a] of expertLoraAdapters(m)) a.loraB.copy_(randn(a.loraB.shape).mul(0.3));
    });
    const adapters = m.namedParameters().filter(([, t]) => t.requiresGrad);
    const config = { model, moe: moe!, lora: { ...LORA, targets, baseDtype: 'fp32', adapter: '' }, train: { initFrom: base, seed: 11 }, data: { tokenizer: 'byte' } };
    await new Checkpointer({ dir: join(run, 'checkpoints'), keep: 1, async: false, world: pg }).save(3, { placements: placementsOf(adapters) }, { config, base: baseIdentity(base) });
    return { base, run, model: { ...model, moe }, adapters: new Map(adapters.map(([n, t]) => [n, t.toNumbers()])) };
  } finally {
    m.dispose();
  }
}

export function exportCli(args: string[]): string[] {
  const lines: string[] = [];
  assert.equal(exportCommand(args, (l) => lines.push(l)), 0);
  return lines;
}

const runs = new Map<string, Promise<MadeRun>>();
const setup = (c: Case): Promise<MadeRun> => {
  if (!runs.has(c.name)) runs.set(c.name, makeMoeLoraRun(c, root, world));
  return runs.get(c.name)!;
};

const maxDiff = (a: Tensor, b: Tensor) => noGrad(() => a.sub(b).abs().max().item() as number);

for (const c of MOE_CASES) {
  test(`${c.name}: export --format hf --merge writes the family's names in the base's dtype, each expert's adapter merged into its own weight; loaded plain it gives the adapted model's logits (float64)`, async () => {
    const r = await setup(c);
    assert.ok([...r.adapters.keys()].some((n) => /experts\.(gate|down)Lora\.loraA$/.test(n)), [...r.adapters.keys()].join(', '));
    const merged = join(root, `${c.name}-merged`);
    exportCli([r.run, merged, '--format', 'hf', '--merge']);
    const cfg = JSON.parse(readFileSync(join(merged, 'config.json'), 'utf8')) as Record<string, unknown>;
    assert.deepEqual(cfg.architectures, [c.architecture]);
    assert.equal(cfg.torch_dtype, 'float32');
    const mergedT = loadSafetensors(join(merged, 'model.safetensors'));
    const baseT = loadSafetensors(join(r.base, 'model.safetensors'));
    assert.deepEqual(Object.keys(mergedT).sort(), Object.keys(baseT).sort());
    for (const name of c.moved) {
      assert.equal(mergedT[name]!.dtype, 'float32', name);
      assert.ok(maxDiff(mergedT[name]!, baseT[name]!) > 1e-3, `${name}: the adapter did not move it`);
    }
    assert.equal(maxDiff(mergedT[c.kept]!, baseT[c.kept]!), 0, `${c.kept} has no adapter`);

    // The merged directory as a plain model against the run's model (base + adapters), in float64.
    withFloat64(() => {
      const x = randint(0, 128, [2, 12]);
      const plain = loadPretrained(merged, { dtype: 'float64' }).model;
      const baseModel = loadPretrained(r.base, { dtype: 'float64' }).model;
      // The adapted model: the base with the run's adapters, every value float64.
      const adapted = loadPretrained(r.base, { dtype: 'float64' }).model;
      applyLora(adapted, { ...LORA, targets: c.targets, hfNames: loraHfNames(modelSpec('llama'), c.model) });
      noGrad(() => {
        for (const [n, t] of adapted.namedParameters()) if (r.adapters.has(n)) t.copy_(tensor(r.adapters.get(n)!, { dtype: 'float64' }).reshape(t.shape));
      });
      assert.equal(adapted.namedParameters().filter(([n]) => r.adapters.has(n)).length, r.adapters.size);
      try {
        const [a, p, b] = noGrad(() => [adapted.call(x).logits, plain.call(x).logits, baseModel.call(x).logits] as Tensor[]);
        assert.equal(p!.dtype, 'float64');
        assert.ok(maxDiff(a!, b!) > 1e-2, 'the adapters change the logits');
        const err = maxDiff(a!, p!);
        assert.ok(err < 2e-5, `merged logits differ from the adapted model's by ${err}`); // the merged weights are float32
      } finally {
        for (const m of [plain, adapted, baseModel]) m.dispose();
      }
    });
  });
}

const greedy = (prompt: string) => ({ prompts: [prompt], tokens: 12, temperature: 0, topK: 0, topP: 1, seed: 1, ignoreEos: true });

for (const c of MOE_CASES) {
  test(`${c.name}: export --format peft writes a lora_A and lora_B per expert under PEFT's names, which the reader merges into each expert's weight as --merge did`, { skip }, async () => {
    const r = await setup(c);
    const peft = join(root, `${c.name}-peft`), merged = join(root, `${c.name}-merged-peft`);
    exportCli([r.run, peft, '--format', 'peft']);
    exportCli([r.run, merged, '--format', 'hf', '--merge']);
    const o = runOracle('peft_reader', {}, { adapter: peft, base: r.base });
    const config = JSON.parse(o.metadata.config!) as Record<string, unknown>;
    assert.deepEqual(config.target_modules, c.peftTargets);
    assert.deepEqual([config.r, config.lora_alpha], [LORA.rank, LORA.alpha]);
    const names = JSON.parse(o.metadata.names!) as Record<string, number[]>;
    assert.deepEqual(names[c.oneExpert[0]], c.oneExpert[1], c.oneExpert[0]);
    // Every stored A and B is the checkpoint's, bit for bit: a Linear's whole, a stack's slice j as expert j's.
    const hf = loraHfNames(modelSpec('llama'), r.model);
    const E = (r.model.moe as { experts: number }).experts;
    const experts = JSON.parse(o.metadata.experts!) as Record<string, number[]>;
    let modules = 0;
    for (const [name, values] of r.adapters) {
      const stack = /^(.+)Lora\.lora([AB])$/.exec(name), linear = /^(.+)\.lora([AB])\.weight$/.exec(name);
      const [path, which] = [(stack ?? linear)![1]!, (stack ?? linear)![2]!];
      const module = hf.get(path)!;
      if (linear) {
        assert.deepEqual(o.tensors[`${which}.${module}`]!.toNumbers(), values, name);
        modules += which === 'A' ? 1 : 0;
        continue;
      }
      assert.deepEqual(experts[module], [...Array(E).keys()], `${module}: every expert adapted`);
      const per = values.length / E;
      for (let j = 0; j < E; j++) {
        const t = o.tensors[`${which}.${module.replace(/\.experts\.(?=[^.]+$)/, `.experts.${j}.`)}`];
        assert.ok(t, `${name}: expert ${j} under its PEFT name`);
        assert.deepEqual(t.toNumbers(), values.slice(j * per, (j + 1) * per), `${name}: expert ${j}`);
      }
      modules += which === 'A' ? E : 0;
    }
    assert.equal(Object.keys(names).length, 2 * modules);
    // The reader's W + scale * B A of every module (each expert's its own) is what --merge wrote.
    const mergedT = loadSafetensors(join(merged, 'model.safetensors'));
    const mergedHere = Object.keys(o.tensors).filter((k) => k.startsWith('merged.'));
    assert.equal(mergedHere.length, modules);
    for (const k of mergedHere) {
      const name = k.slice('merged.'.length);
      const err = maxDiff(mergedT[name]!.to('float64'), o.tensors[k]!);
      assert.ok(err <= 1e-6, `${name}: --merge differs from the reader's W + scale * B A by ${err}`);
    }
    assert.ok(c.moved.every((n) => mergedHere.includes(`merged.${n}`)), mergedHere.join(', '));
  });

  test(`${c.name}: generate BASE --adapter DIR (expert adapters read back into the stacks) equals generate from the merged export and from the run; [lora] adapter reads any range of a stack`, async () => {
    const r = await setup(c);
    const peft = join(root, `${c.name}-peft-gen`), merged = join(root, `${c.name}-merged-gen`);
    exportCli([r.run, peft, '--format', 'peft']);
    exportCli([r.run, merged, '--format', 'hf', '--merge']);
    const withAdapter = await generate(r.base, { ...greedy('The whale'), adapter: peft });
    const fromMerged = await generate(merged, greedy('The whale'));
    const fromRun = await generate(r.run, greedy('The whale'));
    const baseAlone = await generate(r.base, greedy('The whale'));
    assert.equal(withAdapter[0]!.text, fromMerged[0]!.text);
    assert.equal(fromRun[0]!.text, fromMerged[0]!.text);
    assert.notEqual(baseAlone[0]!.text, withAdapter[0]!.text, 'the adapter changes what the base samples');

    // The adapter attached to the base: the expert adapters are stacks again, the logits the merged model's.
    const attached = loadPretrained(r.base).model, plain = loadPretrained(merged).model;
    try {
      attachPeftAdapter(attached, modelSpec('llama'), r.model, peft);
      assert.ok(expertLoraAdapters(attached).length >= 2, 'expert adapters attached');
      const x = randint(0, 128, [1, 10]);
      const err = maxDiff(noGrad(() => attached.call(x).logits), noGrad(() => plain.call(x).logits));
      assert.ok(err < 1e-4, `attached and merged logits differ by ${err}`);
    } finally {
      attached.dispose();
      plain.dispose();
    }

    // Uneven thirds of each stack (ZeRO-3 shards across experts; an expert-parallel rank's experts are a range too).
    const run = { model: r.model, lora: { ...LORA, targets: c.targets } };
    let loaded = 0;
    for (const [name, values] of r.adapters) {
      if (!/Lora\.lora[AB]$/.test(name)) continue;
      const n = values.length;
      const cuts = [0, Math.floor(n / 3) + 1, Math.floor((2 * n) / 3) - 1, n];
      const E = (r.model.moe as { experts: number }).experts;
      const one = name.endsWith('loraA') ? [LORA.rank, n / E / LORA.rank] : [n / E / LORA.rank, LORA.rank];
      for (let k = 0; k < 3; k++) {
        const held = { offset: cuts[k]!, numel: cuts[k + 1]! - cuts[k]! };
        const buf = zeros([held.numel]);
        const p: ParamPlacement = { name, param: buf, shape: [E, ...one], dtype: 'float32', held, stateHeld: held, writes: held, values: () => buf };
        loaded += loadPeftAdapter(peft, [p], run);
        assert.deepEqual(buf.toNumbers(), values.slice(held.offset, held.offset + held.numel), `${name}: range ${k}`);
        buf.dispose();
      }
    }
    assert.ok(loaded >= 6, `${loaded} ranges of stacks loaded`);
    // A base with more experts than the adapter has: the first expert it lacks, named.
    const moe = r.model.moe as Record<string, unknown>;
    assert.throws(() => checkPeftAdapter(peft, { ...r.model, moe: { ...moe, experts: 6 } }, run.lora), /has no 'base_model\.model\.model\.layers\.\d\.[a-z_]+\.experts\.4\.[a-z_0-9]+\.lora_A\.weight'.*another base model/);
  });
}

test('flotilla train --nproc 2 (ep = 2) with LoRA on a Hugging Face Mixtral\'s experts; export --format peft; generate BASE --adapter DIR gives the run\'s tokens', async () => {
  const c = MOE_CASES[0]!;
  const base = join(root, 'e2e-base');
  const b = modelSpec('llama').build({ ...c.model, vocabSize: 256 }, { initSeed: 9 });
  savePretrained(b, base);
  b.dispose();
  const toml = join(root, 'e2e.toml');
  // No [model]: it is the directory's (with its [moe]).
  writeFileSync(toml, [
    '[data]', 'tokenizer = "byte"', 'source = "moby-dick"', 'seqLen = 16', 'globalBatch = 4',
    '[train]', 'steps = 2', 'evalEvery = 0', `initFrom = ${JSON.stringify(base)}`,
    '[optim]', 'lr = 2e-2', 'minLr = 2e-2', 'warmupSteps = 0',
    '[lora]', 'rank = 2', 'alpha = 4', 'targets = ["q_proj", "w1", "w2", "w3"]',
    '[checkpoint]', 'every = 2',
    '[log]', 'progress = "plain"', '',
  ].join('\n'));
  const run = join(root, 'e2e-run');
  const r = await flotilla(['train', toml, '--nproc', '2', `--train.runDir=${run}`, '--parallel.ep=2'], { timeoutMs: 240_000 });
  assert.equal(r.code, 0, `${r.out}\n${r.err}`);
  const peft = join(root, 'e2e-peft');
  exportCli([run, peft, '--format', 'peft']);
  const stored = loadSafetensors(join(peft, 'adapter_model.safetensors'));
  const experts = Object.keys(stored).filter((n) => /\.block_sparse_moe\.experts\.\d\.w[123]\.lora_B\.weight$/.test(n));
  assert.equal(experts.length, 2 * 4 * 3, Object.keys(stored).join(', ')); // layers x experts x projections
  assert.ok(experts.some((n) => noGrad(() => stored[n]!.abs().max().item() as number) > 0), 'the experts\' B trained away from zero');
  const withAdapter = await generate(base, { ...greedy('Call me'), adapter: peft });
  assert.equal(withAdapter[0]!.text, (await generate(run, greedy('Call me')))[0]!.text);
});
