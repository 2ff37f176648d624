// One rank of the mixture-of-experts benchmark (bench/moe.ts). argv[2]: JSON Opts.
//
// mode 'single' (a world of one): a dense GPT and an MoE GPT of equal active parameters, each as
// the trainer runs it (parallelize, model.step, AdamW over the flat buckets), timed in alternating
// rounds in this one process.
// mode 'ep' (a world of two): the MoE GPT data parallel with every expert on both ranks (ep = 1) and
// with the experts split over the two ranks (ep = 2), both built here and timed in alternating
// rounds. For the ep = 2 model, the ep group's allToAll is wrapped to count the bytes each call
// sends to the other rank, and each MoE layer's dispatch to record the routing (rows per expert) it
// was given, from which the bench computes the count the layout implies.
// Prints one line 'BENCH <json>'.
import * as ft from '../src/tensor/index.js';
import { modelSpec } from '../src/models/registry.js';
import { AdamW } from '../src/optim/index.js';
import { moeLayers, defaultMoEConfig, type MoEConfig } from '../src/nn/moe.js';
import { initProcessGroup, destroyProcessGroup, type ProcessGroup } from '../src/distributed/process_group.js';
import { buildMesh, parallelize } from '../src/parallel/parallelize.js';
import { layoutFor, type LayoutRequest } from '../src/parallel/layout.js';
import type { ParallelModel } from '../src/parallel/parallel_model.js';

export interface Opts {
  mode: 'single' | 'ep';
  warmup: number;
  rounds: number;
  steps: number;
  batch: number;
  model: { vocabSize: number; blockSize: number; nLayer: number; nHead: number; nEmbd: number };
  moe: Partial<MoEConfig>;
}

/** Per timed step: whole step, forward + backward (with gradient sync), optimizer, in ms. */
export interface Timed { step: number[]; fwdBwd: number[]; opt: number[] }

/** What the ep = 2 model's all-to-alls moved and what the routing asked of them, per timed step on this rank. */
export interface Traffic {
  /** Bytes this rank's allToAll calls sent to the other rank(s): the row exchanges, and the per-expert count exchanges. */
  rowBytes: number[];
  countBytes: number[];
  calls: number[];
  /** Milliseconds from issuing each allToAll to the end of its wait(), summed. */
  a2aMs: number[];
  /** Rows this rank routed (forward) to experts held by another rank, summed over MoE layers. */
  remoteRows: number[];
  /** Rows this rank routed in all (kept assignments), summed over MoE layers. */
  routedRows: number[];
  /** MoE layers, and how many dispatches (forwards through an MoE layer) per step. */
  layers: number;
  dispatches: number[];
}

export interface RankOut {
  rank: number;
  params: Record<string, { total: number; active: number; experts: number }>;
  timed: Record<string, Timed>;
  traffic?: Traffic;
}

const o = JSON.parse(process.argv[2]!) as Opts;
ft.setNumThreads(1);
const world = initProcessGroup();
const spec = modelSpec('gpt');
const base = { arch: 'gpt', ...o.model, dropout: 0, bias: true, tieEmbeddings: false, gelu: 'exact' };
const moeCfg = { ...defaultMoEConfig, ...o.moe } as MoEConfig;

interface Built { model: ParallelModel; opt: AdamW; mesh: ReturnType<typeof buildMesh> }

function build(cfg: object, req: LayoutRequest): Built {
  const layout = layoutFor(req, world.size);
  const mesh = buildMesh(layout, world);
  const module = spec.build(cfg as never, { initSeed: 1234 });
  const model = parallelize(module, mesh, { layout, micro: 1, loss: spec.loss, units: spec.units });
  const opt = new AdamW(model.namedParameters().map(([, p]) => p), { lr: 3e-4, betas: [0.9, 0.95], weightDecay: 0.1 }, model.optimizerGrads ? { grads: model.optimizerGrads } : {});
  return { model, opt, mesh };
}

/** Total parameters of the whole model (experts counted on every ep rank), and those one token uses. */
function paramCounts(b: Built, ep: number): { total: number; active: number; experts: number } {
  let total = 0, inactive = 0, experts = 0;
  for (const [name, p] of b.model.namedParameters()) {
    const n = p.numel();
    const expert = /\.experts\./.test(name);
    const whole = expert ? n * ep : n;
    total += whole;
    if (expert) experts += whole;
    // A routed expert stack (E, ...): each token uses topK of its E experts.
    if (expert) inactive += (whole * (moeCfg.experts - moeCfg.topK)) / moeCfg.experts;
  }
  return { total, active: total - inactive, experts };
}

ft.manualSeed(1 + world.rank);
const data = ft.randint(0, o.model.vocabSize, [o.batch, o.model.blockSize + 1]);
const mb = [{ x: data.narrow(1, 0, o.model.blockSize).contiguous(), y: data.narrow(1, 1, o.model.blockSize).contiguous() }];

