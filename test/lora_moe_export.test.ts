// A LoRA run on a Mixtral and on a Qwen3-MoE (adapters on attention Linears and on the experts'
// projections, [Note: LoRA on experts]) exported in one process (src/train/lora_export.ts):
// `--format hf --merge` merges each expert's adapter into its own slice of the stacks and writes the
// family's names in the base's dtype; loaded as a plain model it gives the adapted model's logits
// (float64).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { manualSeed, noGrad, randint, randn, setNumThreads, tensor, type Tensor } from '../src/tensor/index.js';
import { applyLora, expertLoraAdapters, loraAdapters } from '../src/nn/lora.js';
import { defaultMoEConfig } from '../src/nn/moe_config.js';
import { modelSpec } from '../src/models/registry.js';
import { placementsOf } from '../src/parallel/placement.js';
import { initProcessGroup, type ProcessGroup } from '../src/distributed/process_group.js';
import { Checkpointer } from '../src/checkpoint/checkpoint.js';
import { loadPretrained, readHfDir, savePretrained } from '../src/checkpoint/hf.js';
import { loadSafetensors } from '../src/checkpoint/safetensors.js';
import { loraHfNames } from '../src/checkpoint/peft.js';
import { exportCommand } from '../src/cli/checkpoint.js';
import { baseIdentity } from '../src/train/lora_run.js';
import { withFloat64 } from './oracle/check.js';

setNumThreads(1);
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
}

const MOE = { ...defaultMoEConfig, experts: 4, topK: 2, router: 'softmax', normTopK: true, capacityFactor: 0, auxCoeff: 0 };
export const MOE_CASES: Case[] = [
  {
    name: 'mixtral', architecture: 'MixtralForCausalLM',
    model: { arch: 'llama', family: 'llama', vocabSize: 64, blockSize: 16, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 16, intermediateSize: 12, moe: MOE },
    targets: ['q_proj', 'v_proj', 'w1', 'w2', 'w3'],
    moved: ['model.layers.0.self_attn.q_proj.weight', 'model.layers.1.block_sparse_moe.experts.3.w1.weight', 'model.layers.0.block_sparse_moe.experts.0.w2.weight', 'model.layers.1.block_sparse_moe.experts.2.w3.weight'],
    kept: 'model.layers.0.block_sparse_moe.gate.weight',
  },
  {
    // Layer 0 dense (decoder_sparse_step 2): gate_proj names its MLP's Linear and layer 1's experts.
    name: 'qwen3-moe', architecture: 'Qwen3MoeForCausalLM',
    model: { arch: 'llama', family: 'qwen3', qkNorm: true, vocabSize: 64, blockSize: 16, nLayer: 2, nHead: 2, nKvHead: 1, nEmbd: 16, headDim: 8, intermediateSize: 20, moe: { ...MOE, every: 2, hidden: 10, normTopK: false } },
    targets: ['o_proj', 'gate_proj', 'up_proj', 'down_proj'],
    moved: ['model.layers.1.self_attn.o_proj.weight', 'model.layers.0.mlp.gate_proj.weight', 'model.layers.1.mlp.experts.1.gate_proj.weight', 'model.layers.1.mlp.experts.3.down_proj.weight', 'model.layers.1.mlp.experts.0.up_proj.weight'],
    kept: 'model.layers.1.mlp.gate.weight',
  },
];
const LORA = { rank: 2, alpha: 6, dropout: 0, rsLora: false };

export interface MadeRun {
  base: string;
  run: string;
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
    return { base, run, adapters: new Map(adapters.map(([n, t]) => [n, t.toNumbers()])) };
  } finally {
    m.dispose();
  }
}

export function exportCli(args: string[]): string[] {
  const lines: string[] = [];
  assert.equal(exportCommand(args, (l) => lines.push(l)), 0);
  return lines;
}

const maxDiff = (a: Tensor, b: Tensor) => noGrad(() => a.sub(b).abs().max().item() as number);

for (const c of MOE_CASES) {
  test(`${c.name}: export --format hf --merge writes the family's names in the base's dtype, each expert's adapter merged into its own weight; loaded plain it gives the adapted model's logits (float64)`, async () => {
    const r = await makeMoeLoraRun(c, root, world);
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
      const x = randint(0, 64, [2, 12]);
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
