// Helpers of the Hugging Face tests: the reference of test/oracle/hf_reference.py run on a batch of
// directories at once, flotilla's greedy decoding, and the float64 comparison against the reference.
import assert from 'node:assert/strict';
import { readFileSync, writeFileSync } from 'node:fs';
import { type Tensor, tensor, tidy, noGrad } from '../../src/tensor/index.js';
import type { Module } from '../../src/nn/module.js';
import { loadPretrained } from '../../src/checkpoint/hf.js';
import { generate, type CausalLM } from '../../src/inference/generate.js';
import { runOracle } from './oracle.js';
import { scaledErr } from './check.js';

export const HF_IDX = tensor(Int32Array.from({ length: 2 * 13 }, (_, i) => (i * 37 + 11) % 61), { shape: [2, 13], dtype: 'int64' });
export const HF_PROMPT = [3, 17, 42, 8, 29];
export const GREEDY = 20;
/** float64 on both sides: only rounding may differ. */
export const HF_TOL = 1e-12;

export interface HfJob {
  mode: 'make' | 'read';
  dir: string;
  config?: Record<string, unknown>;
  seed?: number;
  dtype?: 'float32' | 'bfloat16' | 'float16';
  maxShardBytes?: number;
  legacy?: boolean;
}

export interface HfRef {
  logits: Tensor;
  greedy: number[];
}

/** The reference's logits (of HF_IDX) and greedy tokens (after HF_PROMPT) for each job, in one process (`script`: test/oracle/<script>.py). */
export function hfReference(jobs: HfJob[], script = 'hf_reference'): HfRef[] {
  const prompt = tensor(Int32Array.from(HF_PROMPT), { shape: [1, HF_PROMPT.length], dtype: 'int64' });
  const r = runOracle(script, { idx: HF_IDX, prompt }, { greedy: GREEDY, jobs });
  prompt.dispose();
  return jobs.map((_, i) => ({ logits: r.tensors[`logits.${i}`]!, greedy: r.tensors[`greedy.${i}`]!.toNumbers() }));
}

export type LM = Module & { forward(x: Tensor): { logits: Tensor } };

/** Argmax decoding of `steps` tokens after ids, the whole context recomputed each step. */
export function greedy(model: LM, ids: readonly number[], steps: number): number[] {
  const seq = [...ids];
  noGrad(() => {
    for (let i = 0; i < steps; i++) {
      seq.push(tidy(() => {
        const { logits } = model.call(tensor(Int32Array.from(seq), { shape: [1, seq.length], dtype: 'int64' }));
        return logits.narrow(1, seq.length - 1, 1).reshape(-1).argmax().item();
      }));
    }
  });
  return seq.slice(ids.length);
}

/** Loads dir in float64; its logits must equal the reference's to float64 rounding and its greedy tokens agree. */
export function checkAgainst(dir: string, ref: HfRef): void {
  const { model, config } = loadPretrained(dir, { dtype: 'float64' });
  try {
    const logits = noGrad(() => model.call(HF_IDX).logits);
    assert.equal(logits.dtype, 'float64');
    assert.deepEqual(logits.shape, [2, 13, config.vocabSize]);
    const err = scaledErr(logits, ref.logits);
    logits.dispose();
    assert.ok(err <= HF_TOL, `${dir}: logits differ from the reference by ${err.toExponential(2)} of their scale`);
    assert.deepEqual(greedy(model, HF_PROMPT, GREEDY), ref.greedy, `${dir}: greedy decoding disagrees with the reference`);
  } finally {
    model.dispose();
  }
}

/** Every parameter of two models equal bit for bit (names and values). */
export function assertSameParameters(a: Module, b: Module, what: string): void {
  const pa = Object.fromEntries(a.namedParameters()), pb = Object.fromEntries(b.namedParameters());
  assert.deepEqual(Object.keys(pb), Object.keys(pa), `${what}: parameter names`);
  for (const k of Object.keys(pa)) {
    assert.equal(pb[k]!.dtype, pa[k]!.dtype, `${what}: ${k} dtype`);
    assert.deepEqual(pb[k]!.toNumbers(), pa[k]!.toNumbers(), `${what}: ${k} is not bit-identical`);
  }
}

/** A directory's greedy tokens through generate (float64), with and without the key/value cache. */
export function decodedBothWays(dir: string): [number[], number[]] {
  const { model } = loadPretrained(dir, { dtype: 'float64' });
  try {
    const run = (cache: boolean) => generate(model as unknown as CausalLM, [HF_PROMPT], { maxNewTokens: GREEDY, temperature: 0, cache })[0]!;
    return [run(true), run(false)];
  } finally {
    model.dispose();
  }
}

/** Runs fn with the config.json at cfgPath patched by `patch` (its fields replaced or added), then puts the file back. */
export function withConfigPatch<T>(cfgPath: string, patch: Record<string, unknown>, fn: () => T): T {
  const good = readFileSync(cfgPath, 'utf8');
  writeFileSync(cfgPath, JSON.stringify({ ...JSON.parse(good), ...patch }));
  try {
    return fn();
  } finally {
    writeFileSync(cfgPath, good);
  }
}
