// Hugging Face MixtralForCausalLM directories both ways, as the Llama with [moe], against an independent
// PyTorch forward of transformers' Mixtral written from the model description (test/oracle/hf_mixtral.py):
// a router whose softmax picks the top experts and renormalises their weights to sum 1, SwiGLU experts
// stored one Linear each and held as grouped stacks. An untied head in float32 shards with an index, and a
// tied head in bfloat16 with the defaults left out: logits equal the reference's to float64 rounding, 20
// greedy tokens agree with and without the key/value cache; what savePretrained writes the reference reads
// strictly with the same logits, and it loads back bit-identically; likewise a Mixtral with a sliding window.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { noGrad, setNumThreads, tidy, zeros } from '../src/tensor/index.js';
import { loadPretrained, savePretrained, readHfDir, loadHfWeights } from '../src/checkpoint/hf.js';
import { exportCommand } from '../src/cli/checkpoint.js';
import { initFrom } from '../src/train/checkpointing.js';
import { initFromModel } from '../src/config/init_from.js';
import { placementsOf } from '../src/parallel/placement.js';
import { flotilla, ROOT } from './helpers/cli.js';
import { Llama } from '../src/models/llama.js';
import { MoE } from '../src/nn/moe.js';
import { oracleMissing } from './oracle/oracle.js';
import { assertSameParameters, checkAgainst, hfReference, type HfRef, decodedBothWays, withConfigPatch } from './oracle/hf_oracle.js';

setNumThreads(1);
const skip = oracleMissing();
const root = mkdtempSync(join(tmpdir(), 'flotilla-hf-mixtral-'));
after(() => rmSync(root, { recursive: true, force: true }));

export const MIXTRAL = {
  architectures: ['MixtralForCausalLM'], model_type: 'mixtral', vocab_size: 61, hidden_size: 32, intermediate_size: 24,
  num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 48,
  rms_norm_eps: 1e-5, rope_theta: 10000.0, hidden_act: 'silu', tie_word_embeddings: false, sliding_window: null,
  num_local_experts: 4, num_experts_per_tok: 2, output_router_logits: false, router_aux_loss_coef: 0.02,
};
// Defaults left out (8 key/value heads of the default would not divide 3 heads: set), a tied head, 3 of 5 experts.
const TIED = {
  architectures: ['MixtralForCausalLM'], model_type: 'mixtral', vocab_size: 61, hidden_size: 24, intermediate_size: 16,
  num_hidden_layers: 1, num_attention_heads: 3, num_key_value_heads: 3, max_position_embeddings: 40, tie_word_embeddings: true,
  num_local_experts: 5, num_experts_per_tok: 3,
};
// Mistral's sliding window (4 of the 13 tokens) in every layer, read as model.family = "mistral".
const WINDOWED = { ...TIED, num_hidden_layers: 2, tie_word_embeddings: false, sliding_window: 4 };
const dirs = { untied: join(root, 'untied-f32-sharded'), tied: join(root, 'tied-bf16'), windowed: join(root, 'windowed-f32') };
let refs: Record<keyof typeof dirs, HfRef> | undefined;

function made(): Record<keyof typeof dirs, HfRef> {
  if (refs) return refs;
  const [untied, tied, windowed] = hfReference([
    { mode: 'make', dir: dirs.untied, config: MIXTRAL, seed: 21, dtype: 'float32', maxShardBytes: 8_000 },
    { mode: 'make', dir: dirs.tied, config: TIED, seed: 22, dtype: 'bfloat16' },
    { mode: 'make', dir: dirs.windowed, config: WINDOWED, seed: 23, dtype: 'float32' },
  ], 'hf_mixtral') as [HfRef, HfRef, HfRef];
  refs = { untied, tied, windowed };
  return refs;
}

