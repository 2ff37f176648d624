// Deferred initialisation ([Note: deferred init] in src/nn/module.ts): a GPT built with
// { initSeed, deferInit: true } holds no parameter memory, refuses to run until something gives it
// memory, and ends up with exactly the weights of an eager build with the same seed, whether
// materialize() makes it whole or ZeRO-3's sharded build makes it a bucket at a time.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { GPT } from '../src/models/gpt.js';
import { gptUnits } from '../src/models/gpt_parallel.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { zeros, type Tensor } from '../src/tensor/index.js';

const cfg = { nLayer: 2, nEmbd: 32, nHead: 4, vocabSize: 40, blockSize: 16, tieEmbeddings: true };

function bytesOf(named: [string, Tensor][]): Map<string, string> {
  return new Map(named.map(([n, p]) => [n, Buffer.from(p.toNumbers().map((x) => x.toString(16)).join(',')).toString('base64')]));
}

test('a deferred GPT holds no parameter memory, names the fix when called, and materialize() gives the eager weights bit for bit', () => {
  const eager = new GPT(cfg, { initSeed: 11 });
  const lazy = new GPT(cfg, { initSeed: 11, deferInit: true });
  assert.equal(lazy.parameters().reduce((a, p) => a + p.storageNbytes(), 0), 0);
  assert.throws(() => lazy.call(zeros([1, 4], { dtype: 'int64' })), /built without memory \(deferred init\).*zero = 3.*materialize\(\)/);
  assert.throws(() => new GPT(cfg, { deferInit: true }), /deferInit needs initSeed/);
  lazy.materialize();
  assert.deepEqual(bytesOf(lazy.namedParameters()), bytesOf(eager.namedParameters()));
  eager.dispose();
  lazy.dispose();
});

test('ZeRO-3 builds the shards of a deferred GPT bucket by bucket: the full parameters equal the eager build bit for bit', () => {
  const world = initProcessGroup();
  try {
    const full = (deferInit: boolean) => {
      const model = new GPT(cfg, { initSeed: 5, deferInit });
      const dp = new DataParallel(model, { group: world, zero: 3, units: gptUnits });
      const out = dp.withFullParameters(() => bytesOf(model.namedParameters()));
      dp.dispose();
      return out;
    };
    assert.deepEqual(full(true), full(false));
  } finally {
    destroyProcessGroup();
  }
});
