// PipelineParallel: any model cut into pipeline stages (model.ts: stage modules and a loss
// function) over a pipeline group (optionally replicated over a data-parallel group), run by a
// schedule table, with the gradient API of grads.ts.
//
//   const pp = new PipelineParallel(gptPipeline(gptConfig, { initSeed: 1234 }), {   // or sequentialStages({...}), or your own PipelineModel
//     pp: mesh.dim('pp').group,            // group rank = pipeline rank
//     dp: mesh.dim('dp').group,            // optional: replicas of this pipeline to average over
//     schedule: 'zb', virtualStages: 1, micro: 8,
//     zero: 2,                             // optional: ZeRO-1/2/3 over dp (see [Note: pipeline x ZeRO])
//   });
//   const opt = new AdamW(pp.parameters(), {...}, { grads: pp.grads }); // this rank's stages (and shards) only
//   const { loss } = pp.step(microBatches);                // m x { x, y }, same on every pp rank
//   const { norm } = clipGradNorm(pp.grads, 1.0);           // the whole model's norm, same on every rank
//   if (Number.isFinite(norm)) opt.step();                  // every rank decides alike
//   opt.zeroGrad();
//   const valLoss = pp.evaluate(valMicroBatches);           // forward only, the same number on every rank
//
// step() runs this rank's action list (executor.ts), then finishes the gradients so that they equal
// those of one process training the whole model on the whole global batch:
//   1. tied parameters (PipelineModel.tied, e.g. a GPT's embedding and head): the copies exchange
//      gradients point-to-point over the pipeline group (or add locally when one rank holds them)
//      and every copy holds their sum, added in copy order (the same bits everywhere); the norm
//      counts the first copy only, clipping scales all (clipTargets), and all take identical steps
//      (a frozen tied parameter, every copy requiresGrad = false, has nothing to exchange);
//   2. data parallel: the stages' DataParallel (zero 0, 1, 2 or 3) reduces its buckets once (see
//      [Note: pipeline x ZeRO]);
//   3. the loss (the criterion's sum over the last stage's micro-batches and the dp replicas, over
//      the global count: [Note: global loss reduction] in ../loss_reduction.ts) is all-reduced so
//      every rank reports it; each micro-batch's backward started from its sum over (count / dp size).
// With { sync: false } steps 1-2 are left for a later step (gradient accumulation across steps:
// pass lossScale 1/(m * steps) to weigh them, each micro-batch then its own mean).
//
// evaluate() runs the schedule's forward actions only (Executor.runForward: the same sends and
// receives, under noGrad, stages in eval mode) and reduces the loss like step(). Under ZeRO the
// stage modules' hooks do what a forward needs: zero 1/2 wait for the parameter all-gathers the
// optimizer started, zero 3 gathers each unit around its forward (and frees it after, with
// reshardAfterForward). Gradients are not touched, so it may run between any two steps.
// memory(optimizerBytes) reports this rank's parameter, gradient and optimizer bytes (the trainer's
// memory line): DataParallel's report with a dp group, else the stage tensors counted.
//
// [Note: pipeline x ZeRO] With a dp group (any zero stage, 0 included), this rank's stage modules are registered
// in one container module (virtual stages share it) wrapped in a DataParallel over the dp group with
// that zero stage and the layout's accumulation flavour. Every backward of the schedule runs with
// reductions held (DataParallel.holdReductions, whatever the flavour) and accumulates into the full gradient buckets (allocated at the start of the step); the
// zero-bubble W pass writes its hand-made weight gradients into the same buckets (Executor
// handGrads) and marks them. After the schedule the tied copies are summed in the buckets (a sum
// before the dp average equals one after it), then reduceAccumulated() + finishGradSync() reduce
// every bucket once: all-reduce (zero 0, 1) or reduce-scatter into this rank's shard (zero 2, 3). The
// optimizer takes `grads` (ShardedPipelineGrads): DataParallel's step pieces (this rank's shards),
// and the parameter all-gather after the step is DataParallel's (pieceStepped/afterStep). The norm
// counts each element of the whole model once: pieces summed over the pipeline group and, when
// gradients are sharded (zero 2, 3), the shard group; tied copies other than the first are left out.
// Zero 3: FSDP's module hooks (data_parallel/fsdp.ts) gather a unit before each forward call and again, through
// the hook on that call's output, before its backward, so micro-batches in flight each find their
// unit gathered; every backward pass of the schedule frees the units at its end, and W needs no
// parameters (dW = dy^T x). Parameters outside every unit (a user's embedding and head when the
// policy names only the blocks) form the root unit, gathered when any stage is entered and kept to
// the end of the step. Every dp replica of a pipeline rank runs the same action list, so the
// shard group issues the same gathers in the same order. Read parameters inside withFullParameters.
// Hybrid sharding (replicateGroup, HSDP): the dp group is replicate x shard ranks; DataParallel
// reduce-scatters in the shard group (scaled by 1/dp) and all-reduces the shards across replicas,
// so the norm still sums over the pipeline and shard groups only: replicas hold equal shards and
// count once.
//
// PipelineParallel.fromMesh(model, mesh, opts) takes the groups from a DeviceMesh's 'pp' (and 'dp')
// dims. buildSchedule/validateSchedule are in schedule.ts; stageNamedParameters() maps local
// parameters to their whole-model names (checkpoints; a tied copy appears under its declared name
// on every stage holding one). Micro-batches must all have the same shapes.
import { Tensor, elementSize, noGrad, tensor, tidy } from '../../tensor/index.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import type { DeviceMesh } from '../../distributed/mesh.js';
import { Module } from '../../nn/module.js';
import type { UnitPolicy } from '../data_parallel/fsdp.js';
import { disposeDocuments, type Criterion, type MicroBatch, type ParallelModel, type StageValue, type StepResult } from '../parallel_model.js';
import { addMetrics, bindLoss, criterionOf, globalCount, localCount, reduceResult } from '../loss_reduction.js';
import type { GradShard, GradientSource } from '../grads.js';
import type { DataParallel, AccumulateFlavour, MemoryReport, ZeroStage } from '../data_parallel/data_parallel.js';
import { buildDataParallel, type DataParallelSpec } from '../data_parallel/wrappers.js';
import { gradView, type ParamSlot } from '../data_parallel/grad_buffer.js';
import { accumulateProblems } from '../layout.js';
import { placementsOf, type ParamPlacement } from '../placement.js';
import { buildSchedule, peakActivations, peakDeferredWeightGrads, validateSchedule, type PipelineSchedule, type ScheduleName } from './schedule.js';
import { axisStride, computeBytes, crossesHosts, type PlanAxis } from '../../distributed/plan_terms.js';
import { Stage } from './stage.js';
import { Executor, type LossRoot, type StageSums, type TraceEvent } from './executor.js';
import { ExpertPiecesSource, ExpertStepPieces, expertPlacements, gatherExperts } from '../expert_parallel.js';
import type { PipelineModel, TiedParameter } from './model.js';

