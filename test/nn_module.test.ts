// Modules: names, state dicts (round trip, strict errors, shape mismatch, through safetensors), train/eval.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { randint, tidy, zeros, manualSeed, setNumThreads, liveTensors, tensorCacheStats, type Tensor } from '../src/tensor/index.js';
import { MoE } from '../src/nn/moe.js';
import { defaultMoEConfig } from '../src/nn/moe_config.js';
import { Module, Linear, LayerNorm, Dropout, ModuleList, Embedding } from '../src/nn/index.js';
import { GPT, gptNumParams } from '../src/models/gpt.js';
import { saveSafetensors, loadSafetensors } from '../src/checkpoint/safetensors.js';

setNumThreads(1);
const small = { vocabSize: 13, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 8 };

const layerKeys = (i: number, bias = true) => [
  `layers.${i}.ln1.weight`, ...(bias ? [`layers.${i}.ln1.bias`] : []),
  `layers.${i}.attn.qkv.weight`, ...(bias ? [`layers.${i}.attn.qkv.bias`] : []),
  `layers.${i}.attn.proj.weight`, ...(bias ? [`layers.${i}.attn.proj.bias`] : []),
  `layers.${i}.attn.mask`,
  `layers.${i}.ln2.weight`, ...(bias ? [`layers.${i}.ln2.bias`] : []),
  `layers.${i}.mlp.fc.weight`, ...(bias ? [`layers.${i}.mlp.fc.bias`] : []),
  `layers.${i}.mlp.proj.weight`, ...(bias ? [`layers.${i}.mlp.proj.bias`] : []),
];

test('GPT parameter and state names; a tied weight is one parameter under two state keys', () => {
  const m = new GPT({ ...small, tieEmbeddings: true });
  const sd = m.stateDict();
  assert.deepEqual(Object.keys(sd).sort(), ['wte.weight', 'wpe.weight', ...layerKeys(0), ...layerKeys(1), 'lnF.weight', 'lnF.bias', 'head.weight'].sort());
  assert.equal(sd['head.weight'], sd['wte.weight']);
  const names = m.namedParameters().map(([n]) => n);
  assert.ok(!names.includes('head.weight') && names.includes('wte.weight'), 'the tied weight is listed once, under its first name');
  assert.ok(!names.some((n) => n.endsWith('.mask')), 'buffers are not parameters');
  assert.deepEqual(m.namedBuffers().map(([n]) => n), ['layers.0.attn.mask', 'layers.1.attn.mask']);
  // 13*8 + 8*8 + 2 * (4*8 + (24*8+24) + (8*8+8) + (32*8+32) + (8*32+8)) + 2*8 (tied head adds nothing)
  assert.equal(m.numParams(), 13 * 8 + 8 * 8 + 2 * (4 * 8 + 24 * 8 + 24 + 8 * 8 + 8 + 32 * 8 + 32 + 8 * 32 + 8) + 2 * 8);
  const untied = new GPT({ ...small, tieEmbeddings: false, bias: false });
  assert.notEqual(untied.stateDict()['head.weight'], untied.stateDict()['wte.weight']);
  assert.ok(!Object.keys(untied.stateDict()).some((k) => k.endsWith('.bias')), 'bias: false drops every bias');
  assert.ok(m.parameters().every((p) => p.requiresGrad && p.isLeaf));
  m.dispose();
  untied.dispose();
});

test('loadStateDict copies in place: same outputs, parameters keep their storage', () => {
  manualSeed(1);
  const a = new GPT(small), b = new GPT(small);
  const ptrs = b.parameters().map((p) => p.dataPtr());
  b.loadStateDict(a.stateDict());
  assert.deepEqual(b.parameters().map((p) => p.dataPtr()), ptrs, 'no parameter was replaced');
  tidy(() => {
    const idx = randint(0, 13, [2, 8]);
    assert.deepEqual(b.forward(idx).logits.toNumbers(), a.forward(idx).logits.toNumbers());
  });
  a.dispose();
  b.dispose();
});

