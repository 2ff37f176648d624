// One rank of the pipeline benchmark (bench/pipeline.ts). argv[2]: JSON options; prints one BENCH line.
//   bubble: every schedule x m on pp = world; per measured step the bubble fraction from the
//           executor's trace: 1 - (sum of compute spans over ranks) / (pp x makespan), where a rank's
//           span runs from the step's start (after a barrier) to its last compute action's end and
//           the makespan is the longest span.
//   memory: one schedule; resident memory before the first step and the peak (maxRSS) after the
//           steps, without an optimizer (its state would blur the activations).
//   step:   training steps (forward, backward, AdamW) of pp = 2 or of DataParallel on the same
//           ranks and the same global batch; wall time per step.
import * as ft from '../src/tensor/index.js';
import { GPT, type GPTConfig } from '../src/models/gpt.js';
import { gptPipeline } from '../src/models/gpt_parallel.js';
import { AdamW } from '../src/optim/index.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { DataParallel } from '../src/parallel/data_parallel/data_parallel.js';
import { PipelineParallel, buildSchedule, simulate, theoreticalBubble, peakActivations, type ScheduleName, type TraceEvent } from '../src/parallel/pipeline/index.js';

interface Opts {
  mode: 'bubble' | 'memory' | 'step';
  cfg: GPTConfig;
  /** Rows per micro-batch (pipeline) */
  b: number;
  T: number;
  steps: number;
  warmup: number;
  schedules: { name: ScheduleName; v: number }[];
  micros: number[];
  /** step mode: 'pp' or 'dp' */
  layout?: 'pp' | 'dp';
}
const o = JSON.parse(process.argv[2]!) as Opts;
ft.setNumThreads(1);
const world = initProcessGroup();

function batches(m: number, rows: number, seed: number): { x: ft.Tensor; y: ft.Tensor }[] {
  ft.manualSeed(seed);
  return Array.from({ length: m }, () => {
    const d = ft.keep(ft.randint(0, o.cfg.vocabSize, [rows, o.T + 1]));
    return { x: ft.keep(d.narrow(1, 0, o.T).contiguous()), y: ft.keep(d.narrow(1, 1, o.T).contiguous()) };
  });
}

function bubbleOf(trace: TraceEvent[], start: number): { busy: number; span: number } {
  const busy = trace.reduce((a, e) => a + (e.end - e.start), 0);
  const span = Math.max(...trace.map((e) => e.end)) - start;
  return { busy, span };
}

