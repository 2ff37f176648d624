// What `flotilla plan` says while it calibrates ([Note: measuring progress] in src/plan/progress.ts)
// and how it prices bf16-mixed on a CPU without native bfloat16 ([Note: bf16 without native
// support] in src/plan/calibrate_compute.ts), with the CPU's answer given instead of read from /proc/cpuinfo.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Progress, formatDuration } from '../src/plan/progress.js';
import { bf16Pricing, priceFromProbe, calibrateCompute, computeWeights, type ComputePoint } from '../src/plan/calibrate_compute.js';
import type { CalibrationPoint } from '../src/plan/calibrate_model.js';
import { cpuFlags, bf16Support } from '../src/tensor/cpu_features.js';
import { loadConfig } from '../src/config/index.js';

const pt = (samples: number, tokens: number, precision: CalibrationPoint['precision'], activationCheckpoint: CalibrationPoint['activationCheckpoint'] = 'none'): CalibrationPoint => ({ samples, tokens, precision, activationCheckpoint });

test('durations read as a person would say them', () => {
  assert.equal(formatDuration(850), '850 ms');
  assert.equal(formatDuration(42_400), '42 s');
  assert.equal(formatDuration(200_000), '3 min 20 s');
  assert.equal(formatDuration(3_900_000), '1 h 05 min');
});

test('progress: which measurement, n of m, elapsed and the time left at the pace since the first; at most a line per interval, always the first and last', () => {
  let t = 0;
  const lines: string[] = [];
  const p = new Progress('compute', [1, 1, 2, 4, 2], (l) => lines.push(l), () => t, 5_000);
  t = 7_000; p.step('1x16 fp32, 1 block(s)'); // starting the processes is in this one
  t = 8_000; p.step('2x16 fp32, 1 block(s)'); // 1 s after the last line: quiet
  t = 13_000; p.step('1x16 fp32, 2 block(s)');
  t = 14_000; p.step('2x16 fp32, 2 block(s)'); // quiet
  t = 15_000; p.step('4x16 fp32, 2 block(s)');
  assert.deepEqual(lines, [
    '[plan] compute: measured 1 of 5 (1x16 fp32, 1 block(s)); 7 s elapsed, the time left follows the next one',
    '[plan] compute: measured 3 of 5 (1x16 fp32, 2 block(s)); 13 s elapsed, about 12 s left', // 3 units in 6 s since the first; 6 left
    '[plan] compute: measured 5 of 5 (4x16 fp32, 2 block(s)); 15 s elapsed, done',
  ]);
  // Weights in the order the measurements finish: rounds, then depths, then shapes.
  assert.deepEqual(computeWeights([1, 3], [pt(1, 16, 'fp32'), pt(2, 16, 'fp32', 'full')], 2).map((w) => Math.round(w)), [16, 43, 48, 128, 16, 43, 48, 128]);
});

test('cpu features: bf16 instructions (avx512_bf16, amx_bf16) and the AVX-512 that oneDNN\'s bf16 matmuls need, from /proc/cpuinfo', () => {
  const epyc = 'processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n';
  assert.deepEqual([...cpuFlags(epyc)], ['fpu', 'sse2', 'avx', 'avx2', 'fma']);
  assert.deepEqual(bf16Support(cpuFlags(epyc)), { native: false, oneDnnGemm: false });
  assert.deepEqual(bf16Support(new Set(['avx2', 'avx512bw', 'avx512vl', 'avx512dq'])), { native: false, oneDnnGemm: true });
  assert.deepEqual(bf16Support(new Set(['avx512bw', 'avx512vl', 'avx512dq', 'avx512_bf16'])), { native: true, oneDnnGemm: true });
  assert.equal(bf16Support(new Set(['amx_bf16'])).native, true);
  assert.deepEqual([...cpuFlags('')], []);
});

