// Hugging Face directories under layouts: a rank holding a range of a parameter (ZeRO-3) or a
// tensor-parallel slice of it (fused q/k/v chunks, row-parallel columns, GPT-2's transposed Conv1D)
// reads exactly those elements; train.initFrom refuses a run whose [model] is not the directory's,
// naming the fields; `flotilla train --nproc 2` under ZeRO-3 fine-tunes from a directory (at a
// learning rate too small to move a float32 weight, so the checkpoint it saves must hold the
// directory's weights bit for bit), and `flotilla export --format hf` of that checkpoint loads back
// through loadPretrained with the same parameters and logits and samples with its tokenizer.json.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { type Tensor, cat, noGrad, setNumThreads, tensor, tidy, zeros } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { Llama } from '../src/models/llama.js';
import { loadPretrained, savePretrained, readHfDir, loadHfWeights } from '../src/checkpoint/hf.js';
import type { ParamPlacement } from '../src/parallel/placement.js';
import { placementsOf } from '../src/parallel/placement.js';
import { initFrom } from '../src/train/checkpointing.js';
import { exportCommand, generate } from '../src/cli/checkpoint.js';
import { flotilla, ROOT } from './helpers/cli.js';
import { assertSameParameters } from './oracle/hf_oracle.js';

setNumThreads(1);
const root = mkdtempSync(join(tmpdir(), 'flotilla-hf-train-'));
after(() => rmSync(root, { recursive: true, force: true }));

/** The slice `index` of `parts` along dim of a tensor fusing `chunks` outputs there (a part of each chunk). */
function tpSlice(whole: Tensor, dim: number, chunks: number, parts: number, index: number): Tensor {
  const S = whole.shape[dim]! / chunks, P = S / parts;
  return cat(Array.from({ length: chunks }, (_, k) => whole.narrow(dim, k * S + index * P, P)), dim);
}

/** Every way a rank may hold a parameter here: ranges of it, a tp slice, and ranges of a tp slice. */
function checkPartialReads(dir: string, tpDims: Record<string, { dim: number; chunks: number }>): void {
  const { model } = loadPretrained(dir);
  const h = readHfDir(dir);
  let checked = 0;
  try {
    for (const [name, whole] of model.namedParameters()) {
      const n = whole.numel();
      // ZeRO-3: three uneven ranges of the flattened parameter.
      const cuts = [0, Math.floor(n / 3) + 1, Math.floor((2 * n) / 3) - 1, n];
      for (let r = 0; r < 3; r++) {
        const held = { offset: cuts[r]!, numel: cuts[r + 1]! - cuts[r]! };
        const buf = zeros([held.numel]);
        const p: ParamPlacement = { name, param: buf, shape: whole.shape, dtype: 'float32', held, stateHeld: held, writes: held, values: () => buf };
        loadHfWeights(h, [p]);
        assert.deepEqual(buf.toNumbers(), tidy(() => whole.reshape(-1).narrow(0, held.offset, held.numel).toNumbers()), `${name}: range ${r}`);
        buf.dispose();
        checked++;
      }
      const tp = tpDims[name.replace(/^layers\.\d+\./, '')];
      if (!tp) continue;
      for (let index = 0; index < 2; index++) {
        const want: Tensor = tidy(() => tpSlice(whole, tp.dim, tp.chunks, 2, index).contiguous());
        const local = zeros(want.shape);
        const m = local.numel();
        // The whole slice, and the second half of it (ZeRO-3 over a tp slice).
        for (const held of [{ offset: 0, numel: m }, { offset: Math.floor(m / 2) - 3, numel: m - Math.floor(m / 2) + 3 }]) {
          noGrad(() => local.zero_());
          const p: ParamPlacement = {
            name, param: local, shape: whole.shape, dtype: 'float32', held, stateHeld: held, writes: held,
            values: () => local.view(-1).narrow(0, held.offset, held.numel), tp: { dim: tp.dim, chunks: tp.chunks, parts: 2, index },
          };
          loadHfWeights(h, [p]);
          assert.deepEqual(tidy((): number[] => local.view(-1).narrow(0, held.offset, held.numel).toNumbers()), tidy((): number[] => want.view(-1).narrow(0, held.offset, held.numel).toNumbers()), `${name}: tp slice ${index} of 2, elements from ${held.offset}`);
          checked++;
        }
        local.dispose();
        want.dispose();
      }
    }
  } finally {
    model.dispose();
  }
  assert.ok(checked > 20);
}

test('a rank reads exactly the elements it holds: ranges, tensor-parallel slices of fused and transposed weights, ranges of slices', () => {
  const gpt = new GPT({ vocabSize: 38, blockSize: 12, nLayer: 1, nHead: 2, nEmbd: 12, gelu: 'tanh' }, { initSeed: 5 });
  const gDir = join(root, 'gpt');
  savePretrained(gpt, gDir);
  gpt.dispose();
  // GPT-2 stores these transposed ([in, out]): a slice of rows is a block of columns on disk.
  checkPartialReads(gDir, {
    'attn.qkv.weight': { dim: 0, chunks: 3 }, 'attn.qkv.bias': { dim: 0, chunks: 3 }, 'attn.proj.weight': { dim: 1, chunks: 1 },
    'mlp.fc.weight': { dim: 0, chunks: 1 }, 'mlp.proj.weight': { dim: 1, chunks: 1 }, 'wte.weight': { dim: 0, chunks: 1 },
  });
  const llama = new Llama({ vocabSize: 38, blockSize: 12, nLayer: 1, nHead: 4, nKvHead: 2, nEmbd: 16, headDim: 6, intermediateSize: 20 }, { initSeed: 6 });
  const lDir = join(root, 'llama');
  savePretrained(llama, lDir);
  llama.dispose();
  checkPartialReads(lDir, {
    'attn.q.weight': { dim: 0, chunks: 1 }, 'attn.k.weight': { dim: 0, chunks: 1 }, 'attn.o.weight': { dim: 1, chunks: 1 },
    'mlp.gate.weight': { dim: 0, chunks: 1 }, 'mlp.down.weight': { dim: 1, chunks: 1 }, 'head.weight': { dim: 0, chunks: 1 },
  });
});