export interface PipelineOptions {
  /** The pipeline group; a rank's group rank is its pipeline rank. */
  pp: ProcessGroup;
  /** Optional data-parallel group: replicas of the same stages, gradients averaged over it. */
  dp?: ProcessGroup;
  schedule: ScheduleName;
  /** Stages per rank ('interleaved' only; default 2 there, 1 otherwise). */
  virtualStages?: number;
  /** Micro-batches per step (m). */
  micro: number;
  /** ZeRO stage over the dp group: 0 (default) replicates, 1, 2 and 3 shard (see [Note: pipeline x ZeRO]). */
  zero?: ZeroStage;
  /**
   * The layout's accumulation flavour (default 'reduceLast'). The schedule always accumulates the
   * step's micro-batches before reducing, so 'reduceEach' is refused; under HSDP
   * 'reduceScatterEachAllReduceLast' reduces as 'reduceLast' does.
   */
  accumulate?: AccumulateFlavour;
  /** With zero >= 1: the ranks that split the state (default: dp); see DataParallelOptions. */
  shardGroup?: ProcessGroup;
  /** With zero >= 1: hybrid sharding's replicas of a shard (HSDP; dp = shard x replicate ranks). */
  replicateGroup?: ProcessGroup;
  /** With zero >= 1: bucket size in MiB (DataParallel's default when absent). */
  bucketSizeMb?: number;
  /** What gradient collectives move (DataParallelOptions.reduceDtype). */
  reduceDtype?: 'fp32' | 'bf16';
  /** With zero = 3: free a unit's gathered parameters after each forward (default true). */
  reshardAfterForward?: boolean;
  /** With zero = 3: the wrapping units among the stage modules (data_parallel/fsdp.ts; paths start with 'stage<s>.'). */
  units?: UnitPolicy;
  /**
   * The stages' data-parallel wrapping as parallelize builds it from the layout and the mesh (its
   * zero stage and accumulation, groups and knobs): given, it stands for dp, zero, accumulate,
   * shardGroup, replicateGroup and the knobs above. Both ways build through buildDataParallel.
   */
  dataParallel?: DataParallelSpec;
  /** Modules whose forward a tensor-parallel style replaced (see Stage): parallelize passes them. */
  restyled?: (m: Module) => boolean;
  /**
   * Expert parallelism ([Note: expert parallelism] in ../expert_parallel.ts): the stage builder has
   * cut each stage's experts to this rank's share and collected them in `params` (filled while the
   * stages are built); their gradients live in a second DataParallel over dataParallel.groups.edp,
   * scaled by 1 / dp.
   */
  experts?: { params: ReadonlySet<Tensor>; ep: ProcessGroup };
}

/** This rank's stage modules under one parent, so one DataParallel holds all of them. */
class LocalStages extends Module {
  constructor(stages: Stage[]) {
    super();
    for (const st of stages) this.registerModule(`stage${st.index}`, st.module);
  }
  forward(): never {
    throw new Error('pipeline: the stages run through the executor, not as one module');
  }
}

