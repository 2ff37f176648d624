// Activation checkpointing (src/nn/checkpoint.ts) in one process: gradients with `full` and
// `selective` checkpointing are bit-identical to gradients without it (float32, and bf16-mixed too,
// since the recompute repeats the same kernels), over two micro-batches accumulated into the same
// .grad, whether a region backpropagates through its kept graph or recomputes, and dropout
// replays its mask.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randint, manualSeed, setNumThreads, tidy, liveTensors, type Tensor } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { autocast, type Precision } from '../src/nn/precision.js';
import { withActivationCheckpoint, type ActivationCheckpoint } from '../src/nn/checkpoint.js';

setNumThreads(1);

// 'sequential': each micro-batch's backward follows its forward (the last block's graph is kept
// and used as it is, the others recompute); 'forwards first': both forwards, then both backwards
// (as a pipeline schedule does), so the first micro-batch's last block recomputes too.
function run(mode: ActivationCheckpoint, precision: Precision, dropout = 0, order: 'sequential' | 'forwards first' = 'sequential'): { losses: number[]; grads: Map<string, Float32Array> } {
  manualSeed(99);
  const model = new GPT({ vocabSize: 50, blockSize: 16, nLayer: 3, nHead: 2, nEmbd: 32, dropout, bias: true, tieEmbeddings: true }, { initSeed: 5 });
  manualSeed(100);
  const losses: number[] = [];
  tidy(() => autocast(precision, () => withActivationCheckpoint(mode, () => {
    const pending: Tensor[] = [];
    for (let mb = 0; mb < 2; mb++) {
      const idx = randint(0, 50, [2, 16]);
      const { loss } = model.forward(idx, idx);
      losses.push(loss!.item());
      if (order === 'sequential') tidy(() => loss!.div(2).backward());
      else pending.push(loss!);
    }
    for (const l of pending) tidy(() => l.div(2).backward());
  })));
  const grads = tidy(() => new Map(model.namedParameters().map(([n, p]) => [n, p.grad!.toArray() as Float32Array])));
  model.dispose();
  return { losses, grads };
}

function assertBitIdentical(a: ReturnType<typeof run>, b: ReturnType<typeof run>): void {
  assert.deepEqual(a.losses, b.losses);
  for (const [name, g] of a.grads) {
    const h = b.grads.get(name)!;
    const ua = new Uint32Array(g.buffer, g.byteOffset, g.length), ub = new Uint32Array(h.buffer, h.byteOffset, h.length);
    let diff = 0;
    for (let i = 0; i < ua.length; i++) if (ua[i] !== ub[i]) diff++;
    assert.equal(diff, 0, `${name}: ${diff} of ${ua.length} gradient elements differ`);
  }
}

for (const mode of ['full', 'selective'] as const) {
  for (const precision of ['fp32', 'bf16-mixed'] as const) {
    test(`activation_checkpoint_${mode}: gradients bit-identical to no checkpointing (${precision}), kept last graph and recompute alike`, () => {
      const before = liveTensors();
      const ref = run('none', precision);
      assertBitIdentical(run(mode, precision), ref);
      assertBitIdentical(run(mode, precision, 0, 'forwards first'), ref);
      assert.equal(liveTensors(), before, 'no tensor handles leak');
    });
  }

  test(`activation_checkpoint_${mode}: dropout replays the forward's mask in the recompute`, () => {
    // With dropout, checkpointing draws one seed per region, so the masks differ from a run without
    // it. Sequentially, the first micro-batch's last block backpropagates through its forward's own
    // graph; with both forwards first, it recomputes: equal gradients mean the recompute replayed
    // the forward's mask. Every gradient is finite.
    const a = run(mode, 'fp32', 0.2);
    const b = run(mode, 'fp32', 0.2, 'forwards first');
    assertBitIdentical(a, b);
    for (const [, g] of a.grads) assert.ok(g.every(Number.isFinite));
    assert.notDeepEqual(a.losses, run('none', 'fp32', 0.2).losses, 'dropout is on');
  });
}
