// The executor: runs one rank's action list of a pipeline schedule (schedule.ts) for one step.
//
// [Note: pipeline execution]
// - Comm actions are issued non-blocking in list order: a RECV posts a receive into a fresh buffer
//   and is waited for just before the compute action that consumes it; a SEND starts and is waited
//   for at the end of the step (its tensor stays alive until then). Every message has its own tag,
//   derived from (direction, stage boundary, micro-batch) identically on both sides, so a pair can
//   never match the wrong message; the schedule's ordering guarantees no deadlock.
// - An activation travels as a small int64 header (per tensor: dtype, whether it carries a
//   gradient, shape) followed by its tensors, so stages may pass several tensors of any rank and
//   dtype ([Note: stage values] in model.ts). The receiver learns the shapes from the header; an
//   output gradient needs none, since it is shaped like the output this stage sent.
// - F runs the stage on its inputs: the micro-batch's x on the first stage, else the received
//   activations, those that carry a gradient made leaves that require grad (so backward leaves the
//   gradient to send upstream in their .grad). The last stage applies the criterion and turns its
//   sum into the backward root (`root`: divided by the global count over D, [Note: global loss
//   reduction] in ../loss_reduction.ts), so the summed gradients of the micro-batches are the
//   global batch's mean-loss gradient.
// - F, B and I run inside their micro-batch's documents (src/nn/documents.ts): a checkpointed
//   block's recompute in B or I sees the documents its forward saw. W recomputes nothing.
// - B is one backward from the stage outputs (with the received output gradients) to every leaf.
// - I/W (zero bubble): I runs backward with inputs = [the stage input, the parameters not split],
//   so the engine runs only what the input gradient needs and skips the weight-gradient kernels of
//   the split Linear layers (their AccumulateGrad is not an input, so should_compute_output is false
//   for those edges). During F, a forward hook on each split Linear keeps its input x and a tensor
//   hook on its output captures dy when I computes it. W then forms dW = dy^T x and db = sum(dy) and
//   adds them to .grad (or, under ZeRO, to the bucket view: handGrads). Backward never runs twice over
//   the same graph. Under activation checkpointing a block's forward records nothing and its
//   recompute forms all of the block's gradients at once, so the Linears inside checkpointed blocks
//   are not captured: their weights are inputs of I, and W finishes only the Linears outside them.
// - A stage none of whose outputs requires grad (every parameter up to its end frozen: a LoRA run
//   with adapters in later stages only) has an empty B or I, and the next stage sends it no
//   gradient (none of its inputs carries one). An output that is one of the stage's inputs passed
//   through gets a handle of its own, since outputs are disposed after backward.
// - Consecutive stages on the same rank (pp = 1) hand over locally, without comm actions.
// - Evaluation (runForward) runs the same list with only its F, RECV_F and SEND_F actions, under
//   noGrad: every F keeps its place relative to the other forwards, and each F depends only on
//   forwards that precede it in the full list too, so the filtered lists cannot deadlock either.
//   No input requires grad and the last stage keeps only the loss value (or what `read` makes of its output).
import { Tensor, backward, empty, keep, noGrad, tidy, tensor, zerosLike, isFloating, type DType } from '../../tensor/index.js';
import type { ProcessGroup, Work } from '../../distributed/process_group.js';
import type { Action, PipelineSchedule } from './schedule.js';
import type { Stage } from './stage.js';
import { asList, type Criterion, type MicroBatch, type StageValue } from '../parallel_model.js';
import { insideCheckpointedRegion } from '../../nn/checkpoint.js';
import { withDocuments } from '../../nn/documents.js';
import { addMetrics } from '../loss_reduction.js';

/** Tensors per activation message, and dimensions per tensor, that the header can describe. */
const MAX_TENSORS = 8, MAX_DIMS = 8;
const PER_TENSOR = 3 + MAX_DIMS;
const HEADER = 1 + MAX_TENSORS * PER_TENSOR;
const DTYPES: readonly DType[] = ['float32', 'float64', 'bfloat16', 'float16', 'int64', 'int32', 'int16', 'int8', 'uint8', 'bool'];