const models: [string, Built, number][] = o.mode === 'single'
  ? [['dense', build(base, {}), 1], ['moe', build({ ...base, moe: moeCfg }, {}), 1]]
  : [['ep1', build({ ...base, moe: moeCfg }, {}), 1], ['ep2', build({ ...base, moe: moeCfg }, { ep: 2 }), 2]];

// The ep = 2 model's traffic ([Note: expert parallelism] in src/parallel/expert_parallel.ts).
let traffic: Traffic | undefined;
let cur = { rowBytes: 0, countBytes: 0, calls: 0, a2aMs: 0, remoteRows: 0, routedRows: 0, dispatches: 0 };
if (o.mode === 'ep') {
  const b = models[1]![1];
  const ep = b.mesh.ep!;
  const layers = moeLayers(b.model.parts);
  traffic = { rowBytes: [], countBytes: [], calls: [], a2aMs: [], remoteRows: [], routedRows: [], layers: layers.length, dispatches: [] };
  const inner = ep.allToAll.bind(ep);
  (ep as { allToAll: ProcessGroup['allToAll'] }).allToAll = (output, input, outSplits, inSplits) => {
    const P = ep.size, rows = input.shape[0] ?? 1;
    const rowBytes = (input.numel() / Math.max(rows, 1)) * ft.elementSize(input.dtype);
    const sendRows = inSplits ?? new Array<number>(P).fill(rows / P);
    const bytes = sendRows.reduce((a, r, dst) => a + (dst === ep.rank ? 0 : r * rowBytes), 0);
    // The dispatch's count exchange is the call without splits ([Note: expert parallelism]).
    if (inSplits) cur.rowBytes += bytes;
    else cur.countBytes += bytes;
    cur.calls++;
    const t = performance.now();
    const work = inner(output, input, outSplits, inSplits);
    const wait = work.wait.bind(work);
    work.wait = () => {
      const r = wait();
      cur.a2aMs += performance.now() - t;
      return r;
    };
    return work;
  };
  for (const [, layer] of layers) {
    const d = layer.dispatch!;
    const run = d.run.bind(d);
    d.run = (l, rows, perExpert) => {
      const local = perExpert.length / ep.size, first = ep.rank * local;
      perExpert.forEach((n, e) => {
        cur.routedRows += n;
        if (e < first || e >= first + local) cur.remoteRows += n;
      });
      cur.dispatches++;
      return run(l, rows, perExpert);
    };
  }
}

const timed: Record<string, Timed> = Object.fromEntries(models.map(([k]) => [k, { step: [], fwdBwd: [], opt: [] }]));

async function steps(name: string, b: Built, n: number, record: boolean): Promise<void> {
  for (let i = 0; i < n; i++) {
    // The event loop runs between steps, as in the trainer (finalizers of disposed handles, bench/step.ts).
    await new Promise((res) => setImmediate(res));
    if (world.size > 1) world.barrier().wait();
    cur = { rowBytes: 0, countBytes: 0, calls: 0, a2aMs: 0, remoteRows: 0, routedRows: 0, dispatches: 0 };
    const t0 = performance.now();
    let t1 = 0;
    ft.tidy(() => {
      b.opt.zeroGrad();
      b.model.step(mb);
      t1 = performance.now();
      b.opt.step();
    });
    const t2 = performance.now();
    if (!record) continue;
    timed[name]!.step.push(t2 - t0);
    timed[name]!.fwdBwd.push(t1 - t0);
    timed[name]!.opt.push(t2 - t1);
    if (traffic && name === 'ep2') {
      traffic.rowBytes.push(cur.rowBytes);
      traffic.countBytes.push(cur.countBytes);
      traffic.calls.push(cur.calls);
      traffic.a2aMs.push(cur.a2aMs);
      traffic.remoteRows.push(cur.remoteRows);
      traffic.routedRows.push(cur.routedRows);
      traffic.dispatches.push(cur.dispatches);
    }
  }
}

for (const [name, b] of models) await steps(name, b, o.warmup, false);
for (let r = 0; r < o.rounds; r++) {
  // Alternate which model goes first, so neither always runs on a warmer (or busier) machine.
  const order = r % 2 === 0 ? models : [...models].reverse();
  for (const [name, b] of order) await steps(name, b, o.steps, true);
}

const params = Object.fromEntries(models.map(([k, b, ep]) => [k, paramCounts(b, ep)]));
const out: RankOut = { rank: world.rank, params, timed, ...(traffic ? { traffic } : {}) };
console.log(`BENCH ${JSON.stringify(out)}`);
for (const [, b] of models) {
  b.opt.dispose();
  b.model.dispose();
}
destroyProcessGroup();
