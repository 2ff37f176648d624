// [train] kernels = "fused" runs the GPT's LayerNorms and GELU and the Llama's RMSNorms, SwiGLU and
// rotary through the one-pass kernels ([Note: kernel choice]): a few float64 SGD steps of a tiny GPT
// (tanh GELU, no biases) and a tiny Llama (grouped-query heads, Qwen3's per-head norms) give the
// same losses and parameters as the eager ops, also under full activation checkpointing (the
// kernels run again in the recompute); under bf16-mixed the losses agree within bfloat16's rounding.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { getDefaultDtype, grad, manualSeed, noGrad, randint, setDefaultDtype, tidy, type Tensor } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { Llama } from '../src/models/llama.js';
import { withKernels, type KernelChoice } from '../src/nn/kernels/choice.js';
import { withActivationCheckpoint, type ActivationCheckpoint } from '../src/nn/checkpoint.js';
import { autocast, type Precision } from '../src/nn/precision.js';
import { assertClose } from './oracle/check.js';

const B = 2, T = 16, V = 40;
const models = [
  ['GPT (tanh GELU, no biases)', () => new GPT({ vocabSize: V, blockSize: T, nLayer: 2, nHead: 2, nEmbd: 20, gelu: 'tanh', bias: false }, { initSeed: 3 })],
  ['GPT (exact GELU, biases)', () => new GPT({ vocabSize: V, blockSize: T, nLayer: 1, nHead: 2, nEmbd: 20 }, { initSeed: 3 })],
  ['Llama (grouped-query heads, per-head norms)', () => new Llama({ vocabSize: V, blockSize: T, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 24, intermediateSize: 37, qkNorm: true, ropeScaling: 'none' }, { initSeed: 3 })],
] as const;

/** Losses of `steps` SGD steps from the model's initial parameters, and the parameters after them. */
function train(make: () => GPT | Llama, kernels: KernelChoice, checkpoint: ActivationCheckpoint, precision: Precision, steps: number): Tensor[] {
  const model = make();
  manualSeed(1);
  const losses: Tensor[] = [];
  for (let s = 0; s < steps; s++) {
    const idx = randint(0, V, [B, T]), targets = randint(0, V, [B, T]);
    const loss = autocast(precision, () => withActivationCheckpoint(checkpoint, () => withKernels(kernels, () => model.forward(idx, targets).loss!)));
    const gs = grad([loss], model.parameters());
    noGrad(() => model.parameters().forEach((p, i) => p.sub_(gs[i]!, 0.5)));
    losses.push(loss.detach());
  }
  const out = [...losses, ...model.parameters().map((p) => p.detach().clone())];
  model.dispose();
  return out;
}

for (const [name, make] of models) {
  test(`kernels = "fused": the ${name} trains as with the eager ops (float64, with and without full checkpointing; bf16-mixed losses)`, () => {
    const prev = getDefaultDtype();
    setDefaultDtype('float64');
    try {
      tidy(() => {
        const eager = train(make, 'eager', 'none', 'fp32', 3);
        for (const checkpoint of ['none', 'full'] as const) {
          const fused = train(make, 'fused', checkpoint, 'fp32', 3);
          assert.equal(fused.length, eager.length);
          fused.forEach((f, i) => assertClose(f, eager[i]!, { rtol: 1e-9, atol: 1e-12 }, `${checkpoint}: ${i < 3 ? `loss ${i}` : `parameter ${i - 3}`}`));
          assert.ok(fused.some((f, i) => f.sub(eager[i]!).abs().max().item() !== 0), 'the fused kernels computed something');
        }
      });
    } finally {
      setDefaultDtype(prev);
    }
    tidy(() => {
      const eager = train(make, 'eager', 'none', 'bf16-mixed', 2), fused = train(make, 'fused', 'none', 'bf16-mixed', 2);
      for (let i = 0; i < 2; i++) assertClose(fused[i]!, eager[i]!, { rtol: 2e-2 }, `bf16-mixed loss ${i}`);
    });
  });
}