/** What a stage sends forward: the header describing its tensors. */
function encodeHeader(ts: readonly Tensor[], carriesGrad: readonly boolean[]): Tensor {
  if (ts.length > MAX_TENSORS) throw new Error(`a stage passes ${ts.length} tensors to the next; at most ${MAX_TENSORS} are supported (pack them into fewer)`);
  const h = new Array<number>(HEADER).fill(0);
  h[0] = ts.length;
  ts.forEach((t, i) => {
    if (t.ndim > MAX_DIMS) throw new Error(`a stage output has ${t.ndim} dimensions; at most ${MAX_DIMS} can travel between stages (reshape it)`);
    const o = 1 + i * PER_TENSOR;
    h[o] = DTYPES.indexOf(t.dtype);
    h[o + 1] = carriesGrad[i] ? 1 : 0;
    h[o + 2] = t.ndim;
    t.shape.forEach((d, k) => (h[o + 3 + k] = d));
  });
  return tensor(BigInt64Array.from(h, (v) => BigInt(v)));
}

function decodeHeader(t: Tensor): { dtype: DType; carriesGrad: boolean; shape: number[] }[] {
  const h = t.toNumbers();
  return Array.from({ length: h[0]! }, (_, i) => {
    const o = 1 + i * PER_TENSOR;
    return { dtype: DTYPES[h[o]!]!, carriesGrad: h[o + 1] === 1, shape: h.slice(o + 3, o + 3 + h[o + 2]!) };
  });
}

/** What one split Linear call left for W: its input and, after I, its output gradient. */
interface Capture {
  weight: Tensor;
  bias?: Tensor;
  x: Tensor;
  /** The Linear's output: an input of I, so that dy is computed even where nothing else needs it. */
  out: Tensor;
  dy?: Tensor;
}

/** Per (stage, micro-batch) state between F and B (or I and W). */
interface Slot {
  /** The stage inputs (not on the first stage), and which of them carry a gradient. */
  inputs?: Tensor[];
  inputCarriesGrad?: boolean[];
  /** The stage outputs (not on the last stage), kept for backward and the send. */
  outputs?: Tensor[];
  /** The last stage's scaled loss: its backward root. */
  loss?: Tensor;
  captures?: Capture[];
  /** The gradients of the inputs that carry one, once B or I ran. */
  inputGrads?: Tensor[];
  done: boolean;
}

/** A posted receive: its buffers and works (a forward message also has its header). */
interface Posted {
  header?: { buf: Tensor; work: Work; peer: number; edge: number; micro: number };
  bufs: Tensor[];
  works: Work[];
  carriesGrad: boolean[];
}

export interface ExecutorOptions {
  schedule: PipelineSchedule;
  /** This rank's pipeline rank (its rank in `group`). */
  rank: number;
  /** The pipeline group: group rank = pipeline rank. */
  group: ProcessGroup;
  /** This rank's stages by global index. */
  stages: Map<number, Stage>;
  /** The criterion the last stage applies to its output and the micro-batch. */
  criterion: Criterion;
  /**
   * Where W writes the weight gradients it forms by hand, when the parameters' gradients live in
   * a data-parallel wrapper's buckets (see [Note: pipeline x ZeRO] in pipeline_parallel.ts):
   * `view` gives the parameter's accumulating gradient, `written` records that it received one.
   * Default: param.grad.
   */
  handGrads?: HandGrads;
}

/** A gradient store W writes into (see ExecutorOptions.handGrads). */
export interface HandGrads {
  view(param: Tensor): Tensor;
  written(param: Tensor): void;
}

/** What the last stage's rank sums over a step's micro-batches (zero elsewhere). */
export interface StageSums {
  /** Σ criterion values. */
  value: number;
  metrics: Record<string, number>;
  /** With `read` (forward only): per micro-batch what read made of the last stage's output. */
  read: (Float64Array | undefined)[];
}

/** A micro-batch's backward root from its criterion sum (the loss scaled for the step). */
export type LossRoot = (loss: Tensor, mb: MicroBatch) => Tensor;

/** One compute action's wall-clock span (performance.now() milliseconds), for bubble measurements. */
export interface TraceEvent {
  kind: 'F' | 'B' | 'I' | 'W';
  stage: number;
  micro: number;
  start: number;
  end: number;
}

/** Where and why a step failed: the rank, the action and its position, for the error message. */
function describe(a: Action, i: number, rank: number): string {
  const peer = a.peer !== undefined ? ` (peer ${a.peer})` : '';
  return `pipeline rank ${rank}, action #${i} ${a.stage}${a.kind}${a.micro}${peer}`;
}

