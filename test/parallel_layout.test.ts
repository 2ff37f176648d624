// The layout's accumulation flavour under a pipeline: what the validation allows and refuses, and
// what 'auto' resolves to (the runs themselves are in parallel_user_model.test.ts).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { layoutFor, layoutProblems, LayoutError, type ParallelConfig } from '../src/parallel/layout.js';

const base: ParallelConfig = {
  dp: -1, zero: 2, dpShard: -1, dpReplicate: 1, accumulate: 'auto', pp: 2, ppSchedule: '1f1b', ppVirtualStages: 1,
  reshardAfterForward: true, bucketSizeMb: 0, overlap: true, reduceDtype: 'fp32', backend: 'auto', tp: 1, sequenceParallel: false, lossParallel: false, ep: 1, cp: 1, auto: false,
};

test('a pipeline resolves "auto" to reduceLast, and keeps the flavour it is given', () => {
  assert.equal(layoutFor({ pp: 2, zero: 2 }, 4).accumulate, 'reduceLast');
  assert.equal(layoutFor({ pp: 2, zero: 3 }, 4).accumulate, 'reduceLast');
  assert.equal(layoutFor({ pp: 2, zero: 2, dpReplicate: 2, accumulate: 'reduceScatterEachAllReduceLast' }, 4).accumulate, 'reduceScatterEachAllReduceLast');
  assert.equal(layoutFor({ pp: 1, zero: 2 }, 4).accumulate, 'reduceEach');
});

test('a pipeline refuses reduceEach, and reduceScatterEachAllReduceLast without replicas', () => {
  assert.match(layoutProblems({ ...base, accumulate: 'reduceEach' }, 4).join('\n'), /a pipeline reduces its gradients once per step/);
  assert.match(layoutProblems({ ...base, accumulate: 'reduceScatterEachAllReduceLast' }, 4).join('\n'), /for hybrid sharding/);
  assert.deepEqual(layoutProblems({ ...base, dpReplicate: 2, accumulate: 'reduceScatterEachAllReduceLast' }, 4), []);
  assert.throws(() => layoutFor({ pp: 2, zero: 2, accumulate: 'reduceEach' }, 4), LayoutError);
});