test('bf16 shapes: measured where the CPU has bfloat16; else their float32 twins measured and one short probe at the smallest', () => {
  const points = [pt(2, 32, 'fp32'), pt(8, 32, 'fp32'), pt(2, 32, 'bf16-mixed'), pt(8, 32, 'bf16-mixed'), pt(4, 32, 'bf16-mixed', 'full')];
  assert.deepEqual(bf16Pricing(points, true), { measure: points, priced: [] });
  const c = bf16Pricing(points, false);
  assert.deepEqual(c.probe, pt(2, 32, 'bf16-mixed'));
  assert.deepEqual(c.priced, points.filter((p) => p.precision === 'bf16-mixed'));
  assert.deepEqual(c.measure, [pt(2, 32, 'fp32'), pt(8, 32, 'fp32'), pt(4, 32, 'fp32', 'full')]);
  assert.deepEqual(bf16Pricing(points.slice(0, 2), false), { measure: points.slice(0, 2), priced: [] });
  // Priced part by part: the twin's times and bytes, times the probe's bf16 over its float32.
  const cp = (p: CalibrationPoint, f: number): ComputePoint => ({ ...p, block: { fwdMs: 2 * f, bwdMs: 4 * f, actBytes: 100 * f }, rest: { fwdMs: f, bwdMs: f, actBytes: 0 } });
  const priced = priceFromProbe(pt(8, 32, 'bf16-mixed'), cp(pt(8, 32, 'fp32'), 4), cp(pt(2, 32, 'bf16-mixed'), 15), cp(pt(2, 32, 'fp32'), 1));
  assert.deepEqual(priced, { ...pt(8, 32, 'bf16-mixed'), block: { fwdMs: 120, bwdMs: 240, actBytes: 6000 }, rest: { fwdMs: 60, bwdMs: 60, actBytes: 0 } });
});

test('calibrating on a CPU without bfloat16: says what it measures as it goes, and prices the bf16 shape from a probe instead of measuring it', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-plan-progress-'));
  const saved = process.env.FLOTILLA_CACHE_DIR;
  process.env.FLOTILLA_CACHE_DIR = 'off';
  try {
    const file = join(dir, 'tiny.toml');
    writeFileSync(file, '[model]\nvocabSize = 64\nnLayer = 1\nnHead = 1\nnEmbd = 16\nblockSize = 16\n[data]\ntokenizer = "byte"\nseqLen = 16\nglobalBatch = 2\n[train]\nthreads = 1\n');
    const cfg = loadConfig(file, []);
    const lines: string[] = [];
    const points = [pt(1, 16, 'fp32'), pt(2, 16, 'fp32'), pt(2, 16, 'bf16-mixed')];
    const r = await calibrateCompute(cfg, points, 1, 1, (l) => lines.push(l), { nativeBf16: false, progressEveryMs: 0 });
    const all = lines.join('\n');
    assert.match(all, /no native bfloat16 .*the 1 bf16-mixed shape\(s\) are priced from a short probe at 2x16 bf16-mixed/);
    // One block at both depths (the model has one): 2 shapes x 2 depths, each said as it finishes.
    const said = lines.filter((l) => l.startsWith('[plan] compute: measured'));
    assert.equal(said.length, 4, all);
    assert.match(said[0]!, /^\[plan\] compute: measured 1 of 4 \(1x16 fp32, 1 block\(s\)\); \d+ (ms|s) elapsed, the time left follows the next one$/);
    assert.match(said[1]!, /^\[plan\] compute: measured 2 of 4 \(2x16 fp32, 1 block\(s\)\); .+ elapsed, about .+ left$/);
    assert.match(said[3]!, /measured 4 of 4 .*, done$/);
    assert.ok(said.every((l) => !l.includes('bf16')), `the bf16 shape was measured at full length:\n${all}`);
    assert.match(all, /bf16-mixed took [\d.]+x float32's forward and backward at 2x16; its 1 shape\(s\) are priced/);
    const bf16 = r.points[2]!;
    assert.equal(bf16.precision, 'bf16-mixed');
    assert.ok(bf16.block.fwdMs > 0 && bf16.block.bwdMs > 0, JSON.stringify(bf16));
  } finally {
    if (saved === undefined) delete process.env.FLOTILLA_CACHE_DIR;
    else process.env.FLOTILLA_CACHE_DIR = saved;
    rmSync(dir, { recursive: true, force: true });
  }
});
