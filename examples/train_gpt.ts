// Training a GPT by hand with flotilla's API: what `flotilla train` does, without the config file.
//
//   node --import tsx examples/train_gpt.ts                 # one process
//   npx flotilla run --nproc 2 examples/train_gpt.ts        # two data-parallel ranks, same result
//   ZERO=3 npx flotilla run --nproc 2 examples/train_gpt.ts # parameters, gradients and AdamW state sharded
//   (STEPS=N sets the step count; 100 by default)
import { setNumThreads, tidy } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { withKernels } from '../src/nn/kernels/choice.js';
import { AdamW, warmupCosine } from '../src/optim/index.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { DataParallel, clipGradNorm, type ZeroStage } from '../src/parallel/index.js';
import { DataLoader, loadTextDataset } from '../src/data/index.js';

const steps = Number(process.env.STEPS ?? 100);
const seqLen = 128;
const globalBatch = 16; // sequences per step over all ranks

// World: RANK, WORLD_SIZE, MASTER_ADDR/PORT come from the launcher; without them, a world of one.
const group = initProcessGroup();
setNumThreads(1);

// Data: bytes of Moby-Dick; every rank draws the same global batch and reads its own slice of it.
const data = loadTextDataset({ source: 'moby-dick', valFraction: 0.1, seqLen });
const loader = new DataLoader({ tokens: data.train, seqLen, globalBatch, dpRank: group.rank, dpSize: group.size, seed: 1337 });

// Model: weights drawn per parameter from the seed, so every rank (and every layout) starts equal.
const model = new GPT({ vocabSize: 256, blockSize: seqLen, nLayer: 4, nHead: 4, nEmbd: 128, dropout: 0, bias: true, tieEmbeddings: false }, { initSeed: 1337 });

// Parallelize before building the optimizer: DataParallel moves parameters and gradients into
// flat buckets and reduces each bucket while backward is still running (ZeRO 1-3 shard them).
const zero = Number(process.env.ZERO ?? 0) as ZeroStage;
const dp = new DataParallel(model, { group, zero });

// The optimizer steps over the pieces the wrapper hands it: flat buckets, or this rank's shards.
const opt = new AdamW(model.parameters(), { lr: 1e-3, betas: [0.9, 0.95], weightDecay: 0.1 }, { grads: dp });
const lrAt = warmupCosine({ warmupSteps: 10, maxSteps: steps, maxLr: 1e-3, minLr: 1e-4 });

for (let step = 0; step < steps; step++) {
  opt.lr = lrAt(step);
  // tidy frees every temporary tensor of the step; withKernels runs it on the fused kernels (the
  // attention, the loss from the hidden state, norms, activations, AdamW), as `flotilla train` does.
  const loss = tidy(() => withKernels('fused', () => {
    opt.zeroGrad();
    const { x, y } = loader.next();          // (B, T) int64, B = globalBatch / world size
    const { loss } = dp.forward(x, y);       // through the wrapper: ZeRO-3 gathers units around it
    loss!.backward();
    dp.finishGradSync();                     // gradients are now the average over ranks
    clipGradNorm(dp, 1.0);                   // the norm of the whole model's gradient
    opt.step();
    return loss!.item();                     // this rank's half of the batch when there are two
  }));
  if (group.rank === 0 && (step % 10 === 0 || step === steps - 1)) {
    console.log(`step ${String(step).padStart(3)}  loss ${loss.toFixed(4)}  lr ${opt.lr.toExponential(2)}`);
  }
}
dp.dispose();
destroyProcessGroup();
