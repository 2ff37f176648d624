// One process that trains a few GPT steps in a given precision and activation-checkpoint mode, for
// measuring its peak resident memory from outside (bench/precision.ts, test/checkpointing_activation_memory.test.ts).
//
//   node --import tsx bench/precision_child.ts '{"nLayer":8,"nEmbd":256,"batch":8,"seq":128,"precision":"fp32","ac":"full","steps":3}'
//
// Prints "done" after the steps, then waits for stdin to close so the parent can read VmHWM.
import { randint, manualSeed, releaseIdleMemory, setNumThreads, tidy } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { AdamW } from '../src/optim/index.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { initProcessGroup } from '../src/distributed/process_group.js';
import { autocast, type Precision } from '../src/nn/precision.js';
import { withActivationCheckpoint, type ActivationCheckpoint } from '../src/nn/checkpoint.js';

const o = JSON.parse(process.argv[2] ?? '{}') as { nLayer: number; nEmbd: number; batch: number; seq: number; precision: Precision; ac: ActivationCheckpoint; steps: number };
setNumThreads(1);
manualSeed(0);
const model = new GPT({ vocabSize: 256, blockSize: Math.max(o.seq, 8), nLayer: o.nLayer, nHead: 8, nEmbd: o.nEmbd, dropout: 0, bias: true, tieEmbeddings: false });
const idx = randint(0, 256, [o.batch, o.seq]);
const dp = new DataParallel(model, { group: initProcessGroup() });
const opt = new AdamW(model.parameters(), { lr: 3e-4 }, { grads: dp });
for (let s = 0; s < o.steps; s++) {
  tidy(() => {
    opt.zeroGrad();
    autocast(o.precision, () => withActivationCheckpoint(o.ac, () => {
      const { loss } = dp.forward(idx, idx);
      loss!.backward();
      dp.finishGradSync();
    }));
    opt.step();
  });
  releaseIdleMemory(); // as the trainer does after every step
  await new Promise((r) => setImmediate(r));
}
process.stdout.write('done\n');
process.stdin.resume();
process.stdin.on('end', () => process.exit(0));
