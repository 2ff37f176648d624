// `flotilla verify` for the Hugging Face families that are the Llama with options (issue 53): for
// each, a tiny model written by savePretrained as its own class (Qwen3ForCausalLM with q/k norms and
// attention biases, MistralForCausalLM with a window shorter than the sequence,
// MixtralForCausalLM, Qwen3MoeForCausalLM) is train.initFrom of a config with no [model] section,
// so that the model, and [moe], come from its config.json alone; one verify per family (its layouts
// joined by --and) trains it like one process under the layouts that touch what the family adds:
// q/k norms and biases under ZeRO-3, pp, tp with sequence parallelism, cp and bf16-mixed with
// selective activation checkpointing; Qwen2's q/k/v biases under ZeRO-3 and pp; the sliding
// window under cp's ring, tp and full activation checkpointing; experts under ep, alone, with
// ZeRO-1/3 and with bf16-mixed and full activation checkpointing.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setNumThreads } from '../src/tensor/index.js';
import { Llama } from '../src/models/llama.js';
import { savePretrained } from '../src/checkpoint/hf.js';
import { flotilla, verifyBlock, ROOT } from './helpers/cli.js';
import { pool, started } from './helpers/pool.js';

setNumThreads(1);
const root = mkdtempSync(join(tmpdir(), 'flotilla-families-verify-'));
after(() => rmSync(root, { recursive: true, force: true }));

