// One rank of the context-parallelism benchmark (bench/cp.ts). argv[2]: JSON Opts.
//
// Builds the GPT as the trainer does (parallelize, model.step, AdamW over the flat buckets) under
// the given layout, trains warm-up steps then timed steps on random tokens (the same global batch
// under every layout: a data-parallel rank reads its rows, the cp ranks of one data-parallel rank
// the same rows), and prints one line 'BENCH <json>': the step times and this process's peak
// resident memory (VmHWM) at the end, which includes loading libtorch and the model.
import * as ft from '../src/tensor/index.js';
import { modelSpec } from '../src/models/registry.js';
import { AdamW } from '../src/optim/index.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { buildMesh, parallelize } from '../src/parallel/parallelize.js';
import { layoutFor, type LayoutRequest } from '../src/parallel/layout.js';
import { processMemory } from '../src/parallel/data_parallel/memory.js';

export interface Opts {
  layout: LayoutRequest;
  warmup: number;
  steps: number;
  /** Sequences per step over all ranks, each seqLen tokens. */
  globalBatch: number;
  seqLen: number;
  model: { vocabSize: number; nLayer: number; nHead: number; nEmbd: number };
}
export interface RankOut { rank: number; stepMs: number[]; peakBytes: number; tokensPerRank: number }

const o = JSON.parse(process.argv[2]!) as Opts;
ft.setNumThreads(1);
const world = initProcessGroup();
const spec = modelSpec('gpt');
const cfg = { arch: 'gpt', ...o.model, blockSize: o.seqLen, dropout: 0, bias: true, tieEmbeddings: false, gelu: 'exact' };
const layout = layoutFor(o.layout, world.size);
const mesh = buildMesh(layout, world);
const model = parallelize(spec.build(cfg as never, { initSeed: 1234 }), mesh, { layout, micro: 1, loss: spec.loss, units: spec.units });
const opt = new AdamW(model.namedParameters().map(([, p]) => p), { lr: 3e-4, betas: [0.9, 0.95], weightDecay: 0.1 }, model.optimizerGrads ? { grads: model.optimizerGrads } : {});
const rows = o.globalBatch / layout.dp;
const stepMs: number[] = [];
for (let step = 0; step < o.warmup + o.steps; step++) {
  world.barrier().wait(); // every rank starts the step together: the times are the slowest rank's
  const t0 = performance.now();
  ft.tidy(() => {
    ft.manualSeed(100 + step);
    const batch = ft.randint(0, o.model.vocabSize, [o.globalBatch, o.seqLen + 1]).narrow(0, mesh.dpRank * rows, rows);
    opt.zeroGrad();
    model.step([{ x: batch.narrow(1, 0, o.seqLen).contiguous(), y: batch.narrow(1, 1, o.seqLen).contiguous() }]);
    opt.step();
  });
  if (step >= o.warmup) stepMs.push(performance.now() - t0);
}
const peakBytes = processMemory()?.peakBytes ?? NaN;
process.stdout.write(`BENCH ${JSON.stringify({ rank: world.rank, stepMs, peakBytes, tokensPerRank: (rows * o.seqLen) / (layout.cp ?? 1) } satisfies RankOut)}\n`);
opt.dispose();
model.dispose();
destroyProcessGroup();
