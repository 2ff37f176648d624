// A failed all-gather of a ZeRO-3 unit (a collective timeout, a dead peer) must reach the user as
// that error, unchanged, whichever path runs next: the forward that needed the unit, the clean-up
// after the step, or the dispose in a finally block. It used to come out as "u.views is not
// iterable", raised by the second gather of a unit the failed one had left marked as gathering.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { FsdpUnits } from '../src/parallel/data_parallel/fsdp.js';
import type { Bucket } from '../src/parallel/data_parallel/grad_buffer.js';
import type { ProcessGroup } from '../src/distributed/process_group.js';
import { Linear } from '../src/nn/layers.js';
import * as T from '../src/tensor/index.js';

/**
 * A group of two whose gathers fail at wait(), as timed-out collectives do: the first gather issued
 * with `first`, every later one with an error of its own (the same one at every wait). A unit's
 * gather is one broadcast per rank ([Note: in-place gathers]); `issued` counts gathers.
 */
function failingGroup(first: Error): { group: ProcessGroup; issued: () => number } {
  let n = 0;
  const group = {
    size: 2,
    rank: 0,
    broadcast: (_t: unknown, src: number) => {
      if (src === 0) n++;
      const err = n === 1 ? first : new Error(`a later gather (#${n}) failed too`);
      return { wait: () => { throw err; } };
    },
  } as unknown as ProcessGroup;
  return { group, issued: () => n };
}

function bucket(): Bucket {
  const data = T.zeros([8]);
  data.resizeStorage_(0); // a sharded unit: full parameters freed between uses
  return { index: 0, offset: 0, numel: 8, shardNumel: 4, slots: [], frozenNumel: 0, frozenSlots: [], data, grad: T.zeros([8]), shardData: T.zeros([4]) } as unknown as Bucket;
}

/** A root unit (the model) and, with `block`, a unit of its own for another module. */
function setup(first: Error, block?: Linear): { units: FsdpUnits; model: Linear; issued: () => number } {
  const model = new Linear(2, 2);
  const { group, issued } = failingGroup(first);
  const plan = { groups: block ? [[], []] : [[]], units: [...(block ? [{ name: 'block', module: block }] : []), { name: '', module: model }] };
  const units = new FsdpUnits(model, plan, plan.units.map(bucket), group, { reshardAfterForward: true, prefetch: true, onMemoryChange: () => undefined });
  return { units, model, issued };
}

function thrown(fn: () => unknown): unknown {
  try {
    fn();
  } catch (e) {
    return e;
  }
  return undefined;
}

test('ZeRO-3: after a failed gather, every later path surfaces the first error unchanged', () => {
  const first = new Error('allGather on group \'world\' (global ranks [0, 1]) failed: timed out (process-group timeout 2000 ms)');
  const { units, model, issued } = setup(first);

  // The forward that needs the unit's parameters gets the collective's error.
  assert.equal(thrown(() => model.call(T.zeros([1, 2]))), first);
  // A trainer's clean-up after the failed step must not replace it with an error of its own.
  assert.equal(thrown(() => units.afterBackward()), undefined);
  assert.equal(thrown(() => units.afterStep()), undefined);
  // Whatever needs the parameters again gets the first error again (the group is unusable), and
  // issues no new collective on it.
  const before = issued();
  assert.equal(thrown(() => units.withFullParameters(() => 1)), first);
  assert.equal(thrown(() => model.call(T.zeros([1, 2]))), first);
  assert.equal(issued(), before);
  assert.equal(thrown(() => units.dispose()), undefined);
});

test('ZeRO-3: a failed gather inside withFullParameters surfaces unchanged; the other unit\'s gather in flight is not waited on', () => {
  const first = new Error('allGather failed: the communicator is unusable');
  const { units, issued } = setup(first, new Linear(2, 2));
  assert.equal(thrown(() => units.withFullParameters(() => 1)), first);
  assert.equal(issued(), 2, 'both units were being gathered');
  assert.equal(thrown(() => units.withFullParameters(() => 1)), first);
  assert.equal(thrown(() => units.afterBackward()), undefined);
  assert.equal(thrown(() => units.afterStep()), undefined);
  assert.equal(thrown(() => units.dispose()), undefined);
  assert.equal(issued(), 2);
});