export interface PipelineStepOptions {
  /**
   * Multiplies each micro-batch's mean (its criterion sum over its own count) before backward, in
   * place of the global count's weighting (gradient accumulation across steps: 1/(m x steps)).
   */
  lossScale?: number;
  /** Finish gradients (tied sum, dp average) after this step (default true). */
  sync?: boolean;
  /**
   * Appends each compute action's wall-clock span here (bench/pipeline.ts measures bubbles with it).
   * A span starts after the wait for the receive it consumes: waiting is bubble, not compute.
   */
  trace?: TraceEvent[];
}

/** Tag base of the tied-parameter exchange (above every activation tag of a step). */
const TIED_TAG = 0x40000000;

/** A tied parameter's copies as this rank sees them. */
interface TiedGroup {
  decl: TiedParameter;
  /** Per declared copy: its parameter when this rank holds that stage. */
  local: (Tensor | undefined)[];
  /** Pipeline ranks other than this one holding a copy. */
  peers: number[];
}

export class PipelineParallel implements ParallelModel {
  readonly schedule: PipelineSchedule;
  readonly model: PipelineModel;
  /** This rank's stages, by global stage index (ascending). */
  readonly stages: Stage[];
  readonly ppGroup: ProcessGroup;
  readonly dpGroup: ProcessGroup | undefined;
  /** The gradient API (grads.ts) for clipping, norms and the optimizer's `grads`. */
  readonly grads: GradientSource;
  /** With a dp group: the stages' data-parallel wrapper, any zero stage (see [Note: pipeline x ZeRO]). */
  readonly dp: DataParallel | undefined;
  private readonly executor: Executor;
  private readonly criterion: Criterion;
  private readonly slotOf = new Map<Tensor, ParamSlot>();
  private readonly tied: TiedGroup[];
  /** Tied copies other than the first: left out of the norm (the first counts the sum once). */
  readonly tiedCopiesLeftOutOfNorm: ReadonlySet<Tensor>;
  private readonly tiedName = new Map<Tensor, string>();
  /** Expert parallelism: the expert wrapper (when this rank's stages hold experts), the expert parameters and the ep group. */
  readonly edp: DataParallel | undefined;
  readonly expertParams: ReadonlySet<Tensor>;
  readonly epGroup: ProcessGroup | undefined;
  readonly edpGroup: ProcessGroup | undefined;

  constructor(model: PipelineModel, opts: PipelineOptions) {
    if (!model || typeof model.stage !== 'function' || !(typeof model.loss === 'function' || typeof (model.loss as Criterion | undefined)?.apply === 'function')) {
      throw new Error('PipelineParallel: the model must be a PipelineModel ({ stage(index, numStages), loss(output, target) }); build one with sequentialStages(...) or, for a GPT, gptPipeline(cfg, { initSeed })');
    }
    this.model = model;
    this.criterion = criterionOf(bindLoss(model.loss, model));
    this.ppGroup = opts.pp;
    this.schedule = buildSchedule(opts.schedule, {
      pp: opts.pp.size, micro: opts.micro,
      virtualStages: opts.schedule === 'interleaved' ? (opts.virtualStages ?? 2) : opts.virtualStages,
    });
    validateSchedule(this.schedule);
    const n = this.schedule.numStages;
    const rank = opts.pp.rank;
    this.stages = this.schedule.stagesOf(rank).sort((a, b) => a - b).map((s) => new Stage(s, n, model.stage(s, n), opts.restyled));
    this.tied = this.resolveTied(model.tied?.(n) ?? []);
    this.checkTiedFrozen();
    const leftOut = new Set<Tensor>();
    for (const t of this.tied) {
      t.local.forEach((p, c) => {
        if (!p) return;
        this.tiedName.set(p, t.decl.name);
        if (c > 0) leftOut.add(p);
      });
    }
    this.tiedCopiesLeftOutOfNorm = leftOut;
    const spec: DataParallelSpec | undefined = opts.dataParallel ?? (opts.dp && {
      layout: { zero: opts.zero ?? 0, accumulate: opts.accumulate ?? 'reduceLast' },
      groups: { dp: opts.dp, ...(opts.shardGroup ? { shard: opts.shardGroup } : {}), ...(opts.replicateGroup ? { replicate: opts.replicateGroup } : {}) },
      knobs: opts,
    });
    this.dpGroup = spec && spec.groups.dp.size > 1 ? spec.groups.dp : undefined;
    this.expertParams = opts.experts?.params ?? new Set();
    this.epGroup = opts.experts?.ep;
    this.edpGroup = spec?.groups.edpShard ?? spec?.groups.edp; // the experts' shard group
    if (this.epGroup && !this.edpGroup) throw new Error('PipelineParallel: experts need the ranks holding the same experts: pass dataParallel.groups.edp (parallelize does)');
    if (spec && this.dpGroup) {
      const { zero, accumulate } = spec.layout;
      const [problem] = accumulateProblems(zero, accumulate, (spec.groups.replicate?.size ?? 1) > 1, Math.max(2, opts.pp.size) /* a pipeline, even on one rank */, 'api');
      if (problem) throw new Error(`PipelineParallel: ${problem}`);
      const { dense, experts } = buildDataParallel(new LocalStages(this.stages), spec, {
        experts: this.expertParams,
        entries: this.stages.map((st) => st.module), // the executor calls the stages, never LocalStages
      });
      this.dp = dense;
      this.edp = experts;
      for (const w of [dense, experts]) for (const s of w?.parametersWithSlots() ?? []) this.slotOf.set(s.param, s);
    }
    this.executor = new Executor({
      schedule: this.schedule, rank, group: opts.pp, criterion: this.criterion,
      stages: new Map(this.stages.map((st) => [st.index, st])),
      ...(this.dp ? { handGrads: { view: (p: Tensor) => this.accumulatingGrad(p), written: (p: Tensor) => this.wrapperOf(p).markGradient(p) } } : {}),
    });
    this.grads = this.dp ? new ShardedPipelineGrads(this, this.dp, this.edp) : new PipelineGrads(this);
  }