test('Mixtral directories the reference writes load as the Llama with [moe], with its logits to float64 rounding and its greedy tokens, cached or not', { skip }, () => {
  const r = made();
  assert.ok(readdirSync(dirs.untied).filter((f) => /^model-\d{5}-of-\d{5}\.safetensors$/.test(f)).length > 2);
  const { model, config } = loadPretrained(dirs.untied);
  assert.ok(model instanceof Llama);
  const moe = (config as unknown as { moe: Record<string, unknown> }).moe;
  assert.deepEqual([config.arch, config.nKvHead, config.intermediateSize, moe.experts, moe.topK, moe.normTopK, moe.every, moe.capacityFactor], ['llama', 2, 24, 4, 2, true, 1, 0]);
  const mlps = model.namedModules().filter(([, m]) => m instanceof MoE);
  assert.equal(mlps.length, 2);
  model.dispose();
  checkAgainst(dirs.untied, r.untied);
  checkAgainst(dirs.tied, r.tied);
  checkAgainst(dirs.windowed, r.windowed);
  const w = loadPretrained(dirs.windowed);
  assert.deepEqual([w.config.family, w.config.slidingWindow, w.config.windowFrom], ['mistral', 4, 0]);
  w.model.dispose();
  for (const [k, d] of Object.entries(dirs)) {
    const [cached, plain] = decodedBothWays(d);
    assert.deepEqual(cached, r[k as keyof typeof dirs].greedy, `${k}: cached decoding`);
    assert.deepEqual(plain, r[k as keyof typeof dirs].greedy, `${k}: uncached decoding`);
  }
});

test('savePretrained writes a Llama with [moe] as a MixtralForCausalLM (one Linear per expert) and loads back bit-identically', { skip }, () => {
  const r = made();
  const a = loadPretrained(dirs.untied);
  const outA = join(root, 'out-untied');
  const wa = savePretrained(a.model, outA, { maxShardSize: 6_000 });
  assert.ok(wa.files.length > 2);
  assert.equal(wa.architecture, 'MixtralForCausalLM');
  const cfg = JSON.parse(readFileSync(join(outA, 'config.json'), 'utf8')) as Record<string, unknown>;
  assert.deepEqual([cfg.model_type, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, cfg.sliding_window], ['mixtral', 4, 2, 24, null]);
  // As train.initFrom, the directory gives a run its [model] and [moe] before any rank starts.
  const from = initFromModel(outA)!;
  assert.match(from.what, /MixtralForCausalLM/);
  assert.equal(from.sections.model!.arch, 'llama');
  assert.deepEqual([from.sections.moe!.experts, from.sections.moe!.topK, from.sections.moe!.normTopK], [4, 2, true]);
  assert.deepEqual([...readHfDir(outA).stored.keys()].filter((k) => k.startsWith('model.layers.1.block_sparse_moe.')).sort(), [
    'model.layers.1.block_sparse_moe.experts.0.w1.weight', 'model.layers.1.block_sparse_moe.experts.0.w2.weight', 'model.layers.1.block_sparse_moe.experts.0.w3.weight',
    'model.layers.1.block_sparse_moe.experts.1.w1.weight', 'model.layers.1.block_sparse_moe.experts.1.w2.weight', 'model.layers.1.block_sparse_moe.experts.1.w3.weight',
    'model.layers.1.block_sparse_moe.experts.2.w1.weight', 'model.layers.1.block_sparse_moe.experts.2.w2.weight', 'model.layers.1.block_sparse_moe.experts.2.w3.weight',
    'model.layers.1.block_sparse_moe.experts.3.w1.weight', 'model.layers.1.block_sparse_moe.experts.3.w2.weight', 'model.layers.1.block_sparse_moe.experts.3.w3.weight',
    'model.layers.1.block_sparse_moe.gate.weight',
  ]);
  assertSameParameters(a.model, loadPretrained(outA).model, 'float32 round trip');

  const b = loadPretrained(dirs.tied, { dtype: 'float64' });
  const outB = join(root, 'out-tied');
  savePretrained(b.model, outB, { dtype: 'bfloat16' });
  assert.deepEqual(readdirSync(outB).sort(), ['config.json', 'model.safetensors']);
  assert.ok(!readHfDir(outB).stored.has('lm_head.weight'), 'a tied head is not written');
  assertSameParameters(b.model, loadPretrained(outB, { dtype: 'float64' }).model, 'bfloat16 round trip');
  a.model.dispose();
  b.model.dispose();

  const c = loadPretrained(dirs.windowed);
  const outC = join(root, 'out-windowed');
  assert.equal(savePretrained(c.model, outC).architecture, 'MixtralForCausalLM');
  assert.equal((JSON.parse(readFileSync(join(outC, 'config.json'), 'utf8')) as Record<string, unknown>).sliding_window, 4);
  assertSameParameters(c.model, loadPretrained(outC).model, 'windowed round trip');
  c.model.dispose();

  const [ra, rb, rc] = hfReference([{ mode: 'read', dir: outA }, { mode: 'read', dir: outB }, { mode: 'read', dir: outC }], 'hf_mixtral') as [HfRef, HfRef, HfRef];
  assert.deepEqual(ra.greedy, r.untied.greedy);
  assert.deepEqual(rb.greedy, r.tied.greedy);
  assert.deepEqual(rc.greedy, r.windowed.greedy);
  checkAgainst(outA, r.untied);
  checkAgainst(outB, r.tied);
  checkAgainst(outC, r.windowed);
});