const out: Record<string, unknown> = { rank: world.rank };
if (o.mode === 'bubble') {
  // One-way time of an activation-sized message (b x T x C float32) between the two ranks: the
  // theory counts communication as free; every hop on the critical path costs about this much.
  {
    const msg = ft.zeros([o.b, o.T, o.cfg.nEmbd]);
    const peer = 1 - world.rank;
    const rounds = 20;
    world.barrier().wait();
    const t0 = performance.now();
    for (let i = 0; i < rounds; i++) {
      if (world.rank === 0) {
        world.send(msg, peer, i).wait();
        world.recv(msg, peer, i).wait();
      } else {
        world.recv(msg, peer, i).wait();
        world.send(msg, peer, i).wait();
      }
    }
    out.oneWayMs = (performance.now() - t0) / (2 * rounds);
    out.messageBytes = msg.numel() * 4;
    msg.dispose();
  }
  const rows: unknown[] = [];
  for (const s of o.schedules) {
    for (const m of o.micros) {
      const pp = new PipelineParallel(gptPipeline(o.cfg, { initSeed: 1 }), { pp: world, schedule: s.name, virtualStages: s.v, micro: m });
      const mbs = batches(m, o.b, 7);
      const measured: number[] = [];
      const kindMs: Record<'F' | 'B' | 'I' | 'W', number[]> = { F: [], B: [], I: [], W: [] };
      for (let i = 0; i < o.warmup + o.steps; i++) {
        const trace: TraceEvent[] = [];
        world.barrier().wait();
        const start = performance.now();
        ft.tidy(() => pp.step(mbs, { trace }));
        const { busy, span } = bubbleOf(trace, start);
        const t = ft.tensor([busy, span], { dtype: 'float64' });
        const busyAll = ft.tensor([busy], { dtype: 'float64' });
        world.allReduce(busyAll, 'sum').wait();
        const spanMax = ft.tensor([span], { dtype: 'float64' });
        world.allReduce(spanMax, 'max').wait();
        if (i >= o.warmup) {
          measured.push(1 - busyAll.item() / (world.size * spanMax.item()));
          for (const e of trace) kindMs[e.kind].push(e.end - e.start);
        }
        for (const x of [t, busyAll, spanMax]) x.dispose();
        ft.noGrad(() => pp.parameters().forEach((p) => p.grad?.zero_()));
      }
      const sched = buildSchedule(s.name, { pp: world.size, micro: m, virtualStages: s.name === 'interleaved' ? s.v : undefined });
      // The same table simulated with this run's measured mean costs (both ranks, 0.25 ms slots):
      // what the schedule predicts once F, B, I and W are not the unit costs of the theory.
      const mean = (k: 'F' | 'B' | 'I' | 'W'): number => {
        const t = ft.tensor([kindMs[k].reduce((a, b) => a + b, 0), kindMs[k].length], { dtype: 'float64' });
        world.allReduce(t, 'sum').wait();
        const [sum, n] = t.toNumbers() as [number, number];
        t.dispose();
        return n > 0 ? sum / n : 0;
      };
      const ms = { F: mean('F'), B: mean('B'), I: mean('I'), W: mean('W') };
      const slot = (x: number) => Math.max(1, Math.round(x / 0.25));
      rows.push({
        schedule: s.name, v: s.v, m, measured, costsMs: ms,
        simulatedMeasuredCosts: simulate(sched, { F: slot(ms.F), B: slot(ms.B), I: slot(ms.I), W: slot(ms.W) }).bubbleFraction,
        simulated: simulate(sched).bubbleFraction,
        theory: theoreticalBubble(s.name, world.size, m, s.v),
      });
      pp.dispose();
    }
  }
  out.rows = rows;
} else if (o.mode === 'memory') {
  const s = o.schedules[0]!, m = o.micros[0]!;
  const pp = new PipelineParallel(gptPipeline(o.cfg, { initSeed: 1 }), { pp: world, schedule: s.name, virtualStages: s.v, micro: m });
  const mbs = batches(m, o.b, 7);
  const before = process.memoryUsage().rss;
  for (let i = 0; i < o.steps; i++) ft.tidy(() => pp.step(mbs));
  const peak = process.resourceUsage().maxRSS * 1024;
  out.memory = { schedule: s.name, m, before, peak, activationsHeld: peakActivations(pp.schedule)[world.rank] };
  pp.dispose();
} else {
  // step: the same global batch of micros[0] x b rows either way.
  const m = o.micros[0]!, s = o.schedules[0]!;
  const times: number[] = [];
  if (o.layout === 'pp') {
    const pp = new PipelineParallel(gptPipeline(o.cfg, { initSeed: 1 }), { pp: world, schedule: s.name, virtualStages: s.v, micro: m });
    const opt = new AdamW(pp.parameters(), { lr: 1e-4 });
    const mbs = batches(m, o.b, 7);
    for (let i = 0; i < o.warmup + o.steps; i++) {
      world.barrier().wait();
      const t0 = performance.now();
      ft.tidy(() => {
        pp.step(mbs);
        opt.step();
        opt.zeroGrad();
      });
      if (i >= o.warmup) times.push(performance.now() - t0);
    }
    pp.dispose();
  } else {
    // Data parallel: each rank the whole model on half the global batch, with flotilla's
    // DataParallel (bucketed all-reduce overlapped with backward, 2 MiB buckets).
    const model = new GPT(o.cfg, { initSeed: 1 });
    const ddp = new DataParallel(model, { group: world, bucketSizeMb: 2 });
    const opt = new AdamW(model.parameters(), { lr: 1e-4 });
    const all = batches(1, (m * o.b), 7)[0]!;
    const half = (m * o.b) / world.size;
    const x = all.x.narrow(0, world.rank * half, half), y = all.y.narrow(0, world.rank * half, half);
    for (let i = 0; i < o.warmup + o.steps; i++) {
      world.barrier().wait();
      const t0 = performance.now();
      ft.tidy(() => {
        model.forward(x, y).loss!.backward();
        ddp.finishGradSync();
        opt.step();
        opt.zeroGrad();
      });
      if (i >= o.warmup) times.push(performance.now() - t0);
    }
    model.dispose();
  }
  out.times = times;
}
console.log('BENCH ' + JSON.stringify(out));
destroyProcessGroup();