  /** The data-parallel wrapper holding a parameter's gradient (the expert one for an expert). */
  wrapperOf(p: Tensor): DataParallel {
    return this.edp && this.expertParams.has(p) ? this.edp : this.dp!;
  }

  /** Checks the tied declarations against the stages and finds this rank's copies and peers. */
  private resolveTied(decls: TiedParameter[]): TiedGroup[] {
    const n = this.schedule.numStages;
    return decls.map((decl) => {
      const stages = decl.copies.map((c) => c.stage);
      if (decl.copies.length < 2 || new Set(stages).size !== stages.length || stages.some((s) => !Number.isInteger(s) || s < 0 || s >= n)) {
        throw new Error(`pipeline: tied parameter '${decl.name}' must name at least two copies on distinct stages 0..${n - 1}, got stages [${stages.join(', ')}]`);
      }
      const local = decl.copies.map((c) => {
        const st = this.stages.find((x) => x.index === c.stage);
        if (!st) return undefined;
        const p = st.module.namedParameters().find(([name]) => name === c.path)?.[1];
        if (!p) {
          throw new Error(`pipeline: tied parameter '${decl.name}': stage ${c.stage} has no parameter '${c.path}' (its parameters: ${st.module.namedParameters().map(([x]) => x).join(', ')})`);
        }
        return p;
      });
      const me = this.ppGroup.rank;
      const peers = [...new Set(decl.copies.map((c) => this.schedule.stageRank(c.stage)))].filter((r) => r !== me);
      return { decl, local, peers };
    });
  }

  /**
   * A tied parameter is frozen (requiresGrad = false) in every copy or in none: a frozen copy has no
   * gradient to exchange, so one frozen copy facing a trained one would leave the other waiting.
   * Decided over the pipeline group at construction (every rank declares the same tied parameters).
   */
  private checkTiedFrozen(): void {
    if (this.tied.length === 0) return;
    const counts = tidy(() => {
      const c = tensor(this.tied.flatMap((t) => {
        const held = t.local.filter((p): p is Tensor => p !== undefined);
        return [held.filter((p) => !p.requiresGrad).length, held.filter((p) => p.requiresGrad).length];
      }), { dtype: 'float64' });
      if (this.ppGroup.size > 1) this.ppGroup.allReduce(c, 'sum').wait();
      return c.toNumbers();
    });
    this.tied.forEach((t, i) => {
      const [frozen, trained] = [counts[2 * i]!, counts[2 * i + 1]!];
      if (frozen > 0 && trained > 0) {
        const copies = t.decl.copies.map((c) => `stage ${c.stage}: '${c.path}'`).join(', ');
        throw new Error(`pipeline: tied parameter '${t.decl.name}' is frozen (requiresGrad = false) in ${frozen} of its copies and trains in ${trained}; freeze every copy (${copies}) or none`);
      }
    });
  }

  /** The gradient a backward accumulates into: the bucket view (with a dp group) or param.grad. */
  private accumulatingGrad(param: Tensor): Tensor {
    const slot = this.slotOf.get(param);
    if (slot) return gradView(slot);
    const g = param.grad;
    if (!g) throw new Error('pipeline: a parameter has no gradient (run step() first)');
    return g;
  }

  /**
   * The same from a DeviceMesh: the pipeline group is the mesh dim `ppDim` (default 'pp'), and the
   * dp group the dim `dpDim` (default 'dp') when the mesh has it.
   */
  static fromMesh(
    model: PipelineModel, mesh: DeviceMesh,
    opts: Omit<PipelineOptions, 'pp' | 'dp'> & { ppDim?: string; dpDim?: string },
  ): PipelineParallel {
    const { ppDim = 'pp', dpDim = 'dp', ...rest } = opts;
    const dp = mesh.names.includes(dpDim) ? mesh.dim(dpDim).group : undefined;
    return new PipelineParallel(model, { ...rest, pp: mesh.dim(ppDim).group, dp });
  }

  /** This rank's stage modules. */
  get parts(): Module[] {
    return this.stages.map((s) => s.module);
  }