test('a Mixtral flotilla cannot read or write exactly is one error naming the field', { skip }, () => {
  made();
  const cfgPath = join(dirs.tied, 'config.json');
  const withCfg = (patch: Record<string, unknown>, re: RegExp) => withConfigPatch(cfgPath, patch, () => assert.throws(() => loadPretrained(dirs.tied), re));
  withCfg({ sliding_window: 0 }, /sliding_window = 0 is not a positive integer or null \(null = full causal attention\)/);
  withCfg({ router_jitter_noise: 0.1 }, /router_jitter_noise = 0\.1 is not supported/);
  withCfg({ num_local_experts: 4 }, /tensor 'model\.layers\.0\.block_sparse_moe\.gate\.weight' is \[5, 24\], but config\.json implies \[4, 24\]/);
  withCfg({ num_experts_per_tok: 6 }, /num_experts_per_tok = 6 is above num_local_experts = 5/);
  // A run without the directory's [moe] is refused naming the fields and the section to set.
  const t = loadPretrained(dirs.tied);
  const { moe: _moe, ...dense } = t.config as unknown as Record<string, unknown>;
  try {
    assert.throws(() => initFrom(dirs.tied, placementsOf(t.model.namedParameters()), t.model.numParams(), dense),
      /moe\.experts is 0 here and 5 for config\.json; moe\.topK is 1 here and 3 for config\.json; moe\.normTopK is false here and true for config\.json\..*\[moe\]\nexperts = 5\ntopK = 3/s);
  } finally {
    t.model.dispose();
  }
  const m = new Llama({ vocabSize: 61, blockSize: 16, nLayer: 1, nHead: 2, nEmbd: 16, intermediateSize: 8, moe: { experts: 2, topK: 1 } as never });
  try {
    assert.throws(() => savePretrained(m, join(root, 'never')), /no Hugging Face form \(LlamaForCausalLM: it has no experts.*MixtralForCausalLM: its routing needs moe\.normTopK = true/);
    assert.ok(!readdirSync(root).includes('never'));
  } finally {
    m.dispose();
  }
});

test('a rank reads exactly the experts and ranges it holds of a stack: ZeRO-3 ranges across experts, an expert-parallel slice, a range of it', { skip }, () => {
  made();
  const { model } = loadPretrained(dirs.untied);
  const h = readHfDir(dirs.untied);
  let checked = 0;
  try {
    for (const [name, whole] of model.namedParameters().filter(([n]) => n.includes('.mlp.'))) {
      const n = whole.numel();
      const cuts = [0, Math.floor(n / 3) + 1, Math.floor((2 * n) / 3) - 1, n]; // uneven, crossing expert boundaries
      for (let r = 0; r < 3; r++) {
        const held = { offset: cuts[r]!, numel: cuts[r + 1]! - cuts[r]! };
        const buf = zeros([held.numel]);
        loadHfWeights(h, [{ name, param: buf, shape: whole.shape, dtype: 'float32', held, stateHeld: held, writes: held, values: () => buf }]);
        assert.deepEqual(buf.toNumbers(), tidy(() => whole.reshape(-1).narrow(0, held.offset, held.numel).toNumbers()), `${name}: range ${r}`);
        buf.dispose();
        checked++;
      }
      if (!name.includes('.experts.')) continue;
      for (let index = 0; index < 2; index++) { // ep = 2: experts [2 index, 2 index + 2), whole and from its middle
        const want = tidy(() => whole.narrow(0, 2 * index, 2).contiguous());
        const local = zeros(want.shape), m = local.numel();
        for (const held of [{ offset: 0, numel: m }, { offset: Math.floor(m / 2) - 5, numel: m - Math.floor(m / 2) + 5 }]) {
          noGrad(() => local.zero_());
          loadHfWeights(h, [{
            name, param: local, shape: whole.shape, dtype: 'float32', held, stateHeld: held, writes: held,
            values: () => local.view(-1).narrow(0, held.offset, held.numel), tp: { dim: 0, chunks: 1, parts: 2, index },
          }]);
          assert.deepEqual(tidy((): number[] => local.view(-1).narrow(0, held.offset, held.numel).toNumbers()), tidy((): number[] => want.view(-1).narrow(0, held.offset, held.numel).toNumbers()), `${name}: experts of ep rank ${index}`);
          checked++;
        }
        local.dispose();
        want.dispose();
      }
    }
  } finally {
    model.dispose();
  }
  assert.equal(checked, 2 * (3 * 4 + 3 * 2 * 2));
});

test('flotilla train --nproc 2 with expert parallelism (ep = 2) under ZeRO-3 starts from a Mixtral directory; export --format hf of its checkpoint is that Mixtral', { skip }, async () => {
  const tokenizer = join(ROOT, 'examples', 'moby-dick-bpe512.json');
  const moe = { experts: 4, topK: 2, normTopK: true };
  const src = new Llama({ vocabSize: 512, blockSize: 32, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 16, ropeTheta: 500000, moe: moe as never }, { initSeed: 8 });
  const hfDir = join(root, 'base');
  savePretrained(src, hfDir, { tokenizer, maxShardSize: '40KB' });
  src.dispose();
  // The same run in one process and on 2 ranks (dp 2 sharded by ZeRO-3, experts split by ep = 2).
  const train = async (name: string, layout: string[]) => {
    const dir = join(root, name);
    const r = await flotilla([
      'train', join(ROOT, 'examples', 'llama-tiny.toml'), ...layout, `--train.runDir=${dir}`, `--train.initFrom=${hfDir}`,
      '--model.blockSize=32', '--model.nLayer=2', '--model.nEmbd=32', '--model.intermediateSize=16', '--model.ropeTheta=500000',
      '--moe.experts=4', '--moe.topK=2', '--moe.normTopK=true', '--data.seqLen=32', '--data.globalBatch=4', '--data.microBatches=2',
      '--train.steps=2', '--train.evalEvery=0', '--optim.lr=1e-30', '--optim.minLr=0', '--optim.warmupSteps=0', '--checkpoint.every=2', '--log.progress=plain',
    ], { timeoutMs: 240_000 });
    assert.equal(r.code, 0, `${r.out}\n${r.err}`);
    return readFileSync(join(dir, 'metrics.jsonl'), 'utf8').trim().split('\n').map((l) => JSON.parse(l) as { loss?: number }).filter((m) => m.loss !== undefined).map((m) => m.loss!);
  };
  const one = await train('one', ['--nproc', '1']);
  const two = await train('run', ['--nproc', '2', '--parallel.ep=2', '--parallel.zero=3', '--data.microBatches=1']);
  assert.equal(one.length, 2);
  assert.equal(two.length, 2);
  two.forEach((l, i) => assert.ok(Math.abs(l - one[i]!) <= 1e-5 * Math.abs(one[i]!), `step ${i + 1}: loss ${l} on 2 ranks, ${one[i]} in one process`));
  const run = join(root, 'run');
  const out = join(root, 'exported');
  const lines: string[] = [];
  assert.equal(exportCommand([run, out, '--format', 'hf'], (l) => lines.push(l)), 0);
  assert.match(lines[0]!, /as a Hugging Face MixtralForCausalLM/);
  const a = loadPretrained(hfDir), b = loadPretrained(out);
  assertSameParameters(a.model, b.model, 'initFrom under ep = 2 and ZeRO-3, then export');
  a.model.dispose();
  b.model.dispose();
});