test('train.initFrom of a directory whose model is not the run\'s is one error naming each field and the section to set', () => {
  const cfg = { arch: 'llama', vocabSize: 37, blockSize: 12, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 16, headDim: 0, intermediateSize: 20, rmsNormEps: 1e-5, ropeTheta: 10000, ropeScaling: 'none', tieEmbeddings: false, dropout: 0 };
  const m = new Llama(cfg as never, { initSeed: 7 });
  const dir = join(root, 'llama-init');
  savePretrained(m, dir);
  const placements = placementsOf(m.namedParameters());
  const before = m.namedParameters().map(([, p]) => p.toNumbers());
  // The same model with derived fields left at 0 is the directory's model (headDim 16 / 4 = 4).
  initFrom(dir, placements, m.numParams(), { ...cfg, headDim: 0, nKvHead: 2 });
  assert.throws(
    () => initFrom(dir, placements, m.numParams(), { ...cfg, nLayer: 3, ropeTheta: 500000 }),
    (e: Error) => /model\.nLayer is 3 here and 2 in config\.json; model\.ropeTheta is 500000 here and 10000 in config\.json/.test(e.message) && /\[model\]\narch = "llama"\nvocabSize = 37\n/.test(e.message) && /nLayer = 2/.test(e.message),
  );
  assert.throws(() => initFrom(dir, placements, m.numParams(), { ...cfg, arch: 'gpt' }), /model\.arch is "gpt" here, the directory holds a LlamaForCausalLM \(arch "llama"\)/);
  assert.deepEqual(m.namedParameters().map(([, p]) => p.toNumbers()), before, 'a refused initFrom changes nothing');
  m.dispose();
});

test('flotilla train --nproc 2 under ZeRO-3 fine-tunes from a Hugging Face directory; export --format hf of its checkpoint loads back with the same weights and logits, and generate uses its tokenizer.json', async () => {
  const tokenizer = join(ROOT, 'examples', 'moby-dick-bpe512.json');
  const src = new Llama({ vocabSize: 512, blockSize: 32, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 64, ropeTheta: 500000, ropeScaling: 'llama3', ropeOriginalMaxPositions: 16 }, { initSeed: 8 });
  const hfDir = join(root, 'base');
  savePretrained(src, hfDir, { tokenizer, maxShardSize: '40KB' });
  assert.ok(readdirSync(hfDir).includes('model.safetensors.index.json'));
  assert.ok(readdirSync(hfDir).includes('tokenizer.json'));
  src.dispose();

  const run = join(root, 'run');
  const r = await flotilla([
    'train', join(ROOT, 'examples', 'llama-tiny.toml'), '--nproc', '2', `--train.runDir=${run}`, `--train.initFrom=${hfDir}`,
    '--model.blockSize=32', '--model.nLayer=2', '--model.nEmbd=32', '--model.intermediateSize=64', '--model.ropeTheta=500000',
    '--model.ropeScaling=llama3', '--model.ropeOriginalMaxPositions=16', '--data.seqLen=32', '--data.globalBatch=4',
    '--parallel.zero=3', '--train.steps=1', '--train.evalEvery=0', '--optim.lr=1e-30', '--optim.minLr=0', '--optim.warmupSteps=0', '--checkpoint.every=1', '--log.progress=plain',
  ], { timeoutMs: 240_000 });
  assert.equal(r.code, 0, `${r.out}\n${r.err}`);
  assert.match(r.out, /\[init\] weights from .*base; step 0/);

  const out = join(root, 'exported');
  const lines: string[] = [];
  assert.equal(exportCommand([run, out, '--format', 'hf', '--max-shard-size=30KB'], (l) => lines.push(l)), 0);
  assert.match(lines[0]!, /exported step 1 as a Hugging Face LlamaForCausalLM: 21 tensors .* in \d+ file\(s\)/);
  assert.ok(readdirSync(out).includes('tokenizer.json'), 'the run\'s tokenizer.json goes with it');
  const a = loadPretrained(hfDir), b = loadPretrained(out);
  assertSameParameters(a.model, b.model, 'initFrom under ZeRO-3, then export');
  const ids = tensor(Int32Array.from([5, 300, 17, 42, 511, 2]), { shape: [1, 6], dtype: 'int64' });
  assert.deepEqual(b.model.call(ids).logits.toNumbers(), a.model.call(ids).logits.toNumbers());
  a.model.dispose();
  b.model.dispose();

  // An existing non-empty directory is refused, and left as it was.
  const taken = join(root, 'taken');
  mkdirSync(taken);
  writeFileSync(join(taken, 'x'), 'x');
  assert.throws(() => exportCommand([run, taken, '--format', 'hf'], () => undefined), /exists and is not empty; choose a new directory \(nothing was written\)/);
  assert.deepEqual(readdirSync(taken), ['x']);
  assert.throws(() => exportCommand([run, join(root, 'y'), '--format', 'hf', '--dtype', 'int8'], () => undefined), /--dtype "int8" is not bf16, fp32 or fp16/);

  // Sampling from the directory (its tokenizer.json) is sampling from the run's checkpoint.
  const o = { prompts: ['Call me Ishmael. '], tokens: 12, temperature: 0.8, topK: 40, topP: 1, seed: 3, ignoreEos: false };
  assert.deepEqual(await generate(out, o), await generate(run, o));
});
