// The executor: runs one rank's action list of a pipeline schedule (schedule.ts) for one step.
//
// [Note: pipeline execution]
// - Comm actions are issued non-blocking in list order: a RECV posts a receive into a fresh buffer
//   and is waited for just before the compute action that consumes it; a SEND starts and is waited
//   for at the end of the step (its tensor stays alive until then). Every message has its own tag,
//   derived from (direction, stage boundary, micro-batch) identically on both sides, so a pair can
//   never match the wrong message; the schedule's ordering guarantees no deadlock.
// - F runs the stage on its input: token ids on the first stage, else the received activation made
//   a leaf that requires grad (so backward leaves the gradient to send upstream in its .grad). The
//   last stage applies the criterion (gptLoss) and scales it by lossScale (1/m): the gradients of m
//   micro-batches are summed with 1/m each, which equals the full batch's mean-loss gradient.
// - B is one backward from the stage output (with the received output gradient) to every leaf.
// - I/W (zero bubble): I runs backward with inputs = [the stage input, the parameters not split],
//   so the engine runs only what the input gradient needs and skips the weight-gradient kernels of
//   the split Linear layers (their AccumulateGrad is not an input, so should_compute_output is false
//   for those edges). During F, a forward hook on each split Linear keeps its input x and a tensor
//   hook on its output captures dy when I computes it. W then forms dW = dy^T x and db = sum(dy) and
//   adds them to .grad (or, under ZeRO, to the bucket view: handGrads). Backward never runs twice over
//   the same graph.
// - Consecutive stages on the same rank (pp = 1) hand over locally, without comm actions.
// - Evaluation (runForward) runs the same list with only its F, RECV_F and SEND_F actions, under
//   noGrad: every F keeps its place relative to the other forwards, and each F depends only on
//   forwards that precede it in the full list too, so the filtered lists cannot deadlock either.
//   No input requires grad and the last stage keeps only the loss value.
import { Tensor, backward, empty, keep, noGrad, tidy } from '../../tensor/index.js';
import type { ProcessGroup, Work } from '../../distributed/process_group.js';
import { gptLoss } from '../../models/gpt.js';
import type { Action, PipelineSchedule } from './schedule.js';
import type { Stage } from './stage.js';

export interface MicroBatch {
  /** (b, T) int64 token ids; read by the first stage, its shape by every stage. */
  x: Tensor;
  /** (b, T) int64 targets; read by the last stage. */
  y: Tensor;
}

/** What one split Linear call left for W: its input and, after I, its output gradient. */
interface Capture {
  weight: Tensor;
  bias?: Tensor;
  x: Tensor;
  dy?: Tensor;
}

/** Per (stage, micro-batch) state between F and B (or I and W). */
interface Slot {
  input?: Tensor;
  /** The backward root: the stage output, or the scaled loss on the last stage. */
  root?: Tensor;
  captures?: Capture[];
  /** The gradient of the stage input, once B or I ran (not on the first stage). */
  inputGrad?: Tensor;
  /** The received gradient of the stage output. */
  outputGrad?: Tensor;
  done: boolean;
}

interface Posted {
  buf: Tensor;
  work: Work;
}

export interface ExecutorOptions {
  schedule: PipelineSchedule;
  /** This rank's pipeline rank (its rank in `group`). */
  rank: number;
  /** The pipeline group: group rank = pipeline rank. */
  group: ProcessGroup;
  /** This rank's stages by global index. */
  stages: Map<number, Stage>;
  nEmbd: number;
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
  private readonly nEmbd: number;
  private readonly handGrads: HandGrads | undefined;
  /** The split Linears' forward hooks append here while a zero-bubble F runs. */
  private capturing: Capture[] | undefined;
  private readonly removers: (() => void)[] = [];

  constructor(o: ExecutorOptions) {
    this.s = o.schedule;
    this.stages = o.stages;
    this.group = o.group;
    this.rank = o.rank;
    this.nEmbd = o.nEmbd;
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
    if (list === undefined) return;
    const c: Capture = { weight, bias, x: keep(x.detach()) };
    list.push(c);
    out.registerHook((g) => {
      c.dy = keep(g);
    });
  }

  /** Tag of a message over the boundary between stage e and e + 1 (unique per step). */
  private tag(dir: 'F' | 'B', edge: number, micro: number): number {
    return ((dir === 'F' ? 0 : 1) * this.s.numStages + edge) * this.s.micro + micro;
  }

