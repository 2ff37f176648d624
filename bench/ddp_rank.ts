// One rank of the data-parallel benchmark: the ~3M-parameter GPT, 8 x 128 tokens per rank, AdamW,
// one intra-op thread. Times full synced steps and compute-only steps (noSync) and prints JSON,
// with the CPU time every thread of this process spent in the compute-only steps (from
// /proc/self/task/<tid>/schedstat; the main thread runs the intra-op work, the others are V8's
// garbage-collector helpers, libuv and the collective backend's threads).
import * as ft from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { AdamW } from '../src/optim/index.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { DataParallel } from '../src/parallel/index.js';
import { readdirSync, readFileSync } from 'node:fs';

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

const { steps, warmup, bucketMb } = JSON.parse(process.argv[2] ?? '{}') as { steps: number; warmup: number; bucketMb: number };
ft.setNumThreads(1);
const world = initProcessGroup();
ft.manualSeed(0);
const model = new GPT({ vocabSize: 256, blockSize: 128, nLayer: 4, nHead: 8, nEmbd: 256, dropout: 0, bias: true });
const ddp = new DataParallel(model, { group: world, bucketSizeMb: bucketMb });
const opt = new AdamW(model.parameters(), { lr: 1e-4 });
ft.manualSeed(1 + world.rank);
const x = ft.randint(0, 256, [8, 128]);
const y = ft.randint(0, 256, [8, 128]);

function step(sync: boolean): { total: number; exposed: number } {
  const t0 = performance.now();
  let exposed = 0;
  ft.tidy(() => {
    const body = () => model.forward(x, y).loss!.backward();
    if (sync) {
      body();
      const t1 = performance.now();
      ddp.finishGradSync();
      exposed = performance.now() - t1;
    } else {
      ddp.noSync(body);
    }
    opt.step();
    opt.zeroGrad();
  });
  return { total: performance.now() - t0, exposed };
}

const synced: number[] = [], local: number[] = [], exposed: number[] = [];
let mainCpu = 0, otherCpu = 0;
for (let i = 0; i < warmup; i++) step(true);
for (let i = 0; i < steps; i++) {
  const s = step(true);
  synced.push(s.total);
  exposed.push(s.exposed);
  world.barrier().wait();
  const before = threadCpu();
  local.push(step(false).total);
  for (const [tid, ms] of threadCpu()) {
    const d = ms - (before.get(tid) ?? 0);
    if (tid === process.pid) mainCpu += d;
    else otherCpu += d;
  }
  world.barrier().wait();
}
const cpu = { main: mainCpu / steps, other: otherCpu / steps };
console.log('BENCH ' + JSON.stringify({ rank: world.rank, synced, local, exposed, cpu, params: model.numParams() }));
destroyProcessGroup();
