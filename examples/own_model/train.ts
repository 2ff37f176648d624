// Your own model under every layout: the MLP-Mixer of model.ts (not a GPT, with its own loss)
// trained by one loop whatever the layout; LAYOUT picks it:
//
//   node --import tsx examples/own_model/train.ts                          # one process
//   npx flotilla run --nproc 2 examples/own_model/train.ts                 # data parallel (LAYOUT=dp)
//   LAYOUT=zero3 npx flotilla run --nproc 2 examples/own_model/train.ts    # ZeRO-3, each MixerBlock a unit
//   LAYOUT=pp npx flotilla run --nproc 2 examples/own_model/train.ts       # 2 pipeline stages, 1F1B
//   LAYOUT=pp-zero2 npx flotilla run --nproc 4 examples/own_model/train.ts # pp=2 x ZeRO-2 over dp=2
//   LAYOUT=tp npx flotilla run --nproc 2 examples/own_model/train.ts       # tensor parallel 2 (mixerTensorPlan)
//   LAYOUT=tp-zero3 npx flotilla run --nproc 4 examples/own_model/train.ts # tp=2 x ZeRO-3 over dp=2
//
// Every layout prints the same losses as one process (test/parallel_user_model.test.ts checks it).
import { manualSeed, randn, setNumThreads, tensor, tidy, type Tensor } from '../../src/tensor/index.js';
import { AdamW } from '../../src/optim/index.js';
import { initProcessGroup, destroyProcessGroup } from '../../src/distributed/process_group.js';
import { buildMesh, clipGradNorm, layoutFor, parallelize, sequentialStages, unitsByClass, type LayoutRequest } from '../../src/parallel/index.js';
import { Mixer, MixerBlock, mixerLayer, mixerLoss, mixerTensorPlan, type MixerConfig } from './model.js';

const layouts: Record<string, LayoutRequest> = {
  dp: {}, zero3: { zero: 3 }, pp: { pp: 2, ppSchedule: '1f1b' }, 'pp-zero2': { pp: 2, zero: 2 }, tp: { tp: 2 }, 'tp-zero3': { tp: 2, zero: 3 },
};
const name = process.env.LAYOUT ?? 'dp';
const request = layouts[name];
if (!request) throw new Error(`LAYOUT=${name} is not one of ${Object.keys(layouts).join(', ')}`);

const world = initProcessGroup();
setNumThreads(1);
const layout = layoutFor(world.size === 1 ? {} : request, world.size);
const mesh = buildMesh(layout, world);

const cfg: MixerConfig = { tokens: 8, features: 4, dim: 32, blocks: 4, classes: 3 };
const seed = 1, micro = 4, globalBatch = 32;

// A pipeline rank builds only its layers (cut evenly; splitPoints moves the cuts); otherwise the
// whole model. The loss, the ZeRO-3 units and the tensor-parallel plan are the model's: parallelize
// knows nothing about it.
const own = layout.pp > 1
  ? sequentialStages({ layers: cfg.blocks + 2, layer: (i) => mixerLayer(cfg, seed, i), loss: mixerLoss })
  : new Mixer(cfg, seed);
const model = parallelize(own, mesh, { layout, micro, loss: mixerLoss, units: unitsByClass([MixerBlock]), tensorParallel: mixerTensorPlan });
const opt = new AdamW(model.namedParameters().map(([, p]) => p), { lr: 3e-3 }, model.optimizerGrads ? { grads: model.optimizerGrads } : {});

// The task: the class says whether the first feature's mean over the tokens is low, middling or high.
function batch(step: number): { x: Tensor; y: Tensor }[] {
  manualSeed(10_000 + step); // the same global batch on every rank; each reads its dp slice
  const x = randn([globalBatch, cfg.tokens, cfg.features]);
  const means = x.narrow(2, 0, 1).mean([1, 2]).toNumbers();
  const y = tensor(BigInt64Array.from(means, (m) => BigInt(m < -0.15 ? 0 : m < 0.15 ? 1 : 2)));
  const rows = globalBatch / layout.dp, b = rows / micro;
  return Array.from({ length: micro }, (_, k) => {
    const at = mesh.dpRank * rows + k * b;
    return { x: x.narrow(0, at, b), y: y.narrow(0, at, b) };
  });
}

for (let step = 0; step < 50; step++) {
  tidy(() => {
    opt.zeroGrad();
    const { loss } = model.step(batch(step)); // forward, backward, gradients reduced: any layout
    const { norm } = clipGradNorm(model.grads, 1.0);
    if (Number.isFinite(norm)) opt.step();
    if (world.rank === 0 && step % 10 === 9) console.log(`step ${step + 1}: loss ${loss.toFixed(4)}, grad norm ${norm.toFixed(4)}`);
  });
}
model.dispose();
opt.dispose();
destroyProcessGroup();
