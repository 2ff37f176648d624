// One rank of the sharding benchmark: the GPT of bench/ddp_rank.ts (about 3.3M parameters),
// 8 x 128 tokens per rank, AdamW over flat pieces, one intra-op thread. For each ZeRO stage it
// times full steps (forward, backward with overlapped reduction, optimizer, parameter gathers) and
// reports the memory this rank holds. Prints one JSON line.
import * as ft from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { gptUnits } from '../src/models/gpt_parallel.js';
import { AdamW } from '../src/optim/index.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { DataParallel, type ZeroStage } from '../src/parallel/data_parallel/data_parallel.js';

const { steps, warmup, bucketMb, stages } = JSON.parse(process.argv[2] ?? '{}') as { steps: number; warmup: number; bucketMb: number; stages: ZeroStage[] };
ft.setNumThreads(1);
const world = initProcessGroup();
const out: Record<string, unknown> = { rank: world.rank };
for (const zero of stages) {
  const model = new GPT({ vocabSize: 256, blockSize: 128, nLayer: 4, nHead: 8, nEmbd: 256, dropout: 0, bias: true }, { initSeed: 0 });
  const dp = new DataParallel(model, { group: world, zero, bucketSizeMb: bucketMb, units: gptUnits });
  const opt = new AdamW(model.parameters(), { lr: 1e-4 }, { grads: dp });
  ft.manualSeed(1 + world.rank);
  const x = ft.randint(0, 256, [8, 128]);
  const y = ft.randint(0, 256, [8, 128]);
  const times: number[] = [];
  let peak = 0;
  for (let i = 0; i < warmup + steps; i++) {
    world.barrier().wait();
    const t0 = performance.now();
    ft.tidy(() => {
      opt.zeroGrad();
      dp.forward(x, y).loss!.backward();
      dp.finishGradSync();
      peak = Math.max(peak, dp.memory(opt.stateBytes()).peakBytes);
      opt.step();
    });
    if (i >= warmup) times.push(performance.now() - t0);
  }
  out[`zero${zero}`] = { times, memory: dp.memory(opt.stateBytes()), peak, numParams: model.numParams() };
  dp.dispose();
  opt.dispose();
  model.dispose();
  x.dispose();
  y.dispose();
}
console.log('BENCH ' + JSON.stringify(out));
destroyProcessGroup();