  summary(): string {
    const v = this.schedule.numStages / this.ppGroup.size;
    return `pipeline over ${this.ppGroup.size} ranks, schedule ${this.schedule.name}, ${v} stage(s) per rank, ${this.schedule.micro} micro-batches` +
      (this.dp ? `; ${this.dp.zero > 0 ? `ZeRO-${this.dp.zero}` : 'data parallel'} over ${this.dp.group.size} data-parallel ranks` : '');
  }

  /** The optimizer's `grads`: the data-parallel pieces when there is a dp group. */
  get optimizerGrads(): GradientSource | undefined {
    return this.dp ? this.grads : undefined;
  }

  /** This rank's parameters (all its stages; tied copies included): give these to the optimizer. */
  parameters(): Tensor[] {
    return this.stages.flatMap((s) => s.params);
  }

  /** This rank's parameters under their whole-model names (a tied copy under its declared name). */
  stageNamedParameters(): [string, Tensor][] {
    return this.stages.flatMap((s) => s.module.namedParameters().map(([n, p]): [string, Tensor] => [this.tiedName.get(p) ?? n, p]));
  }

  namedParameters(): [string, Tensor][] {
    return this.stageNamedParameters();
  }

  /** Placements of this rank's stages' parameters: in the stages' DataParallel when there is one; tied copies after the first write nothing. */
  placements(): ParamPlacement[] {
    const named = this.namedParameters();
    const dense = placementsOf(named.filter(([, p]) => !this.expertParams.has(p)), { ...(this.dp ? { dp: this.dp } : {}), silent: this.tiedCopiesLeftOutOfNorm });
    if (!this.edp || !this.epGroup) return dense;
    return [...dense, ...expertPlacements(placementsOf(named.filter(([, p]) => this.expertParams.has(p)), { dp: this.edp }), this.epGroup)];
  }

  whole(param: Tensor): Tensor {
    return this.epGroup && this.expertParams.has(param) ? gatherExperts(param, this.epGroup) : param;
  }

  finishParameterGathers(): void {
    this.dp?.waitParams();
    this.edp?.waitParams();
  }

  /**
   * One step over m micro-batches: forward and backward by the schedule, then the gradient
   * finish (see the file header). Returns the loss over the global batch, on every rank. Every
   * stage holds the micro-batches' targets, so each counts the global batch's units itself.
   */
  step(microBatches: MicroBatch[], opts: PipelineStepOptions = {}): StepResult {
    try {
      const N = globalCount(this.dpGroup, localCount(this.criterion, microBatches));
      if (N === 0) return { loss: 0, count: 0 }; // nothing trained anywhere: no gradient (every rank agrees)
      const D = this.dpGroup?.size ?? 1;
      const { lossScale } = opts;
      const root: LossRoot = lossScale === undefined
        ? (l) => l.div(N / D)
        : (l, mb) => {
          const n = this.criterion.count(mb);
          return l.mul(n > 0 ? lossScale / n : 0);
        };
      for (const w of [this.dp, this.edp]) {
        // Backward passes accumulate into the full buckets; they are reduced once, in syncGrads.
        w?.holdReductions();
        w?.allocateGradients();
      }
      const sums = this.executor.run(microBatches, root, opts.trace);
      if (opts.sync ?? true) this.syncGrads();
      return this.reduce(sums, N);
    } finally {
      disposeDocuments(microBatches);
    }
  }

  /**
   * Evaluation: the loss over the given micro-batches (a positive multiple of m, each shaped
   * like step()'s, run m at a time) and over the dp replicas, the same number on every rank. Forward
   * only, under noGrad, with the stages in eval mode (restored after); gradients and optimizer state
   * are not touched. Every rank of the pipeline and dp groups calls it with its own micro-batches.
   */
  evaluate(microBatches: MicroBatch[]): StepResult {
    try {
      const N = globalCount(this.dpGroup, localCount(this.criterion, microBatches));
      const sums: StageSums = { value: 0, metrics: {}, read: [] };
      for (const s of this.forwardChunks(microBatches, (part) => this.executor.runForward(part))) {
        sums.value += s.value;
        addMetrics(sums.metrics, s.metrics);
      }
      return this.reduce(sums, N);
    } finally {
      disposeDocuments(microBatches);
    }
  }

  /**
   * Forward only, as evaluate runs it: `read` runs on the last stage's rank, and what it returns is
   * broadcast over the pipeline group, so every rank returns it (see ParallelModel.forwardOnly).
   */
  forwardOnly(microBatches: MicroBatch[], read: (output: StageValue, mb: MicroBatch) => Float64Array): Float64Array[] {
    const local = this.forwardChunks(microBatches, (part) => this.executor.runForward(part, read)).flatMap((s) => s.read);
    if (this.ppGroup.size === 1) return local.map((v) => v!);
    const last = this.schedule.stageRank(this.schedule.numStages - 1);
    const mine = this.ppGroup.rank === last;
    return tidy(() => {
      const lengths = tensor(Float64Array.from(local, (v) => (mine ? v!.length : 0)));
      this.ppGroup.broadcast(lengths, last).wait();
      const ns = lengths.toNumbers();
      const all = new Float64Array(ns.reduce((a, n) => a + n, 0));
      if (mine) {
        let at = 0;
        for (const v of local) {
          all.set(v!, at);
          at += v!.length;
        }
      }
      const t = tensor(all);
      if (all.length > 0) this.ppGroup.broadcast(t, last).wait();
      const got = Float64Array.from(t.toNumbers());
      let at = 0;
      return ns.map((n) => got.slice(at, (at += n)));
    });
  }

