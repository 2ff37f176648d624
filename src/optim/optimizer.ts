// Base optimizer: parameter groups, and a step over flat ranges.
//
// [Note: flat step] The optimizer updates StepPieces (src/parallel/grads.ts): contiguous ranges of
// parameter values with their gradients. A gradient source (DataParallel in any mode) hands it one
// piece per bucket, or per bucket shard when the optimizer state is sharded, so a step is a
// handful of kernel calls per bucket and a sharded optimizer is the same optimizer on fewer
// elements. Without a source, each parameter with a .grad is its own piece. Within a piece, the
// segments that share hyper-parameters and update count are updated together ("runs"); a
// parameter that received no gradient on any rank this step (the source says which) is skipped:
// no decay, no moment update, no step count. State tensors are kept per piece and saved per
// parameter by name.
import { Tensor, noGrad, keep, tidy, tensor } from '../tensor/index.js';
import type { GradientSource, StepPiece } from '../parallel/grads.js';
import { kernelChoice } from '../nn/kernels/choice.js';

export interface ParamGroup<O> {
  params: Tensor[];
  options: O;
}

export type ParamsArg<O> = Tensor[] | { params: Tensor[]; options?: Partial<O> }[];

export interface OptimizerExtras {
  /**
   * Where gradients come from and which ranges this rank updates (a DataParallel wrapper under any
   * ZeRO stage). Needed when gradients are sharded; optional otherwise.
   */
  grads?: GradientSource;
}

/** The part of a run an update sees: flat views of parameter values, gradient and state. */
export interface UpdateRun {
  param: Tensor;
  grad: Tensor;
  state: Record<string, Tensor>;
  /** The update count of these parameters including this one (1 on their first update). */
  step: number;
  /**
   * Weight decay: one number for the run, or, where the run mixes groups, the ranges of uniform
   * decay that make it up (relative to the run's views, in order, covering them).
   */
  weightDecay: number | DecayRange[];
  /**
   * What the gradient is multiplied by as the update reads it (clipping's factor, [Note: folded
   * clip] in native/optim.cc). Only the one-pass updates read it: before an op-by-op update the
   * step has already scaled `grad` in place, and hands 1.
   */
  gradScale: number;
}

/** A range [start, start + numel) of an update run's elements that shares one weight decay. */
export interface DecayRange {
  start: number;
  numel: number;
  decay: number;
}

interface Run {
  start: number;
  numel: number;
  group: number;
  step: number;
  params: Tensor[];
  decays: number[];
}

/**
 * Elements per update chunk ([Note: update chunks]): 1 MiB per float32 array. Measured on AdamW over a
 * 3.3M-element bucket: 5.0 ms a step at 2^18, 6.1 ms unchunked; smaller chunks pay more per-call cost
 * than they save (6.9 ms at 2^15).
 */
export const UPDATE_CHUNK = 262144;

export type OptimizerState = { step: number; state: Record<string, Record<string, Tensor>> };

export abstract class Optimizer<O extends { lr: number }> {
  readonly groups: ParamGroup<O>[];
  stepCount = 0;
  protected readonly grads: GradientSource | undefined;
  private readonly groupOf = new Map<Tensor, number>();
  private readonly steps = new Map<Tensor, number>();
  private readonly pieceState = new Map<string, Record<string, Tensor>>();
  // The layout of every piece that has state (names and ranges outlive the tensors handed in).
  private readonly pieceMeta = new Map<string, Pick<StepPiece, 'segments' | 'owned'>>();

  constructor(params: ParamsArg<O>, defaults: O, extras: OptimizerExtras = {}) {
    // An empty list is one empty group, so the learning rate still reads and schedules still set it.
    const list = params.length === 0 || params[0] instanceof Tensor
      ? [{ params: params as Tensor[] }]
      : (params as { params: Tensor[]; options?: Partial<O> }[]);
    this.groups = list.map((g) => ({ params: g.params, options: { ...defaults, ...(g as { options?: Partial<O> }).options } }));
    // No parameters is allowed: a pipeline rank whose stages hold nothing that trains (a LoRA run
    // with adapters in later stages only) steps nothing, and still joins its gradient source's
    // collectives with the other ranks.
    const all = this.groups.flatMap((g) => g.params);
    if (new Set(all).size !== all.length) throw new Error('a parameter appears in more than one group');
    this.groups.forEach((g, i) => g.params.forEach((p) => this.groupOf.set(p, i)));
    this.grads = extras.grads;
  }

