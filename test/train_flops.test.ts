// Model FLOPs per token ([Note: model flops] in src/train/flops.ts) against counts by hand from the
// config, and one rank's peak: [log] peakTflops, or the matmul probe and its cache.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { cpus, tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseConfig } from '../src/config/index.js';
import { mfuOf, modelFlops } from '../src/train/flops.js';
import { peakTflops } from '../src/train/peak_flops.js';

const flopsOf = (over: string[]) => modelFlops(parseConfig('', over))!;

test('GPT: 6 x the matmul weights a token goes through + 12 x layers x seqLen x width', () => {
  const base = ['--model.nLayer=2', '--model.nHead=2', '--model.nEmbd=32', '--model.blockSize=64', '--model.vocabSize=300', '--data.seqLen=16'];
  // Per block: qkv 32x96, output 32x32, MLP 32x128 and 128x32; the head 32x300 (no embedding tables, biases or norms).
  const block = 32 * 96 + 32 * 32 + 32 * 128 + 128 * 32;
  const dense = flopsOf(base);
  assert.equal(dense.matmulParams, 2 * block + 32 * 300);
  assert.equal(dense.attention, 12 * 2 * 16 * 32);
  assert.equal(dense.perToken, 6 * (2 * block + 32 * 300) + 12 * 2 * 16 * 32);
  // Tied to the embedding: the head's matmul still runs.
  assert.equal(flopsOf([...base, '--model.tieEmbeddings=true']).perToken, dense.perToken);
  // MoE in block 1 (every 2): router 32x4, 2 routed + 1 shared experts of 32x48 and 48x32; the 2 idle experts cost nothing.
  const moe = flopsOf([...base, '--moe.experts=4', '--moe.topK=2', '--moe.every=2', '--moe.sharedExperts=1', '--moe.hidden=48']);
  const moeBlock = 32 * 96 + 32 * 32 + 32 * 4 + 3 * (32 * 48 + 48 * 32);
  assert.equal(moe.matmulParams, block + moeBlock + 32 * 300);
  assert.equal(moe.perToken, 6 * (block + moeBlock + 32 * 300) + 12 * 2 * 16 * 32);
});

test('Llama: grouped-query attention, SwiGLU, MoE experts and a sliding window', () => {
  const base = ['--model.arch=llama', '--model.nLayer=3', '--model.nHead=4', '--model.nKvHead=2', '--model.nEmbd=64', '--model.blockSize=64', '--model.vocabSize=500', '--data.seqLen=32'];
  // Heads of 16: q 64x64, k and v 64x32 (2 key/value heads), o 64x64; SwiGLU width int(8/3 x 64) up to a multiple of 64 = 192.
  const attn = 64 * 64 + 2 * (64 * 32) + 64 * 64, mlp = 3 * 64 * 192;
  const dense = flopsOf(base);
  assert.equal(dense.matmulParams, 3 * (attn + mlp) + 64 * 500);
  assert.equal(dense.attention, 12 * 3 * 32 * 64);
  assert.equal(dense.perToken, 6 * (3 * (attn + mlp) + 64 * 500) + 12 * 3 * 32 * 64);
  // 8 experts of width 96, top 2 and 1 shared in every block, the router 64x8.
  const moe = flopsOf([...base, '--moe.experts=8', '--moe.topK=2', '--moe.sharedExperts=1', '--moe.hidden=96']);
  assert.equal(moe.matmulParams, 3 * (attn + 64 * 8 + 3 * (3 * 64 * 96)) + 64 * 500);
  // headDim 32 (attention 4 x 32 = 128 wide), a window of 8 keys (Mistral).
  const wide = flopsOf([...base, '--model.headDim=32', '--model.family=mistral', '--model.slidingWindow=8']);
  assert.equal(wide.matmulParams, 3 * (64 * 128 + 2 * (64 * 64) + 128 * 64 + mlp) + 64 * 500);
  assert.equal(wide.attention, 12 * 3 * 8 * 128);
});

test('MFU: per-rank TFLOP/s over the peak; the peak given, or probed once and cached', () => {
  const { tflops, mfu } = mfuOf(6e9, 1000, 4, 0.5);
  assert.equal(tflops, (6e9 * 1000) / 4 / 1e12);
  assert.equal(mfu, tflops / 0.5);
  assert.deepEqual(peakTflops(2.5, 'float32'), { tflops: 2.5, source: '[log] peakTflops' });

  const cache = mkdtempSync(join(tmpdir(), 'flotilla-peak-'));
  const env = { FLOTILLA_CACHE_DIR: cache };
  // A probe while every core is busy (load average at the core count) serves its run and is not cached.
  const busy = peakTflops(0, 'float32', env, () => cpus().length);
  assert.ok(busy.tflops > 1e-4 && busy.tflops < 100, `${busy.tflops} TFLOP/s`);
  assert.equal(busy.source, `measured (768x768 float32 GEMMs) under load average ${cpus().length.toFixed(1)} on ${cpus().length} cores, not cached`);
  assert.ok(!existsSync(join(cache, 'mfu')) || readdirSync(join(cache, 'mfu')).length === 0, 'nothing cached');
  // With a core to spare it is cached.
  const probed = peakTflops(0, 'float32', env, () => 0);
  assert.ok(probed.tflops > 1e-4 && probed.tflops < 100, `${probed.tflops} TFLOP/s`);
  assert.match(probed.source, /^measured \(768x768 float32 GEMMs\), cached in /);
  const [file] = readdirSync(join(cache, 'mfu'));
  assert.match(file!, /^peak-.*_x\d+_threads_float32\.json$/);
  // The next run reads the cache (changed here, so the value can only come from it); the key names the CPU, threads and dtype.
  const path = join(cache, 'mfu', file!);
  writeFileSync(path, JSON.stringify({ ...JSON.parse(readFileSync(path, 'utf8')), tflops: 1.25 }));
  assert.deepEqual(peakTflops(0, 'float32', env), { tflops: 1.25, source: path });
});