  /** Runs a forward-only pass over the micro-batches m at a time, the stages in eval mode (restored after). */
  private forwardChunks(microBatches: MicroBatch[], run: (part: MicroBatch[]) => StageSums): StageSums[] {
    const m = this.schedule.micro;
    const n = microBatches.length;
    if (n === 0 || n % m !== 0) {
      throw new Error(`pipeline evaluate: the schedule runs ${m} micro-batches at a time, got ${n}; pass a positive multiple of ${m}`);
    }
    const training = this.stages.map((s) => s.module.training);
    for (const s of this.stages) s.module.eval();
    const out: StageSums[] = [];
    try {
      for (let k = 0; k < n; k += m) out.push(run(microBatches.slice(k, k + m)));
    } finally {
      this.stages.forEach((s, i) => s.module.train(training[i]));
    }
    return out;
  }

  /**
   * The last stage's sums, summed over pp and dp and divided by the global count, on every rank.
   * The metric names are the last stage's: broadcast over pp (as JSON) when it has any.
   */
  private reduce(sums: StageSums, N: number): StepResult {
    let { value, metrics } = sums;
    if (this.ppGroup.size > 1) {
      const last = this.schedule.stageRank(this.schedule.numStages - 1);
      const json = this.ppGroup.rank === last && Object.keys(metrics).length > 0 ? new TextEncoder().encode(JSON.stringify(metrics)) : new Uint8Array(0);
      const [v, len] = tidy(() => {
        const t = tensor(Float64Array.from([value, json.length]));
        this.ppGroup.allReduce(t, 'sum').wait();
        return t.toNumbers();
      });
      value = v!;
      if (len! > 0) {
        metrics = tidy(() => {
          const t = tensor(Float64Array.from({ length: len! }, (_, i) => json[i] ?? 0));
          this.ppGroup.broadcast(t, last).wait();
          return JSON.parse(new TextDecoder().decode(Uint8Array.from(t.toNumbers()))) as Record<string, number>;
        });
      }
    }
    return reduceResult([this.dpGroup], value, metrics, N);
  }

  /**
   * This rank's parameter, gradient and optimizer bytes (pass the optimizer's stateBytes()). With a
   * dp group it is the stages' DataParallel's report (resident buckets and shards, the step peak).
   * Without one the stage parameters and their gradients are counted; the peak adds the tied
   * parameters' received copies. Activations are not counted in either case.
   */
  memory(optimizerBytes = 0): MemoryReport {
    if (this.dp && this.edp) {
      const a = this.dp.memory(optimizerBytes), b = this.edp.memory(0);
      return { paramBytes: a.paramBytes + b.paramBytes, gradBytes: a.gradBytes + b.gradBytes, optimizerBytes, peakBytes: a.peakBytes + b.peakBytes };
    }
    if (this.dp) return this.dp.memory(optimizerBytes);
    return tidy(() => {
      const bytes = (t: Tensor) => t.numel() * elementSize(t.dtype);
      let params = 0, grads = 0;
      for (const p of this.parameters()) {
        params += bytes(p);
        const g = p.grad;
        if (g) {
          grads += bytes(g);
          g.dispose();
        }
      }
      // Each remote copy of a tied parameter is received during the gradient sum.
      let extra = 0;
      for (const t of this.tied) {
        const mine = t.local.filter((p): p is Tensor => p !== undefined);
        if (mine.length > 0) extra += (t.decl.copies.length - mine.length) * bytes(mine[0]!);
      }
      return { paramBytes: params, gradBytes: grads, optimizerBytes, peakBytes: params + grads + extra + optimizerBytes };
    });
  }

  /** Finishes gradients: tied copies summed, then every gradient averaged over dp. */
  syncGrads(): void {
    tidy(() => noGrad(() => {
      this.tied.forEach((t, gi) => this.sumTied(t, gi));
      for (const w of [this.dp, this.edp]) {
        w?.reduceAccumulated();
        w?.finishGradSync();
      }
    }));
  }