test('a state dict survives safetensors: save, load into a fresh model, same outputs', () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-nn-'));
  try {
    manualSeed(2);
    const a = new GPT({ ...small, tieEmbeddings: true }), b = new GPT({ ...small, tieEmbeddings: true });
    const path = join(dir, 'model.safetensors');
    saveSafetensors(path, a.stateDict(), { format: 'pt' });
    const before = liveTensors();
    const loaded = loadSafetensors(path);
    b.loadStateDict(loaded);
    for (const t of Object.values(loaded)) t.dispose();
    assert.equal(liveTensors(), before);
    tidy(() => {
      const idx = randint(0, 13, [2, 8]);
      assert.deepEqual(b.forward(idx).logits.toNumbers(), a.forward(idx).logits.toNumbers());
    });
    a.dispose();
    b.dispose();
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('strict loading lists missing and unexpected keys and changes nothing', () => {
  const m = new GPT(small);
  tidy(() => {
    const sd: Record<string, Tensor> = { ...m.stateDict() };
    const before = m.wte.weight.toNumbers();
    delete sd['lnF.bias'];
    delete sd['layers.1.attn.mask'];
    sd['layers.2.ln1.weight'] = zeros([8]);
    sd['wte.weight'] = zeros([13, 8]);
    assert.throws(() => m.loadStateDict(sd),
      /loadStateDict: state does not match this model; missing: layers\.1\.attn\.mask, lnF\.bias; unexpected: layers\.2\.ln1\.weight \(load a checkpoint of the same model config, or pass \{ strict: false \}\)/);
    assert.deepEqual(m.wte.weight.toNumbers(), before, 'nothing was copied');
    // Non-strict loads what matches.
    m.loadStateDict(sd, { strict: false });
    assert.deepEqual(m.wte.weight.toNumbers(), new Array(13 * 8).fill(0));
  });
  m.dispose();
});

test('a shape mismatch names the key and both shapes, and changes nothing', () => {
  const m = new GPT(small), wider = new GPT({ ...small, nEmbd: 12, nHead: 2 });
  tidy(() => {
    const before = m.lnF.weight.toNumbers();
    assert.throws(() => m.loadStateDict(wider.stateDict()), (e: unknown) => {
      const msg = (e as Error).message;
      assert.match(msg, /^loadStateDict: shape mismatch: /);
      assert.match(msg, /wte\.weight: have \[13,8\], got \[13,12\]/);
      assert.match(msg, /layers\.0\.attn\.qkv\.weight: have \[24,8\], got \[36,12\]/);
      return true;
    });
    assert.deepEqual(m.lnF.weight.toNumbers(), before);
  });
  m.dispose();
  wider.dispose();
});

test('train()/eval() reach every submodule; dropout is active only in training', () => {
  manualSeed(5);
  const m = new GPT({ ...small, dropout: 0.5 });
  assert.ok(m.namedModules().every(([, x]) => x.training));
  m.eval();
  assert.ok(m.namedModules().every(([, x]) => !x.training));
  tidy(() => {
    const idx = randint(0, 13, [2, 8]);
    assert.deepEqual(m.forward(idx).logits.toNumbers(), m.forward(idx).logits.toNumbers(), 'eval is deterministic');
    m.train();
    assert.notDeepEqual(m.forward(idx).logits.toNumbers(), m.forward(idx).logits.toNumbers(), 'training applies dropout');
  });
  assert.throws(() => new Dropout(1), /Dropout: p must be in \[0, 1\), got 1/);
  m.dispose();
});

test('custom modules: registration, nested names, shared weights in Linear', () => {
  class Net extends Module {
    readonly emb: Embedding;
    readonly blocks: ModuleList<Linear>;
    readonly norm: LayerNorm;
    readonly out: Linear;
    constructor() {
      super();
      this.emb = this.registerModule('emb', new Embedding(5, 4));
      this.blocks = this.registerModule('blocks', new ModuleList([new Linear(4, 4), new Linear(4, 4, { bias: false })]));
      this.norm = this.registerModule('norm', new LayerNorm(4, { bias: false }));
      this.out = this.registerModule('out', new Linear(4, 5, { bias: false, weight: this.emb.weight }));
    }
  }
  const n = new Net();
  assert.deepEqual(n.namedParameters().map(([k]) => k), ['emb.weight', 'blocks.0.weight', 'blocks.0.bias', 'blocks.1.weight', 'norm.weight']);
  assert.deepEqual(Object.keys(n.stateDict()), ['emb.weight', 'blocks.0.weight', 'blocks.0.bias', 'blocks.1.weight', 'norm.weight', 'out.weight']);
  assert.throws(() => new Linear(3, 5, { weight: n.emb.weight }), /Linear: shared weight has shape \[5,4\], expected \[5, 3\]/);
  n.dispose();
});

test('call() runs forward pre/post hooks around every invocation; a backward pre-hook fires once per reached forward, before the module\'s own backward', () => {
  tidy(() => {
    manualSeed(0);
    const gpt = new GPT(small);
    const events: string[] = [];
    const block = gpt.layers.items[1]!;
    const removers = [
      block.registerForwardPreHook(() => events.push('pre')),
      block.registerForwardHook((_m, _a, out) => events.push(`post:${(out as Tensor).shape.join('x')}`)),
      block.registerBackwardPreHook(() => events.push('backward-pre')),
      // The block's first parameter gets its gradient during the block's own backward: after the pre-hook.
      ...[block.ln1.weight].map((p) => p.registerAccumulateGradHook(() => events.push('ln1.weight grad'))),
      gpt.layers.items[0]!.registerBackwardPreHook(() => events.push('block0 backward-pre')),
    ];
    const idx = randint(0, 13, [2, 5]);
    gpt.call(idx, idx).loss!.backward();
    assert.deepEqual(events, ['pre', 'post:2x5x8', 'backward-pre', 'ln1.weight grad', 'block0 backward-pre']);
    for (const r of removers) r();
    events.length = 0;
    gpt.call(idx, idx).loss!.backward();
    assert.deepEqual(events.filter((e) => e !== 'ln1.weight grad'), [], 'removed hooks stay silent');
    gpt.dispose();
  });
});

test('gptNumParams counts from the config what the built GPT holds (bias, tied head)', () => {
  for (const extra of [{}, { bias: false }, { tieEmbeddings: true }, { bias: false, tieEmbeddings: true, nLayer: 3 }]) {
    const gpt = new GPT({ ...small, ...extra });
    assert.equal(gptNumParams({ ...small, ...extra }), gpt.numParams(), JSON.stringify(extra));
    gpt.dispose();
  }
});

test('a module call frees the intermediates of its forward at once; what the output reaches survives; a stored, un-kept tensor errors clearly', () => {
  class Stack extends Module {
    readonly a = this.registerModule('a', new Linear(6, 6));
    readonly b = this.registerModule('b', new Linear(6, 6));
    stash?: Tensor;
    forward(x: Tensor): { y: Tensor; parts: Tensor[] } {
      const h1 = this.a.call(x).relu(); // intermediates: the linear's output, h1, h2
      const h2 = h1.mul(2);
      this.stash = h2;
      const y = this.b.call(h2).sum();
      return { y, parts: [h1.view(-1)] };
    }
  }
  manualSeed(0);
  const m = new Stack();
  const x = zeros([3, 6]).add(0.5);
  const before = liveTensors();
  tidy(() => {
    const out = m.call(x);
    // Only the two outputs hold handles now; autograd holds what backward needs by itself.
    assert.equal(liveTensors(), before + 2, 'intermediates are released when the call returns');
    out.y.backward();
    assert.throws(() => m.stash!.sum(), /tensor was disposed .*a module call is a scope too: keep\(\)/);
  });
  assert.equal(liveTensors(), before);
  // The gradients equal those of the same forward written out in one scope.
  const grads = m.parameters().map((p) => p.grad!.toNumbers());
  for (const p of m.parameters()) p.grad = undefined;
  tidy(() => {
    const h = m.a.forward(x).relu().mul(2);
    m.b.forward(h).sum().backward();
  });
  m.parameters().forEach((p, i) => assert.deepEqual(p.grad!.toNumbers(), grads[i], `gradient ${i}`));
});

test('keepExperts (what an expert-parallel rank holds) frees the dropped experts at once, before any GC', () => {
  const stats = tensorCacheStats();
  assert.ok(stats.on, 'the tensor cache is off, so its byte count says nothing');
  const before = stats.liveBytes;
  // Two stacks (fc, proj) of 4 experts of 128 x 512 float32: 1 MiB each, held by the tensor cache.
  const moe = new MoE({ ...defaultMoEConfig, experts: 4 }, 128, 512, 'gelu', false);
  const built = tensorCacheStats().liveBytes - before;
  moe.keepExperts(2, 2);
  const held = tensorCacheStats().liveBytes - before;
  assert.equal(built, 2 * 2 ** 20);
  assert.equal(held, built / 2, `bytes of the expert stacks: ${built} built, ${held} held after keeping 2 of 4 experts`);
  moe.dispose();
});