export class Executor {
  private readonly s: PipelineSchedule;
  private readonly stages: Map<number, Stage>;
  private readonly group: ProcessGroup;
  private readonly rank: number;
  private readonly criterion: Criterion;
  private readonly handGrads: HandGrads | undefined;
  /** The split Linears' forward hooks append here while a zero-bubble F runs. */
  private capturing: Capture[] | undefined;
  private readonly removers: (() => void)[] = [];

  constructor(o: ExecutorOptions) {
    this.s = o.schedule;
    this.stages = o.stages;
    this.group = o.group;
    this.rank = o.rank;
    this.criterion = o.criterion;
    this.handGrads = o.handGrads;
    if (this.s.actions.some((list) => list.some((a) => a.kind === 'I' || a.kind === 'W'))) {
      for (const st of this.stages.values()) {
        for (const l of st.splitLinears) {
          this.removers.push(l.module.registerForwardHook((_m, args, out) => this.capture(l.weight, l.bias, args[0] as Tensor, out as Tensor)));
        }
      }
    }
  }

  private capture(weight: Tensor, bias: Tensor | undefined, x: Tensor, out: Tensor): void {
    const list = this.capturing;
    // A Linear inside a checkpointed region gets its weight gradient from the region's node, in I
    // (its recompute or kept graph, see backward()): not captured.
    if (list === undefined || !out.requiresGrad || insideCheckpointedRegion()) return;
    // The head asked for the fused loss ([Note: deferred head]) returns a scalar, not dy's rows: its
    // kernel forms the weight gradient in its own backward, so it stays an input of I, unsplit.
    if (out.ndim !== x.ndim) return;
    const c: Capture = { weight, bias, x: keep(x.detach()), out: keep(out) };
    list.push(c);
    out.registerHook((g) => {
      c.dy = keep(g);
    });
  }

  /** Tag of part `part` of a message over the boundary between stage e and e + 1 (unique per step). */
  private tag(dir: 'F' | 'B', edge: number, micro: number, part: number): number {
    return (((dir === 'F' ? 0 : 1) * this.s.numStages + edge) * this.s.micro + micro) * (MAX_TENSORS + 1) + part;
  }

  /**
   * Runs this rank's actions for one step, each micro-batch's backward from root(its criterion
   * sum). Returns the criterion's sums where this rank holds the last stage, else zeros.
   */
  run(micro: MicroBatch[], root: LossRoot, trace?: TraceEvent[]): StageSums {
    return this.execute(micro, root, trace);
  }

  /**
   * Runs this rank's forward actions only, under noGrad (evaluation): the same activations travel
   * by the same sends and receives, nothing is kept for a backward. Returns the criterion's sums
   * where this rank holds the last stage, else zeros; with `read`, what it made of each last-stage
   * output instead (the criterion is not applied).
   */
  runForward(micro: MicroBatch[], read?: (out: StageValue, mb: MicroBatch) => Float64Array): StageSums {
    return noGrad(() => this.execute(micro, undefined, undefined, read));
  }