  /**
   * Every copy of a tied parameter ends with the sum of all copies' gradients, added in copy order
   * so that every rank holds the same bits: each rank sends its copies' gradients to the other
   * holders and receives theirs (tags above every activation tag of a step).
   */
  private sumTied(t: TiedGroup, gi: number): void {
    // A frozen tied parameter (every copy, checkTiedFrozen: a LoRA base's embedding and head) has no gradient to sum.
    if (t.local.some((p) => p !== undefined && !p.requiresGrad)) return;
    const mine = t.local.flatMap((p, c) => (p ? [{ c, g: this.accumulatingGrad(p) }] : []));
    if (mine.length === 0) return;
    const tag = (c: number) => TIED_TAG + gi * 256 + c;
    const grads = new Array<Tensor | undefined>(t.decl.copies.length);
    for (const { c, g } of mine) grads[c] = g;
    const sends = t.peers.flatMap((peer) => mine.map(({ c, g }) => this.ppGroup.send(g, peer, tag(c))));
    const recvs = t.decl.copies.flatMap((copy, c) => {
      if (grads[c]) return [];
      const buf = mine[0]!.g.clone();
      grads[c] = buf;
      return [this.ppGroup.recv(buf, this.schedule.stageRank(copy.stage), tag(c))];
    });
    for (const w of recvs) w.wait();
    for (const w of sends) w.wait();
    const sum = grads[0]!.clone();
    for (let c = 1; c < grads.length; c++) sum.add_(grads[c]!);
    for (const { g } of mine) g.copy_(sum);
  }

  /**
   * Runs fn with every local parameter current (zero 1/2: waits for the parameter all-gathers the
   * optimizer step started; zero 3: gathers every unit, freed again after fn); call before reading
   * parameters directly (saving, comparing). Every rank of the dp group must call it.
   */
  withFullParameters<T>(fn: () => T): T {
    const inner = this.edp ? () => this.edp!.withFullParameters(fn) : fn;
    return this.dp ? this.dp.withFullParameters(inner) : inner();
  }

  dispose(): void {
    this.executor.dispose();
    this.edp?.dispose();
    this.dp?.dispose();
    for (const s of this.stages) s.dispose();
  }
}

/**
 * The gradient API over a pipeline rank's stages (see [Note: gradient API] in grads.ts): norm
 * pieces are this rank's gradients, summed over the pipeline group; dp replicas are identical after
 * syncGrads and count once; tied copies other than the first are left out of the norm (the first
 * copy holds the sum) but are scaled by clipping (clipTargets).
 */
export class PipelineGrads implements GradientSource {
  constructor(private readonly pp: PipelineParallel) {}

  private local(param: Tensor): Tensor {
    if (!this.pp.parameters().includes(param)) throw new Error('fullGrad: this parameter does not live on this pipeline rank');
    const g = param.grad;
    if (!g) throw new Error('parameter has no gradient yet (run step() first)');
    return g;
  }
  fullGrad(param: Tensor): Tensor {
    return this.local(param);
  }
  localGradShard(param: Tensor): GradShard {
    const g = this.local(param).reshape(-1);
    return { tensor: g, offset: 0, numel: g.numel(), fullNumel: g.numel() };
  }
  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    const tensors: Tensor[] = [];
    for (const p of this.pp.parameters()) {
      if (this.pp.tiedCopiesLeftOutOfNorm.has(p)) continue;
      const g = p.grad;
      if (g) tensors.push(g);
    }
    return { tensors, sumOver: this.pp.ppGroup.size > 1 ? [this.pp.ppGroup] : [] };
  }
  clipTargets(): Tensor[] {
    return this.pp.parameters().flatMap((p) => {
      const g = p.grad;
      return g ? [g] : [];
    });
  }
}

/**
 * The gradient API when the stages' gradients live in a DataParallel, any zero stage (see
 * [Note: pipeline x ZeRO]): reads, shards and the optimizer's pieces are DataParallel's; the norm
 * is summed over the pipeline group (and the shard group when gradients are sharded) and counts the
 * tied parameter once.
 */
class ShardedPipelineGrads extends ExpertPiecesSource implements GradientSource {
  /** Under expert parallelism (every rank, experts on its stages or not): the norm's second group. */
  normGroups?: () => { tensors: Tensor[]; sumOver: ProcessGroup[] }[];

  constructor(private readonly pp: PipelineParallel, private readonly dp: DataParallel, private readonly edp?: DataParallel) {
    super(new ExpertStepPieces(dp, edp, pp.expertParams));
    if (pp.epGroup) this.normGroups = () => [this.normPieces(), this.expertNormPieces()];
  }