const tokenizer = join(ROOT, 'examples', 'moby-dick-bpe512.json');
// examples/llama-tiny.toml without its [model] section (and its tokenizer named absolutely).
const config = join(root, 'no-model.toml');
{
  const text = readFileSync(join(ROOT, 'examples', 'llama-tiny.toml'), 'utf8');
  const noModel = text.replace(/^\[model\]\n[\s\S]*?(?=^\[)/m, '').replace(/^tokenizer = .*$/m, `tokenizer = ${JSON.stringify(tokenizer)}`);
  assert.ok(!/^\[model\]/m.test(noModel) && noModel.includes(tokenizer));
  writeFileSync(config, noModel);
}

const base = { vocabSize: 512, blockSize: 32, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 32, intermediateSize: 32 };
// Each layout: [what, its overrides, what its block's first line shows of it].
// nproc: the ranks of its launch (2 unless set).
const FAMILIES: { name: string; model: Record<string, unknown>; arch: string; nproc?: number; layouts: [string, string[], string][] }[] = [
  {
    name: 'Qwen3', arch: 'Qwen3ForCausalLM', model: { family: 'qwen3', qkNorm: true, attnBias: 'all' },
    layouts: [
      ['ZeRO-3', ['--parallel.zero=3'], 'zero 3'],
      ['pp = 2', ['--parallel.zero=0', '--parallel.pp=2', '--data.microBatches=2'], 'pp 2'],
      ['tp = 2 with sequence parallelism', ['--parallel.zero=0', '--parallel.tp=2', '--parallel.sequenceParallel=true'], 'tp 2'],
      ['cp = 2', ['--parallel.zero=0', '--parallel.cp=2'], 'cp 2'],
      ['dp = 2, bf16-mixed, selective activation checkpointing', ['--parallel.zero=0', '--train.precision=bf16-mixed', '--train.activationCheckpoint=selective'], 'zero 0'],
    ],
  },
  {
    name: 'Qwen2', arch: 'Qwen2ForCausalLM', model: { family: 'qwen2', attnBias: 'qkv' },
    layouts: [
      ['ZeRO-3', ['--parallel.zero=3'], 'zero 3'],
      ['pp = 2', ['--parallel.zero=0', '--parallel.pp=2', '--data.microBatches=2'], 'pp 2'],
    ],
  },
  {
    // A window of 8 positions in sequences of 32: under cp = 2 it reaches across the ring's halves.
    name: 'Mistral', arch: 'MistralForCausalLM', model: { family: 'mistral', slidingWindow: 8 },
    layouts: [
      ['dp = 2, full activation checkpointing', ['--train.activationCheckpoint=full'], 'zero 0'],
      ['cp = 2', ['--train.activationCheckpoint=none', '--parallel.cp=2'], 'cp 2'],
      ['tp = 2', ['--train.activationCheckpoint=none', '--parallel.tp=2'], 'tp 2'],
    ],
  },
  {
    name: 'Mixtral', arch: 'MixtralForCausalLM', model: { moe: { experts: 4, topK: 2, normTopK: true } },
    layouts: [
      ['ep = 2', ['--parallel.ep=2'], 'ep 2'],
      ['ZeRO-3 with ep = 2', ['--parallel.ep=2', '--parallel.zero=3'], 'zero 3, .*ep 2'],
      ['pp = 2', ['--parallel.ep=1', '--parallel.pp=2', '--data.microBatches=2'], 'pp 2'],
      ['ep = 2, bf16-mixed, full activation checkpointing', ['--train.precision=bf16-mixed', '--train.activationCheckpoint=full'], 'ep 2'],
    ],
  },
  {
    name: 'Qwen3-MoE', arch: 'Qwen3MoeForCausalLM', model: { family: 'qwen3', qkNorm: true, moe: { experts: 4, topK: 2, normTopK: false } },
    layouts: [['ZeRO-1 with ep = 2', ['--parallel.ep=2', '--parallel.zero=1'], 'zero 1, .*ep 2']],
  },
  {
    // Hybrid sharding on 4 ranks: ZeRO-3 over dpShard 2, replicated twice, experts split over the shard pairs.
    name: 'Qwen3-MoE', arch: 'Qwen3MoeForCausalLM', model: { family: 'qwen3', qkNorm: true, moe: { experts: 4, topK: 2, normTopK: false } }, nproc: 4,
    layouts: [['HSDP 2 x 2 (ZeRO-3) with ep = 2', ['--parallel.ep=2', '--parallel.zero=3', '--parallel.dpShard=2', '--parallel.dpReplicate=2'], 'zero 3, dpShard 2, dpReplicate 2, ep 2']],
  },
];

const queue = pool(1);
const common = ['--steps', '2', '--data.seqLen=32', '--data.globalBatch=4', '--log.sampleTokens=0', '--optim.warmupSteps=0', '--parallel.backend=gloo'];

for (const f of FAMILIES) {
  const nproc = f.nproc ?? 2;
  const dir = join(root, `${f.name}-${nproc}`);
  const m = new Llama({ ...base, ...f.model } as never, { initSeed: 8 });
  const written = savePretrained(m, dir, { tokenizer });
  m.dispose();
  const [first, ...rest] = f.layouts;
  const r = started(queue(() => flotilla(['verify', config, '--nproc', String(nproc), ...common, `--train.initFrom=${dir}`, ...first![1], ...rest.flatMap(([, o]) => ['--and', ...o])], { timeoutMs: 500_000 })));
  for (const [i, [what, , shown]] of f.layouts.entries()) {
    test(`flotilla verify passes for a ${f.name} (${f.arch}) from its Hugging Face directory under ${what}${nproc !== 2 ? ` on ${nproc} ranks` : ''}`, async () => {
      assert.equal(written.architecture, f.arch);
      const { out, err } = await r;
      const block = verifyBlock(out, i);
      assert.match(block, new RegExp(`^verify: 2 step\\(s\\) .* on ${nproc} ranks \\(.*${shown}.*\\) against one process$`, 'm'), `${out}\n${err}`);
      assert.match(block, /^PASS \(/m, `${out}\n${err}`);
    });
  }
  test(`verify: every layout of the ${f.name} on ${nproc} ranks passes`, async () => {
    const { code, out, err } = await r;
    assert.equal(out.match(/^PASS \(/gm)?.length, f.layouts.length, `${out}\n${err}`);
    // A verify of several layouts ends with a summary line.
    if (f.layouts.length > 1) assert.match(out, new RegExp(`^verify: ${f.layouts.length} of ${f.layouts.length} layouts PASS$`, 'm'), `${out}\n${err}`);
    assert.equal(code, 0, `${out}\n${err}`);
  });
}