  /** root undefined: forward only (noGrad by the caller); read: what the last stage keeps of its outputs then. */
  private execute(micro: MicroBatch[], root: LossRoot | undefined, trace?: TraceEvent[], read?: (out: StageValue, mb: MicroBatch) => Float64Array): StageSums {
    const m = this.s.micro;
    if (micro.length !== m) throw new Error(`pipeline step: the schedule was built for ${m} micro-batches, got ${micro.length}`);
    const shapes = (mb: MicroBatch) => [...asList(mb.x), ...asList(mb.y)].map((t) => `[${t.shape.join(',')}]`).join(' ');
    const first = shapes(micro[0]!);
    for (const [i, mb] of micro.entries()) {
      if (shapes(mb) !== first) {
        throw new Error(`pipeline step: micro-batch ${i} has x, y shapes ${shapes(mb)}; every micro-batch must be shaped like the first (${first}): split the batch into equal parts`);
      }
    }
    const slots = new Map<string, Slot>();
    const slot = (stage: number, i: number): Slot => {
      const k = `${stage}:${i}`;
      let v = slots.get(k);
      if (!v) slots.set(k, (v = { done: false }));
      return v;
    };
    const recvF = new Map<string, Posted>();
    // A RECV_B posted before its forward ran (m < p) waits as its action: B posts it, with RECV_B's peer.
    const recvB = new Map<string, Posted | { deferred: Action }>();
    const sends: { work: Work; t: Tensor }[] = [];
    const sums: StageSums = { value: 0, metrics: {}, read: new Array<Float64Array | undefined>(m).fill(undefined) };
    const all = this.s.actions[this.rank]!;
    const actions = root === undefined ? all.filter((a) => a.kind === 'F' || a.kind === 'RECV_F' || a.kind === 'SEND_F') : all;
    const owned: Tensor[] = []; // every tensor kept across actions, freed at the end
    const own = (t: Tensor): Tensor => {
      owned.push(keep(t));
      return t;
    };

    const stageOf = (a: Action): Stage => {
      const st = this.stages.get(a.stage);
      if (!st) throw new Error(`stage ${a.stage} does not live on this rank`);
      return st;
    };
    // An output gradient is shaped like the output it belongs to: its receive is posted once that
    // output exists (at RECV_B, or when B needs it if the forward ran later in the list).
    const postGrads = (a: Action): Posted => {
      const outs = slot(a.stage, a.micro).outputs;
      if (!outs) throw new Error('its forward has not run, so the shapes of its output gradients are unknown');
      const bufs = outs.filter((o) => o.requiresGrad).map((o) => own(empty(o.shape, { dtype: o.dtype })));
      const works = bufs.map((b, j) => this.group.recv(b, a.peer!, this.tag('B', a.stage, a.micro, j)));
      return { bufs, works, carriesGrad: bufs.map(() => true) };
    };
    let waited = 0; // ms the current action spent waiting for its receive (bubble, not compute)
    const waitAll = (p: Posted): Tensor[] => {
      const w0 = trace ? performance.now() : 0;
      if (p.header) {
        // A forward message: the header says what follows; post those receives now.
        p.header.work.wait();
        const desc = decodeHeader(p.header.buf);
        const { peer, edge, micro } = p.header;
        p.bufs = desc.map((d) => own(empty(d.shape, { dtype: d.dtype })));
        p.works = p.bufs.map((b, j) => this.group.recv(b, peer, this.tag('F', edge, micro, j + 1)));
        p.carriesGrad = desc.map((d) => d.carriesGrad);
      }
      for (const w of p.works) w.wait();
      if (trace) waited += performance.now() - w0;
      return p.bufs;
    };

    try {
      actions.forEach((a, idx) => {
        const t0 = trace ? performance.now() : 0;
        waited = 0;
        try {
          switch (a.kind) {
            case 'RECV_F': {
              const edge = a.stage - 1;
              const buf = own(empty([HEADER], { dtype: 'int64' }));
              const work = this.group.recv(buf, a.peer!, this.tag('F', edge, a.micro, 0));
              recvF.set(`${a.stage}:${a.micro}`, { header: { buf, work, peer: a.peer!, edge, micro: a.micro }, bufs: [], works: [], carriesGrad: [] });
              break;
            }
            case 'RECV_B':
              recvB.set(`${a.stage}:${a.micro}`, slot(a.stage, a.micro).outputs ? postGrads(a) : { deferred: a });
              break;
            case 'SEND_F': {
              const outs = slot(a.stage, a.micro).outputs!;
              const carries = outs.map((o) => o.requiresGrad);
              const parts = [own(encodeHeader(outs, carries)), ...outs.map((o) => own(o.detach().contiguous()))];
              parts.forEach((t, j) => sends.push({ t, work: this.group.send(t, a.peer!, this.tag('F', a.stage, a.micro, j)) }));
              break;
            }
            case 'SEND_B':
              slot(a.stage, a.micro).inputGrads!.forEach((t, j) => sends.push({ t, work: this.group.send(t, a.peer!, this.tag('B', a.stage - 1, a.micro, j)) }));
              break;
            case 'F': {
              const mb = micro[a.micro]!;
              withDocuments(mb.docs, () => this.forward(stageOf(a), a, mb, slot, recvF, waitAll, root, own, read, sums));
              break;
            }
            case 'B':
            case 'I': {
              let gradOut: Tensor[] | undefined;
              if (!stageOf(a).isLast) {
                const posted = recvB.get(`${a.stage}:${a.micro}`);
                recvB.delete(`${a.stage}:${a.micro}`);
                if (posted) {
                  gradOut = waitAll('deferred' in posted ? postGrads(posted.deferred) : posted);
                } else {
                  gradOut = slot(a.stage + 1, a.micro).inputGrads;
                  if (!gradOut) throw new Error(`the input gradient of stage ${a.stage + 1} is not here (neither received nor computed on this rank)`);
                }
              }
              withDocuments(micro[a.micro]!.docs, () => this.backward(stageOf(a), a, slot, gradOut, own));
              break;
            }
            case 'W':
              this.weightGrads(slot(a.stage, a.micro));
              break;
          }
          if (trace && (a.kind === 'F' || a.kind === 'B' || a.kind === 'I' || a.kind === 'W')) {
            trace.push({ kind: a.kind, stage: a.stage, micro: a.micro, start: t0 + waited, end: performance.now() });
          }
        } catch (e) {
          const msg = e instanceof Error ? e.message : String(e);
          throw new Error(`${describe(a, idx, this.rank)} failed: ${msg}`, { cause: e });
        }
      });
      for (const { work } of sends) work.wait();
    } finally {
      // After a failure, sends may still be in flight: wait for those that can finish, then free.
      for (const { work } of sends) {
        try {
          work.wait();
        } catch {
          /* the step already failed; its error is the one reported */
        }
      }
      for (const v of slots.values()) {
        for (const t of [...(v.outputs ?? []), ...(v.loss ? [v.loss] : [])]) t.dispose();
        for (const c of v.captures ?? []) {
          c.x.dispose();
          c.out.dispose();
          c.dy?.dispose();
        }
      }
      for (const t of owned) t.dispose();
      this.capturing = undefined;
    }
    return sums;
  }