  fullGrad(param: Tensor): Tensor {
    return this.pp.wrapperOf(param).fullGrad(param);
  }
  localGradShard(param: Tensor): GradShard {
    return this.pp.wrapperOf(param).localGradShard(param);
  }
  normGroupOf(param: Tensor): number {
    return this.pp.expertParams.has(param) ? 1 : 0;
  }
  /** The pieces of one wrapper and the groups to sum them over (the shard group when sharded). */
  private piecesOf(dp: DataParallel | undefined, sharded: boolean, extra: ProcessGroup[]): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    const tensors: Tensor[] = [];
    for (const { param } of dp?.parametersWithSlots() ?? []) {
      if (this.pp.tiedCopiesLeftOutOfNorm.has(param)) continue;
      // zero 1: the full reduced gradient (replicated over dp); zero 2/3: this rank's shard of it.
      const t = sharded ? dp!.localGradShard(param).tensor : dp!.fullGrad(param);
      if (t.numel() > 0) tensors.push(t);
    }
    const sumOver: ProcessGroup[] = [];
    if (this.pp.ppGroup.size > 1) sumOver.push(this.pp.ppGroup);
    if (sharded && dp && dp.shardGroup.size > 1) sumOver.push(dp.shardGroup);
    return { tensors, sumOver: [...sumOver, ...extra] };
  }
  normPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    return this.piecesOf(this.dp, this.dp.zero >= 2, []);
  }
  /** Experts: also summed over ep; the same groups on every rank, whether its stages hold experts or not. */
  private expertNormPieces(): { tensors: Tensor[]; sumOver: ProcessGroup[] } {
    const sharded = this.dp.zero >= 2;
    const { tensors } = this.piecesOf(this.edp, sharded, []);
    // The groups come from the mesh, not the wrapper: a rank whose stages hold no expert joins the same sums.
    const sumOver: ProcessGroup[] = [];
    if (this.pp.ppGroup.size > 1) sumOver.push(this.pp.ppGroup);
    if (sharded && this.pp.edpGroup!.size > 1) sumOver.push(this.pp.edpGroup!);
    sumOver.push(this.pp.epGroup!);
    return { tensors, sumOver };
  }
  clipTargets(): Tensor[] {
    // The buckets themselves (zero 1) or the shards (zero 2/3): tied copies are scaled too.
    return [...this.dp.normPieces().tensors, ...(this.edp?.normPieces().tensors ?? [])];
  }
}

/**
 * What a pipeline changes on a rank, for the planner ([Note: plan terms] in
 * src/distributed/plan_terms.ts): the rank holds and computes its stages' blocks (the even split of
 * [Note: stage split] in src/models/gpt_parallel.ts: earlier stages take the remainder; stage s of
 * pp x v runs on rank s mod pp), the embeddings on the first rank and the head on the last; the
 * schedule keeps peakActivations micro-batches of its stages alive, and a split schedule (zero
 * bubble) the output gradients of its deferred weight gradients besides; each micro-batch's
 * activation crosses every stage boundary forward and its gradient backward (a send/receive of
 * samples x tokens x width). The bubbles come from simulating the schedule itself (the planner's
 * time model).
 */
export const pipelinePlanAxis = {
  name: 'pipeline',
  fields: ['pp', 'ppSchedule', 'ppVirtualStages'] as const,
  apply(b, ctx) {
    const l = ctx.layout;
    if (l.pp === 1) return;
    const v = l.ppSchedule === 'interleaved' ? l.ppVirtualStages : 1;
    const S = l.pp * v;
    const L = ctx.model.blockParams.length;
    const counts = Array.from({ length: S }, (_, s) => Math.floor(L / S) + (s < L % S ? 1 : 0));
    const first = (s: number) => counts.slice(0, s).reduce((a, c) => a + c, 0);
    const mine = Array.from({ length: v }, (_, k) => ctx.stageRank + k * l.pp);
    const blocks = mine.flatMap((s) => Array.from({ length: counts[s]! }, (_, i) => first(s) + i));
    const m = ctx.model;
    b.embed = ctx.stageRank === 0;
    b.head = ctx.stageRank === l.pp - 1;
    b.blocks = blocks.length;
    b.expertParams = blocks.reduce((a, i) => a + m.blockExpertParams[i]!, 0);
    b.params = blocks.reduce((a, i) => a + m.blockParams[i]! + m.blockExpertParams[i]!, 0) + (b.embed ? m.embedParams : 0) + (b.head ? m.headParams : 0);
    // A LoRA run's stage holds its blocks' adapters, the rest of it is frozen ([Note: LoRA plan]).
    if (m.lora) b.frozenParams = b.params - blocks.reduce((a, i) => a + m.lora!.blockAdapterParams[i]!, 0) - (b.embed ? m.lora.embedAdapterParams : 0) - (b.head ? m.lora.headAdapterParams : 0);
    const schedule = buildSchedule(l.ppSchedule, { pp: l.pp, micro: l.microBatches, ...(v > 1 ? { virtualStages: v } : {}) });
    b.liveMicroBatches = peakActivations(schedule)[ctx.stageRank]! / v;
    // Zero bubble keeps each deferred weight gradient's output gradient (one per Linear, split over tp
    // but for the row-parallel ones, counted as split) besides the activations.
    const elem = computeBytes(l);
    const deferred = peakDeferredWeightGrads(schedule)[ctx.stageRank]! / v;
    b.memory.activations += deferred * b.samples * b.tokens * elem * (b.blocks * m.blockLinearOutputs + (b.head ? m.vocabSize : 0)) / l.tp;
    b.pipeline = { schedule: l.ppSchedule, pp: l.pp, micro: l.microBatches, virtualStages: v };
    const act = b.samples * b.tokens * m.nEmbd * elem;
    const boundaries = mine.filter((s) => s < S - 1).length + mine.filter((s) => s > 0).length; // sends and receives of this rank
    b.comm.push({ what: 'stage activations and their gradients', op: 'sendRecv', group: 2, bytes: act, times: boundaries * l.microBatches, overlaps: 'none', crossHost: crossesHosts(axisStride(l, 'pp'), 2, ctx.ranksPerHost) });
  },
} satisfies PlanAxis;
