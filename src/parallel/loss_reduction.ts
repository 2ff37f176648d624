// What every layout's step minimises: a sum over the global batch's units divided by their count.
//
// [Note: global loss reduction] A masked batch (chat SFT: only the assistant's tokens are trained;
// packed rows: a pad's targets are IGNORE_INDEX) holds a different number of trained tokens in each
// micro-batch and on each rank, so a mean per micro-batch averaged over micro-batches and ranks (the
// "mean of means") weighs a token of a short answer more than one of a long answer, and a
// micro-batch with no trained token at all divides 0 by 0. Every layout's step instead does:
//   1. N = globalCount(the gradient-averaging group, Σ criterion.count(mb)): the trained tokens of
//      the whole global batch, known before any forward since every rank (every pipeline stage)
//      holds its micro-batches' targets. The group is dpReplicate x dpShard x cp, never tp (tp ranks
//      hold the same targets); under a pipeline each stage's dp group gives the same N.
//   2. each micro-batch's backward from apply(...).loss (a SUM over its units) divided by N / D, D
//      the gradient-averaging group's size: DataParallel's 1 / D average then leaves
//      Σ_ranks Σ_micro sum / N, one process's gradient of the token mean over the global batch;
//   3. the reported loss: Σ value over the pipeline and the data group, divided by N;
//   4. N = 0 (no trained token anywhere; every rank sees the same N): no forward, no backward,
//      count 0, and the trainer skips the optimizer step.
// A user LossFn that only means (no `reduces`) counts 1 per micro-batch (meanCriterion), so N / D is
// the micro-batch count and its steps are the mean of per-micro-batch means, as before. A criterion
// over other units (DPO: preference pairs) counts those.
import { type Tensor, tensor, tidy } from '../tensor/index.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import { IGNORE_INDEX, asList, type Criterion, type LossFn, type MicroBatch, type StageValue } from './parallel_model.js';

/** Trained targets in y (its first tensor when it holds several): entries other than IGNORE_INDEX. */
export function trainedTargets(y: StageValue): number {
  const t = asList(y)[0]!;
  return tidy(() => t.ne(IGNORE_INDEX).sum().item());
}

/** A token-summing loss (`reduces`): apply sums over trained targets, count = trained targets of the local y. */
export function tokenCriterion(loss: LossFn): Criterion {
  return {
    count: (mb) => trainedTargets(mb.y),
    apply(output, mb) {
      const l = loss(output, mb.y, { reduction: 'sum' });
      checkScalar(l);
      return { loss: l, value: l.item() };
    },
  };
}

/** A loss that only means: one unit per micro-batch, so the step is the mean of per-micro-batch means. */
export function meanCriterion(loss: LossFn): Criterion {
  return {
    count: () => 1,
    apply(output, mb) {
      const l = loss(output, mb.y);
      checkScalar(l);
      return { loss: l, value: l.item() };
    },
  };
}

function checkScalar(l: Tensor): void {
  if (l.numel() !== 1) throw new Error(`the loss function returned a tensor of shape [${l.shape}]; it must return a scalar (the mean over the micro-batch, or with { reduction: 'sum' } the sum)`);
}

function isCriterion(l: LossFn | Criterion): l is Criterion {
  return typeof l === 'object' && l !== null && typeof (l as Criterion).apply === 'function' && typeof (l as Criterion).count === 'function';
}

/** A criterion as given; a LossFn with `reduces` as a token criterion, else as a mean criterion. */
export function criterionOf(l: LossFn | Criterion): Criterion {
  if (isCriterion(l)) return l;
  if (typeof l !== 'function') throw new Error('the loss must be a function (output, target, { reduction }) => scalar or a Criterion { count, apply }');
  return l.reduces ? tokenCriterion(l) : meanCriterion(l);
}

/** A loss method bound to its owner (a PipelineModel class), its `reduces` kept; a Criterion as it is. */
export function bindLoss(l: LossFn | Criterion, self: unknown): LossFn | Criterion {
  if (isCriterion(l)) return l;
  const bound: LossFn = l.bind(self);
  if (l.reduces) bound.reduces = true;
  return bound;
}

/** The step's normaliser: one float64 all-reduce (SUM) of this rank's units over `group`; none on a group of one. */
export function globalCount(group: ProcessGroup | undefined, local: number): number {
  return sumOver([group], [local])[0]!;
}

/** Σ criterion.count over micro-batches (this rank's units). */
export function localCount(c: Criterion, mbs: readonly MicroBatch[]): number {
  let n = 0;
  for (const mb of mbs) n += c.count(mb);
  return n;
}

/** Sums each value over every group in turn (float64, one all-reduce per group of more than one rank). */
export function sumOver(groups: readonly (ProcessGroup | undefined)[], values: readonly number[]): number[] {
  const gs = groups.filter((g): g is ProcessGroup => g !== undefined && g.size > 1);
  if (gs.length === 0 || values.length === 0) return [...values];
  return tidy(() => {
    const t = tensor(Float64Array.from(values));
    for (const g of gs) g.allReduce(t, 'sum').wait();
    return t.toNumbers();
  });
}

/** Metrics summed over micro-batches (a criterion's per-micro-batch sums). */
export function addMetrics(acc: Record<string, number>, m: Record<string, number> | undefined): void {
  if (!m) return;
  for (const [k, v] of Object.entries(m)) acc[k] = (acc[k] ?? 0) + v;
}

/**
 * The step's result from this rank's sums: the value and metrics summed over `groups`, divided by
 * the global count (every rank must hold the same metric names; a pipeline shares the last stage's first).
 */
export function reduceResult(groups: readonly (ProcessGroup | undefined)[], value: number, metrics: Record<string, number>, count: number): { loss: number; count: number; metrics?: Record<string, number> } {
  const names = Object.keys(metrics).sort();
  const [sum, ...ms] = sumOver(groups, [value, ...names.map((k) => metrics[k]!)]);
  const per = (v: number) => (count > 0 ? v / count : 0);
  return { loss: per(sum!), count, ...(names.length > 0 ? { metrics: Object.fromEntries(names.map((k, i) => [k, per(ms[i]!)])) } : {}) };
}