  private forward(
    st: Stage, a: Action, mb: MicroBatch, slot: (s: number, i: number) => Slot,
    recvF: Map<string, Posted>, waitAll: (p: Posted) => Tensor[], root: LossRoot | undefined,
    own: (t: Tensor) => Tensor, read: ((out: StageValue, mb: MicroBatch) => Float64Array) | undefined, sums: StageSums,
  ): void {
    const sl = slot(a.stage, a.micro);
    let inputs: Tensor[];
    if (st.isFirst) {
      inputs = asList(mb.x);
    } else {
      let carries: boolean[];
      const posted = recvF.get(`${a.stage}:${a.micro}`);
      if (posted) {
        recvF.delete(`${a.stage}:${a.micro}`);
        inputs = waitAll(posted);
        carries = posted.carriesGrad;
      } else {
        // Local hand-over from the previous stage on this rank: fresh leaves over its outputs.
        const prev = slot(a.stage - 1, a.micro).outputs;
        if (!prev) throw new Error(`the output of stage ${a.stage - 1} is not here (neither received nor computed on this rank)`);
        carries = prev.map((o) => o.requiresGrad);
        inputs = prev.map((o) => own(o.detach()));
      }
      sl.inputCarriesGrad = root === undefined ? inputs.map(() => false) : carries;
      inputs.forEach((t, i) => {
        if (sl.inputCarriesGrad![i]) t.requiresGrad_(true);
      });
      sl.inputs = inputs;
    }
    const capturing = root !== undefined && st.splitLinears.length > 0 && this.removers.length > 0 ? (sl.captures = []) : undefined;
    this.capturing = capturing;
    try {
      tidy(() => {
        const out = (st.module as unknown as { call: (...x: Tensor[]) => StageValue }).call(...inputs);
        if (!st.isLast) {
          // An output that is one of the stage's inputs (a value passed through, like the Mixer's
          // h0) gets a handle of its own: outputs are disposed after backward, and the input is
          // still read there for its gradient.
          const own = new Set(inputs);
          sl.outputs = asList(out).map((t) => keep(own.has(t) ? t.view(t.shape) : t));
          return;
        }
        if (read) {
          sums.read[a.micro] = read(out, mb);
          return;
        }
        const r = this.criterion.apply(out, mb);
        sums.value += r.value;
        addMetrics(sums.metrics, r.metrics);
        if (root) sl.loss = keep(root(r.loss, mb));
      });
    } finally {
      this.capturing = undefined;
    }
  }