  /** Learning rate of every group (schedules set it each step). */
  get lr(): number {
    return this.groups[0]!.options.lr;
  }
  set lr(v: number) {
    for (const g of this.groups) g.options.lr = v;
  }

  /** Zeroes gradients in place: the tensors (views of a flat buffer) stay allocated. */
  zeroGrad(): void {
    if (this.grads?.zeroGrad) return this.grads.zeroGrad();
    noGrad(() => {
      for (const g of this.groups) {
        for (const p of g.params) {
          const grad = p.grad;
          if (grad) {
            grad.zero_();
            grad.dispose();
          }
        }
      }
    });
  }

  /** Whether step() runs the one-pass update ([Note: kernel choice]: kernels = "fused" in effect, and this optimizer has one). */
  fusedInEffect(): boolean {
    return kernelChoice() === 'fused' && this.fusedUpdate !== undefined;
  }

  /**
   * One update of every piece this rank owns; then the source publishes the new parameters.
   * gradScale multiplies every gradient the update reads (clipping's factor): the one-pass update
   * takes it as an argument and leaves the gradient unchanged; the op-by-op one scales each chunk
   * of the gradient in place first.
   */
  step(opts: { gradScale?: number } = {}): void {
    const gradScale = opts.gradScale ?? 1;
    if (!(gradScale > 0 && Number.isFinite(gradScale))) throw new Error(`optimizer.step: gradScale must be a finite number > 0, got ${gradScale}`);
    this.stepCount++;
    tidy(() => {
      const pieces = this.grads?.stepPieces ? this.grads.stepPieces() : this.localPieces();
      const used = this.grads?.usedParameters?.();
      // Which groups may share a run, decided once per step (a schedule changes lr in every group alike).
      const fuseKeys = this.groups.map((g) => this.fuseKey(g.options));
      const stepped = new Set<Tensor>();
      // [Note: kernel choice]: the one-pass update where the optimizer has one.
      const fused = this.fusedInEffect();
      noGrad(() => {
        for (const piece of pieces) {
          const state = this.stateOf(piece);
          for (const run of this.runsOf(piece, used, fuseKeys)) {
            const uniform = run.decays.every((d) => d === run.decays[0]);
            const decay = uniform ? run.decays[0]! : this.decayRanges(piece, run);
            const options = this.groups[run.group]!.options;
            const updateAt = (at: number, n: number, update: (run: UpdateRun, o: O) => void) => tidy(() => {
              const view = (t: Tensor) => t.narrow(0, run.start + at, n);
              const stateViews: Record<string, Tensor> = {};
              for (const [k, t] of Object.entries(state)) stateViews[k] = view(t);
              const grad = view(piece.grad);
              if (!fused && gradScale !== 1) grad.mul_(gradScale);
              update.call(this, {
                param: view(piece.data), grad, state: stateViews, step: run.step,
                weightDecay: typeof decay === 'number' ? decay : clipRanges(decay, at, n), gradScale: fused ? gradScale : 1,
              }, options);
            });
            // A fused update reads and writes each array of the run once: no chunks needed.
            if (fused) updateAt(0, run.numel, this.fusedUpdate!);
            // [Note: update chunks] An update is a chain of elementwise kernels, each one pass over
            // its tensors. Over a whole bucket (megabytes) every pass streams the parameters, the
            // gradient and the state from memory; chunks of UPDATE_CHUNK elements keep them in the
            // core's cache for the whole chain. Elementwise results do not depend on the chunking.
            else for (let at = 0; at < run.numel; at += UPDATE_CHUNK) updateAt(at, Math.min(UPDATE_CHUNK, run.numel - at), this.update);
            for (const p of run.params) stepped.add(p);
          }
          this.grads?.pieceStepped?.(piece);
        }
      });
      for (const p of stepped) this.steps.set(p, (this.steps.get(p) ?? 0) + 1);
    });
    this.grads?.afterStep?.();
  }

  private stateOf(piece: StepPiece): Record<string, Tensor> {
    let state = this.pieceState.get(piece.key);
    if (!state) {
      state = this.initState(piece.data);
      for (const t of Object.values(state)) keep(t);
      this.pieceState.set(piece.key, state);
      this.pieceMeta.set(piece.key, { segments: piece.segments.map((s) => ({ ...s })), owned: piece.owned });
    }
    return state;
  }

