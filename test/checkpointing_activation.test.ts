// Activation checkpointing (src/nn/checkpoint.ts) in one process: gradients with `full`
// checkpointing are bit-identical to gradients without it (float32, and bf16-mixed too, since the
// recompute repeats the same kernels), over two micro-batches accumulated into the same .grad,
// and dropout replays its mask.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randint, manualSeed, setNumThreads, tidy, liveTensors, type Tensor } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { autocast, type Precision } from '../src/nn/precision.js';
import { withActivationCheckpoint, type ActivationCheckpoint } from '../src/nn/checkpoint.js';

setNumThreads(1);

function run(mode: ActivationCheckpoint, precision: Precision, dropout = 0): { losses: number[]; grads: Map<string, Float32Array> } {
  manualSeed(99);
  const model = new GPT({ vocabSize: 50, blockSize: 16, nLayer: 3, nHead: 2, nEmbd: 32, dropout, bias: true, tieEmbeddings: true }, { initSeed: 5 });
  manualSeed(100);
  const losses: number[] = [];
  tidy(() => autocast(precision, () => withActivationCheckpoint(mode, () => {
    for (let mb = 0; mb < 2; mb++) {
      tidy(() => {
        const idx = randint(0, 50, [2, 16]);
        const { loss } = model.forward(idx, idx);
        loss!.div(2).backward();
        losses.push(loss!.item());
      });
    }
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

for (const precision of ['fp32', 'bf16-mixed'] as const) {
  test(`activation_checkpoint_full: gradients bit-identical to no checkpointing (${precision})`, () => {
    const before = liveTensors();
    const ref = run('none', precision);
    const ckpt = run('full', precision);
    assertBitIdentical(ckpt, ref);
    assert.equal(liveTensors(), before, 'no tensor handles leak');
  });
}

test('activation_checkpoint_full: dropout replays the same mask in the recompute', () => {
  // With dropout, checkpointing draws one seed per block, so the masks differ from a run without
  // it. A recompute with another mask would give gradients of a different function; the first
  // check that it does not: two runs agree bit for bit and every gradient is finite.
  const a = run('full', 'fp32', 0.2);
  const b = run('full', 'fp32', 0.2);
  assertBitIdentical(a, b);
  for (const [, g] of a.grads) assert.ok(g.every(Number.isFinite));
});

test('activation_checkpoint_selective: gradients equal to no checkpointing up to float32 rounding', () => {
  // Selective recompute reuses each Linear's output and forms its gradients by hand ([Note:
  // selective checkpointing]): the same math, not the same kernels, so a float32 rounding apart.
  const before = liveTensors();
  const ref = run('none', 'fp32');
  const sel = run('selective', 'fp32');
  for (let i = 0; i < ref.losses.length; i++) assert.equal(sel.losses[i], ref.losses[i], 'the forward is the same');
  for (const [name, g] of ref.grads) {
    const h = sel.grads.get(name)!;
    let d = 0, m = 0;
    for (let i = 0; i < g.length; i++) {
      d = Math.max(d, Math.abs(g[i]! - h[i]!));
      m = Math.max(m, Math.abs(g[i]!));
    }
    assert.ok(d <= 1e-5 * m, `${name}: max difference ${d} against scale ${m}`);
  }
  assert.equal(liveTensors(), before, 'no tensor handles leak');
});