  /**
   * Runs this rank's actions for one step. Returns the sum over micro-batches of the unscaled
   * loss where this rank holds the last stage, else 0.
   */
  run(micro: MicroBatch[], lossScale: number, trace?: TraceEvent[]): number {
    return this.execute(micro, lossScale, trace, false);
  }

  /**
   * Runs this rank's forward actions only, under noGrad (evaluation): the same activations travel
   * by the same sends and receives, nothing is kept for a backward. Returns the sum over
   * micro-batches of the loss where this rank holds the last stage, else 0.
   */
  runForward(micro: MicroBatch[]): number {
    return noGrad(() => this.execute(micro, 1, undefined, true));
  }

  private execute(micro: MicroBatch[], lossScale: number, trace: TraceEvent[] | undefined, forwardOnly: boolean): number {
    const m = this.s.micro;
    if (micro.length !== m) throw new Error(`pipeline step: the schedule was built for ${m} micro-batches, got ${micro.length}`);
    const [b, T] = micro[0]!.x.shape as [number, number];
    for (const [i, mb] of micro.entries()) {
      if (mb.x.ndim !== 2 || mb.x.shape[0] !== b || mb.x.shape[1] !== T || mb.y.shape.join('x') !== `${b}x${T}`) {
        throw new Error(`pipeline step: micro-batch ${i} has x [${mb.x.shape}] and y [${mb.y.shape}]; every micro-batch must be (${b}, ${T}) like the first (split the batch into equal parts)`);
      }
    }
    const dtype = this.stages.values().next().value!.params[0]!.dtype;
    const actShape = [b, T, this.nEmbd];
    const slots = new Map<string, Slot>();
    const slot = (stage: number, i: number): Slot => {
      const k = `${stage}:${i}`;
      let v = slots.get(k);
      if (!v) slots.set(k, (v = { done: false }));
      return v;
    };
    const recvF = new Map<string, Posted>();
    const recvB = new Map<string, Posted>();
    const sends: { work: Work; t: Tensor }[] = [];
    let lossSum = 0;
    const all = this.s.actions[this.rank]!;
    const actions = forwardOnly ? all.filter((a) => a.kind === 'F' || a.kind === 'RECV_F' || a.kind === 'SEND_F') : all;
    const owned: Tensor[] = []; // every tensor kept across actions, freed at the end

    const stageOf = (a: Action): Stage => {
      const st = this.stages.get(a.stage);
      if (!st) throw new Error(`stage ${a.stage} does not live on this rank`);
      return st;
    };
    let waited = 0; // ms the current action spent waiting for its receive (bubble, not compute)
    const take = (map: Map<string, Posted>, k: string, what: string): Tensor => {
      const p = map.get(k);
      if (!p) throw new Error(`no receive was posted for the ${what} it consumes`);
      map.delete(k);
      const w0 = trace ? performance.now() : 0;
      p.work.wait();
      if (trace) waited += performance.now() - w0;
      return p.buf;
    };

    try {
      actions.forEach((a, idx) => {
        const t0 = trace ? performance.now() : 0;
        waited = 0;
        try {
          switch (a.kind) {
            case 'RECV_F':
            case 'RECV_B': {
              const buf = owned[owned.push(empty(actShape, { dtype })) - 1]!;
              keep(buf);
              const edge = a.kind === 'RECV_F' ? a.stage - 1 : a.stage;
              const work = this.group.recv(buf, a.peer!, this.tag(a.kind === 'RECV_F' ? 'F' : 'B', edge, a.micro));
              (a.kind === 'RECV_F' ? recvF : recvB).set(`${a.stage}:${a.micro}`, { buf, work });
              break;
            }
            case 'SEND_F': {
              const t = keep(slot(a.stage, a.micro).root!.detach());
              owned.push(t);
              sends.push({ t, work: this.group.send(t, a.peer!, this.tag('F', a.stage, a.micro)) });
              break;
            }
            case 'SEND_B': {
              const t = slot(a.stage, a.micro).inputGrad!;
              sends.push({ t, work: this.group.send(t, a.peer!, this.tag('B', a.stage - 1, a.micro)) });
              break;
            }
            case 'F':
              lossSum += this.forward(stageOf(a), a, micro[a.micro]!, slot, recvF, take, lossScale, owned, forwardOnly);
              break;
            case 'B':
            case 'I':
              this.backward(stageOf(a), a, slot, recvB, take, owned);
              break;
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
        v.input?.dispose();
        v.root?.dispose();
        v.inputGrad?.dispose();
        for (const c of v.captures ?? []) {
          c.x.dispose();
          c.dy?.dispose();
        }
      }
      for (const t of owned) t.dispose();
      this.capturing = undefined;
    }
    return lossSum;
  }

  private forward(
    st: Stage, a: Action, mb: MicroBatch, slot: (s: number, i: number) => Slot,
    recvF: Map<string, Posted>, take: (m: Map<string, Posted>, k: string, what: string) => Tensor, lossScale: number,
    owned: Tensor[], forwardOnly: boolean,
  ): number {
    const sl = slot(a.stage, a.micro);
    let input: Tensor;
    if (st.isFirst) {
      input = mb.x;
    } else if (recvF.has(`${a.stage}:${a.micro}`)) {
      input = take(recvF, `${a.stage}:${a.micro}`, 'activation');
      if (!forwardOnly) input.requiresGrad_(true);
    } else {
      // Local hand-over from the previous stage on this rank: a fresh leaf over its output.
      const prev = slot(a.stage - 1, a.micro).root;
      if (!prev) throw new Error(`the output of stage ${a.stage - 1} is not here (neither received nor computed on this rank)`);
      input = keep(forwardOnly ? prev.detach() : prev.detach().requiresGrad_(true));
      owned.push(input);
    }
    sl.input = st.isFirst ? undefined : input;
    const capturing = !forwardOnly && st.splitLinears.length > 0 && this.removers.length > 0 ? (sl.captures = []) : undefined;
    this.capturing = capturing;
    let loss = 0;
    try {
      sl.root = tidy(() => {
        const out = st.module.call(input);
        if (!st.isLast) return keep(out);
        const l = gptLoss(out, mb.y);
        loss = l.item();
        return forwardOnly ? undefined : keep(l.mul(lossScale));
      });
    } finally {
      this.capturing = undefined;
    }
    return loss;
  }

  private backward(
    st: Stage, a: Action, slot: (s: number, i: number) => Slot,
    recvB: Map<string, Posted>, take: (m: Map<string, Posted>, k: string, what: string) => Tensor, owned: Tensor[],
  ): void {
    const sl = slot(a.stage, a.micro);
    if (!sl.root) throw new Error('its forward has not run');
    let gradOut: Tensor | undefined;
    if (!st.isLast) {
      if (recvB.has(`${a.stage}:${a.micro}`)) {
        gradOut = take(recvB, `${a.stage}:${a.micro}`, 'output gradient');
      } else {
        gradOut = slot(a.stage + 1, a.micro).inputGrad;
        if (!gradOut) throw new Error(`the input gradient of stage ${a.stage + 1} is not here (neither received nor computed on this rank)`);
      }
    }
    tidy(() => {
      if (a.kind === 'B') {
        backward([sl.root!], gradOut ? [gradOut] : undefined);
      } else {
        const inputs = [...(sl.input ? [sl.input] : []), ...st.inputPassParams];
        if (inputs.length === 0) throw new Error('the input-gradient pass has nothing to compute (a first stage with only split layers)');
        backward([sl.root!], gradOut ? [gradOut] : undefined, { inputs });
      }
    });
    sl.root!.dispose();
    sl.root = undefined;
    if (sl.input) {
      const g = sl.input.grad;
      if (!g) throw new Error('backward left no gradient for the stage input');
      sl.inputGrad = keep(g);
      owned.push(g);
    }
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
          this.accumulate(c.weight, dy.t().mm(x));
          if (c.bias) this.accumulate(c.bias, dy.sum(0));
        });
        c.x.dispose();
        c.dy.dispose();
      }
      sl.captures = undefined;
    });
  }

  /** param's gradient += g: into the data-parallel bucket (handGrads) or param.grad. */
  private accumulate(param: Tensor, g: Tensor): void {
    if (!this.handGrads) return accumulate(param, g);
    const v = this.handGrads.view(param);
    v.add_(g);
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
    param.grad = g.clone();
  }
}