  /** Each parameter with a .grad is a piece of its own (no gradient source). */
  private localPieces(): StepPiece[] {
    const out: StepPiece[] = [];
    this.groups.flatMap((g) => g.params).forEach((p, i) => {
      if (p.gradAccessError !== undefined) {
        throw new Error(`optimizer: ${p.gradAccessError}. Build the optimizer with the wrapper as its gradient source: new AdamW(params, options, { grads: wrapper })`);
      }
      const g = p.grad;
      if (!g) return;
      const n = p.numel();
      out.push({ key: `param${i}`, data: p.view(-1), grad: g.view(-1), segments: [{ param: p, name: String(i), start: 0, numel: n, paramOffset: 0 }], owned: false });
    });
    return out;
  }

  /** Consecutive segments with equal hyper-parameters and update counts, unused parameters left out. */
  private runsOf(piece: StepPiece, used: ReadonlySet<Tensor> | undefined, fuseKeys: string[]): Run[] {
    const runs: Run[] = [];
    let cur: Run | undefined;
    for (const seg of piece.segments) {
      const group = this.groupOf.get(seg.param);
      if (group === undefined) continue; // not this optimizer's parameter (e.g. a frozen one)
      if (used && !used.has(seg.param)) continue;
      const o = this.groups[group]!.options;
      const step = (this.steps.get(seg.param) ?? 0) + 1;
      const decay = this.decayOf(o);
      if (cur && cur.start + cur.numel === seg.start && cur.step === step && fuseKeys[cur.group] === fuseKeys[group]) {
        cur.numel += seg.numel;
        cur.params.push(seg.param);
        cur.decays.push(decay);
      } else {
        cur = { start: seg.start, numel: seg.numel, group, step, params: [seg.param], decays: [decay] };
        runs.push(cur);
      }
    }
    return runs;
  }

  /**
   * The ranges of uniform weight decay of a run that mixes groups (relative to the run). Ranges, not
   * a per-element tensor: a float64 factor per element cost 8 bytes per parameter, more than the
   * AdamW state of a shard, and multiplying each range by its scalar rounds exactly as that
   * tensor did ([Note: update chunks]).
   */
  private decayRanges(piece: StepPiece, run: Run): DecayRange[] {
    const end = run.start + run.numel;
    const segs = piece.segments.filter((seg) => seg.start >= run.start && seg.start < end && run.params.includes(seg.param));
    const out: DecayRange[] = [];
    segs.forEach((seg, i) => {
      const decay = run.decays[i]!;
      const last = out[out.length - 1];
      if (last && last.decay === decay && last.start + last.numel === seg.start - run.start) last.numel += seg.numel;
      else out.push({ start: seg.start - run.start, numel: seg.numel, decay });
    });
    return out;
  }

  /** The weight decay of a group's options (0 when the optimizer has none). */
  protected decayOf(o: O): number {
    return (o as unknown as { weightDecay?: number }).weightDecay ?? 0;
  }

  /** Groups with equal keys may share a run: all options but weight decay, by default. */
  protected fuseKey(o: O): string {
    return JSON.stringify({ ...o, weightDecay: undefined });
  }


  protected abstract initState(flat: Tensor): Record<string, Tensor>;
  protected abstract update(run: UpdateRun, o: O): void;
  /** The same update in one pass (src/optim/fused.ts), used under kernels = "fused"; none: update() always. */
  protected fusedUpdate?(run: UpdateRun, o: O): void;

  /**
   * State by parameter name: each parameter's update count and the part of each state tensor this
   * rank holds for it (flattened; `offset` says where it starts in the flattened parameter when the
   * state is sharded). Names come from the gradient source, else the parameter's position.
   */
  stateDict(): OptimizerState {
    const state: Record<string, Record<string, Tensor>> = {};
    for (const [key, st] of this.pieceState) {
      const meta = this.pieceMeta.get(key)!;
      for (const seg of meta.segments) {
        const entry: Record<string, Tensor> = { step: tensor([this.steps.get(seg.param) ?? 0], { dtype: 'float64' }) };
        for (const [k, t] of Object.entries(st)) entry[k] = t.narrow(0, seg.start, seg.numel);
        if (meta.owned) entry.offset = tensor([seg.paramOffset], { dtype: 'float64' });
        state[seg.name] = entry;
      }
    }
    return { step: this.stepCount, state };
  }

