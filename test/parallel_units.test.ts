// ZeRO-3 units for any model: a policy by module class or by path picks the wrapping units (as
// FSDP2 users call fully_shard per block), and a model left as one unit gets a warning that says
// how to split it. In one process (a world of one: the plan is the same on every rank).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { tidy } from '../src/tensor/index.js';
import { Module, Linear, LayerNorm } from '../src/nn/index.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { FsdpUnits, unitsByClass, unitsByPath } from '../src/parallel/data_parallel/fsdp.js';
import { GPT } from '../src/models/gpt.js';
import { gptUnits } from '../src/models/gpt_parallel.js';

class Block extends Module {
  readonly ln = this.registerModule('ln', new LayerNorm(4));
  readonly fc = this.registerModule('fc', new Linear(4, 4));
  forward(x: import('../src/tensor/index.js').Tensor) {
    return x.add(this.fc.call(this.ln.call(x)));
  }
}
class Net extends Module {
  readonly inp = this.registerModule('inp', new Linear(3, 4));
  readonly blocks = [0, 1, 2].map((i) => this.registerModule(`b${i}`, new Block()));
  readonly out = this.registerModule('out', new Linear(4, 2));
  forward(x: import('../src/tensor/index.js').Tensor) {
    let h = this.inp.call(x);
    for (const b of this.blocks) h = b.call(h);
    return this.out.call(h);
  }
}

const unitNames = (m: Module, policy?: Parameters<typeof FsdpUnits.plan>[2]) =>
  FsdpUnits.plan(m, m.namedParameters(), policy).units.map((u) => u.name);

test('units by class, by path (exact, * for one segment, RegExp), and the GPT\'s policy', () => {
  tidy(() => {
    const net = new Net();
    assert.deepEqual(unitNames(net, unitsByClass([Block])), ['b2', 'b1', 'b0', '']);
    assert.deepEqual(unitNames(net, unitsByClass([Block], { paths: ['out'] })), ['out', 'b2', 'b1', 'b0', '']);
    assert.deepEqual(unitNames(net, unitsByPath(['b*', 'inp'])), ['b2', 'b1', 'b0', 'inp', ''], 'out is left to the root unit');
    assert.deepEqual(unitNames(net, unitsByPath([/^b[02]$/])), ['b2', 'b0', '']);
    assert.deepEqual(unitNames(net, unitsByPath(['b*.fc'])), ['b2.fc', 'b1.fc', 'b0.fc', '']);
    assert.deepEqual(unitNames(net), [''], 'no policy: one unit');
    const gpt = new GPT({ vocabSize: 16, blockSize: 4, nLayer: 2, nHead: 2, nEmbd: 8 });
    assert.deepEqual(unitNames(gpt, gptUnits), ['head', 'layers.1', 'layers.0', 'wpe', 'wte', '']);
    net.dispose();
    gpt.dispose();
  });
});

test('ZeRO-3 over a model that is one unit warns once, naming unitsByClass / unitsByPath and the top-level modules; a policy does not warn', async () => {
  const world = initProcessGroup();
  const warnings: Error[] = [];
  const onWarning = (w: Error) => warnings.push(w);
  process.on('warning', onWarning);
  try {
    const a = new Net();
    const dpA = new DataParallel(a, { group: world, zero: 3 });
    const b = new Net();
    const dpB = new DataParallel(b, { group: world, zero: 3, units: unitsByClass([Block]) });
    await new Promise((r) => setImmediate(r)); // warnings are emitted on the next tick
    const ours = warnings.filter((w) => w.name === 'FlotillaWarning');
    assert.equal(ours.length, 1, ours.map((w) => w.message).join('\n'));
    assert.match(ours[0]!.message, /one wrapping unit.*unitsByClass\(\[YourBlock\]\).*unitsByPath.*inp \(Linear\), b0 \(Block\), b1 \(Block\), b2 \(Block\), out \(Linear\)/s);
    for (const [dp, m] of [[dpA, a], [dpB, b]] as const) {
      dp.dispose();
      m.dispose();
    }
  } finally {
    process.off('warning', onWarning);
    destroyProcessGroup();
  }
});