  private backward(st: Stage, a: Action, slot: (s: number, i: number) => Slot, gradOut: Tensor[] | undefined, own: (t: Tensor) => Tensor): void {
    const sl = slot(a.stage, a.micro);
    if (!sl.loss && !sl.outputs) throw new Error('its forward has not run');
    const roots = st.isLast ? [sl.loss!] : sl.outputs!.filter((o) => o.requiresGrad);
    if (gradOut && gradOut.length !== roots.length) {
      throw new Error(`${gradOut.length} output gradient(s) for ${roots.length} output(s) that require grad`);
    }
    const carrying = (sl.inputs ?? []).filter((_, i) => sl.inputCarriesGrad![i]);
    tidy(() => {
      // A stage none of whose outputs requires grad (every parameter before the next stage frozen,
      // as in a LoRA run with adapters in later stages only) has no gradient to form: its
      // backward is empty, and the next stage sent it no output gradient.
      if (roots.length === 0) return;
      if (a.kind === 'B') {
        backward(roots, gradOut);
      } else {
        // The split Linears' outputs are inputs too: a Linear whose input needs no gradient (on the
        // first stage) would otherwise get no dy, which W needs for dW = dy^T x.
        // Split Linears inside checkpointed blocks were not captured: their parameters join I's
        // inputs, since the block's recompute forms every gradient of the block at once.
        const captured = new Set((sl.captures ?? []).map((c) => c.weight));
        const inCheckpoint = st.splitLinears.filter((l) => !captured.has(l.weight)).flatMap((l) => (l.bias ? [l.weight, l.bias] : [l.weight])).filter((p) => p.requiresGrad);
        const inputs = [...carrying, ...st.inputPassParams, ...inCheckpoint, ...(sl.captures ?? []).map((c) => c.out)];
        if (inputs.length === 0) throw new Error('the input-gradient pass has nothing to compute (a first stage with only split layers)');
        backward(roots, gradOut, { inputs });
      }
    });
    for (const t of [...(sl.outputs ?? []), ...(sl.loss ? [sl.loss] : [])]) t.dispose();
    sl.outputs = undefined;
    sl.loss = undefined;
    // An input the stage did not use gets a zero gradient: the previous stage still waits for one.
    sl.inputGrads = carrying.map((x) => own(x.grad ?? zerosLike(x)));
    sl.done = true;
  }

  /** W: dW = dy^T x and db = sum(dy) from the captures of F and I, added to .grad. */
  private weightGrads(sl: Slot): void {
    if (!sl.done) throw new Error('its input-gradient pass I has not run');
    noGrad(() => {
      for (const c of sl.captures ?? []) {
        if (!c.dy) throw new Error('a split Linear received no output gradient in I');
        tidy(() => {
          const out = c.dy!.shape[c.dy!.ndim - 1]!, inn = c.x.shape[c.x.ndim - 1]!;
          const dy = c.dy!.reshape(-1, out), x = c.x.reshape(-1, inn);
          // Under bf16-mixed the Linear ran in bfloat16 on its input cast (src/nn/precision.ts): so does
          // its weight gradient, converted to the float32 gradient as autograd's copy node does.
          // A frozen weight or bias (requiresGrad = false) gets no gradient.
          if (c.weight.requiresGrad) this.accumulate(c.weight, dy.t().mm(x.to(dy.dtype)));
          if (c.bias?.requiresGrad) this.accumulate(c.bias, dy.sum(0));
        });
        c.x.dispose();
        c.out.dispose();
        c.dy.dispose();
      }
      sl.captures = undefined;
    });
  }

  /** param's gradient += g: into the data-parallel bucket (handGrads) or param.grad. */
  private accumulate(param: Tensor, g: Tensor): void {
    if (!this.handGrads) return accumulate(param, g);
    const v = this.handGrads.view(param);
    v.add_(g); // a bf16 g is widened by add_ itself
    v.dispose();
    this.handGrads.written(param);
  }

  dispose(): void {
    for (const r of this.removers) r();
    this.removers.length = 0;
  }
}

/** param.grad += g (in place when .grad exists: it may be a view of a flat buffer). */
function accumulate(param: Tensor, g: Tensor): void {
  const cur = param.grad;
  if (cur) {
    cur.add_(g);
    cur.dispose();
  } else {
    param.grad = g.dtype === param.dtype ? g.clone() : g.to(param.dtype);
  }
}