  /** Loads what stateDict() saved, into the same layout (same model, same parallel layout). */
  loadStateDict(sd: OptimizerState): void {
    const pieces = this.grads?.stepPieces ? this.pieceList() : this.localPiecesQuiet();
    const known = new Set<string>();
    noGrad(() => {
      for (const piece of pieces) {
        for (const seg of piece.segments) {
          known.add(seg.name);
          const entry = sd.state[seg.name];
          if (!entry) continue;
          const st = this.stateOf(piece);
          for (const [k, t] of Object.entries(st)) {
            const src = entry[k];
            if (!src) continue;
            if (src.numel() !== seg.numel) throw new Error(`optimizer state '${seg.name}.${k}' has ${src.numel()} elements, this rank holds ${seg.numel}; load it under the same parallel layout`);
            t.narrow(0, seg.start, seg.numel).copy_(src.reshape(-1));
          }
          if (entry.step) this.steps.set(seg.param, entry.step.item());
        }
      }
    });
    const unknown = Object.keys(sd.state).filter((k) => !known.has(k));
    if (unknown.length > 0) throw new Error(`optimizer state names parameters this optimizer does not have: ${unknown.slice(0, 5).join(', ')}${unknown.length > 5 ? ', ...' : ''}`);
    this.stepCount = sd.step;
  }

  // The source's pieces outside the gradient window (names and ranges only matter here).
  private pieceList(): StepPiece[] {
    const src = this.grads!;
    return src.pieceLayout ? src.pieceLayout() : src.stepPieces!();
  }

  private localPiecesQuiet(): StepPiece[] {
    // Flat views, as localPieces() hands them to a step: state is created flat from piece.data.
    return this.groups.flatMap((g) => g.params).map((p, i) => ({
      key: `param${i}`, data: p.view(-1), grad: p.view(-1), segments: [{ param: p, name: String(i), start: 0, numel: p.numel(), paramOffset: 0 }], owned: false,
    }));
  }

  /**
   * The state this rank keeps for one parameter: the range of its flattened elements the state
   * covers (all of them, or this rank's shard), a flat view of each state tensor over that range,
   * and its update count. With `create`, zeroed state is made for a parameter that has none yet
   * (a checkpoint is loaded before the first step); otherwise undefined until the first step.
   * Checkpoints read and write optimizer state through it ([Note: placement] in src/parallel/placement.ts).
   */
  paramState(param: Tensor, opts: { create?: boolean } = {}): { offset: number; numel: number; state: Record<string, Tensor>; step: number } | undefined {
    const found = (piece: Pick<StepPiece, 'segments'>, st: Record<string, Tensor>) => {
      const seg = piece.segments.find((s) => s.param === param);
      if (!seg) return undefined;
      const state: Record<string, Tensor> = {};
      for (const [k, t] of Object.entries(st)) state[k] = t.narrow(0, seg.start, seg.numel);
      return { offset: seg.paramOffset, numel: seg.numel, state, step: this.steps.get(param) ?? 0 };
    };
    for (const [key, meta] of this.pieceMeta) {
      const r = found(meta, this.pieceState.get(key)!);
      if (r) return r;
    }
    if (!opts.create || !this.groupOf.has(param)) return undefined;
    return tidy(() => {
      const pieces = this.grads?.stepPieces ? this.pieceList() : this.localPiecesQuiet();
      const piece = pieces.find((pc) => pc.segments.some((s) => s.param === param));
      if (!piece) return undefined;
      const r = found(piece, this.stateOf(piece));
      if (r) for (const t of Object.values(r.state)) keep(t);
      return r;
    });
  }

  /** Sets a parameter's update count (bias correction), as a checkpoint recorded it. */
  setParamStep(param: Tensor, step: number): void {
    if (!Number.isInteger(step) || step < 0) throw new Error(`optimizer: a parameter's update count must be a non-negative integer, got ${step}`);
    if (step === 0) this.steps.delete(param);
    else this.steps.set(param, step);
  }

  /** Bytes of optimizer state this rank holds (resident). */
  stateBytes(): number {
    let n = 0;
    for (const st of this.pieceState.values()) for (const t of Object.values(st)) n += t.storageNbytes();
    return n;
  }

  /** Frees the optimizer state (moments, momentum buffers). */
  dispose(): void {
    for (const st of this.pieceState.values()) for (const t of Object.values(st)) t.dispose();
    this.pieceState.clear();
    this.pieceMeta.clear();
  }
}

/** The part of `ranges` inside [at, at + n), relative to at (one update chunk of a run). */
function clipRanges(ranges: DecayRange[], at: number, n: number): DecayRange[] {
  const out: DecayRange[] = [];
  for (const r of ranges) {
    const lo = Math.max(r.start, at), hi = Math.min(r.start + r.numel, at + n);
    if (hi > lo) out.push({ start: lo - at, numel: hi - lo, decay: r.decay });
  }
  return out;
}
