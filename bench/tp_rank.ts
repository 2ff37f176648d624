// One rank of the tensor-parallel benchmark: a GPT trained through parallelize() under each layout
// (dp=2, tp=2, tp=2 + sequence parallel, tp=2 + sequence + loss parallel) on the same global batch,
// AdamW, one intra-op thread. Per layout: step times, and the bytes the tensor-parallel collectives
// sent from this rank in the last step (tpTraffic, ring bus bytes). Prints one JSON line.
import * as ft from '../src/tensor/index.js';
import { GPT, type GPTConfig } from '../src/models/gpt.js';
import { gptCriterion, gptTensorPlan, gptUnits } from '../src/models/gpt_parallel.js';
import { AdamW } from '../src/optim/index.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { buildMesh, parallelize } from '../src/parallel/parallelize.js';
import { layoutFor, type LayoutRequest } from '../src/parallel/layout.js';
import { clipGradNorm } from '../src/parallel/grads.js';
import { resetTpTraffic, tpTraffic } from '../src/parallel/tensor_parallel/comm.js';

interface Opts { steps: number; warmup: number; model: GPTConfig; batch: number; seqLen: number; micro: number; layouts: [string, LayoutRequest][] }
const o = JSON.parse(process.argv[2]!) as Opts;
ft.setNumThreads(1);
const world = initProcessGroup();
const out: Record<string, unknown> = { rank: world.rank };
for (const [name, req] of o.layouts) {
  const layout = layoutFor(req, world.size);
  const mesh = buildMesh(layout, world);
  const model = parallelize(new GPT(o.model, { initSeed: 0 }), mesh, {
    layout, micro: o.micro, loss: gptCriterion, units: gptUnits, bucketSizeMb: 25,
    ...((layout.tp ?? 1) > 1 ? { tensorParallel: gptTensorPlan(layout) } : {}),
  });
  const opt = new AdamW(model.namedParameters().map(([, p]) => p), { lr: 1e-4 }, model.optimizerGrads ? { grads: model.optimizerGrads } : {});
  // The same global batch everywhere; each data-parallel rank takes its rows, tp ranks the same ones.
  ft.manualSeed(7);
  const x = ft.randint(0, o.model.vocabSize, [o.batch, o.seqLen]);
  const y = ft.randint(0, o.model.vocabSize, [o.batch, o.seqLen]);
  const rows = o.batch / layout.dp, b = rows / o.micro;
  const micro = Array.from({ length: o.micro }, (_, k) => ({ x: x.narrow(0, mesh.dpRank * rows + k * b, b), y: y.narrow(0, mesh.dpRank * rows + k * b, b) }));
  const times: number[] = [];
  let traffic = { ...tpTraffic };
  for (let i = 0; i < o.warmup + o.steps; i++) {
    world.barrier().wait();
    resetTpTraffic();
    const t0 = performance.now();
    ft.tidy(() => {
      opt.zeroGrad();
      model.step(micro);
      clipGradNorm(model.grads, 1);
      opt.step();
    });
    if (i >= o.warmup) times.push(performance.now() - t0);
    traffic = { ...tpTraffic };
  }
  out[name] = { times, traffic, held: model.namedParameters().reduce((a, [, p]) => a + p.numel(), 0), microRows: b };
  opt.dispose();
  model.dispose();
  for (const t of [x, y, ...micro.flatMap((m) => [m.x, m.y])]) t.dispose();
}
console.log('BENCH ' + JSON.stringify(out));
destroyProcessGroup();
