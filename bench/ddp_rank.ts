// One rank of the data-parallel benchmark: the ~3M-parameter GPT, 8 x 128 tokens per rank, AdamW,
// one intra-op thread. Times full synced steps and compute-only steps (noSync) and prints JSON,
// as the trainer runs it (flat buckets, AdamW over them),
// with the CPU time every thread of this process spent in the compute-only steps (from
// /proc/self/task/<tid>/schedstat; the main thread runs the intra-op work, the others are V8's
// garbage-collector helpers, libuv and the collective backend's threads).
import * as ft from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { AdamW } from '../src/optim/index.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { DataParallel } from '../src/parallel/index.js';
import { readdirSync, readFileSync } from 'node:fs';
import { median } from './report.js';
import { autocast, type Precision } from '../src/nn/precision.js';

/** CPU milliseconds each thread of this process has run, by thread id. */
function threadCpu(): Map<number, number> {
  const m = new Map<number, number>();
  for (const t of readdirSync('/proc/self/task')) {
    try {
      m.set(Number(t), Number(readFileSync(`/proc/self/task/${t}/schedstat`, 'utf8').split(' ')[0]) / 1e6);
    } catch {
      // the thread ended
    }
  }
  return m;
}

const { steps, warmup, bucketMb, precision = 'fp32' } = JSON.parse(process.argv[2] ?? '{}') as { steps: number; warmup: number; bucketMb: number; precision?: Precision };
ft.setNumThreads(1);
const world = initProcessGroup();
ft.manualSeed(0);
const model = new GPT({ vocabSize: 256, blockSize: 128, nLayer: 4, nHead: 8, nEmbd: 256, dropout: 0, bias: true });
const ddp = new DataParallel(model, { group: world, bucketSizeMb: bucketMb });
// The trainer's optimizer: AdamW over the flat gradient buckets ([Note: flat step]).
const opt = new AdamW(model.parameters(), { lr: 1e-4 }, { grads: ddp });
ft.manualSeed(1 + world.rank);
const x = ft.randint(0, 256, [8, 128]);
const y = ft.randint(0, 256, [8, 128]);

/** A synced step: [whole step, time waiting in finishGradSync, optimizer step] in ms. */
function syncedStep(): [number, number, number] {
  const t0 = performance.now();
  let t1 = 0, t2 = 0, t3 = 0;
  ft.tidy(() => {
    opt.zeroGrad();
    autocast(precision, () => model.forward(x, y).loss!.backward());
    t1 = performance.now();
    ddp.finishGradSync();
    t2 = performance.now();
    opt.step();
    t3 = performance.now();
  });
  return [performance.now() - t0, t2 - t1, t3 - t2];
}

/**
 * Forward and backward with gradient sync off, in ms. The optimizer reads gradients only after a
 * finishGradSync(), so a compute-only step is this plus the optimizer time of the synced steps (the
 * same update over the same buckets); the PyTorch peer is timed the same way.
 */
function localPass(): number {
  const t0 = performance.now();
  ft.tidy(() => {
    opt.zeroGrad();
    ddp.noSync(() => autocast(precision, () => model.forward(x, y).loss!.backward()));
  });
  return performance.now() - t0;
}

const synced: number[] = [], passes: number[] = [], exposed: number[] = [], optMs: number[] = [];
let mainCpu = 0, otherCpu = 0;
for (let i = 0; i < warmup; i++) syncedStep();
for (let i = 0; i < steps; i++) {
  const [total, wait, o] = syncedStep();
  synced.push(total);
  exposed.push(wait);
  optMs.push(o);
  world.barrier().wait();
  const before = threadCpu();
  passes.push(localPass());
  for (const [tid, ms] of threadCpu()) {
    const d = ms - (before.get(tid) ?? 0);
    if (tid === process.pid) mainCpu += d;
    else otherCpu += d;
  }
  world.barrier().wait();
}
const optMedian = median(optMs);
const local = passes.map((p) => p + optMedian);
const cpu = { main: mainCpu / steps, other: otherCpu / steps };
console.log('BENCH ' + JSON.stringify({ rank: world.rank, synced, local, exposed, opt: optMs, cpu, params: model.numParams() }));
destroyProcessGroup();
