// Direct preference optimisation (Rafailov et al. 2023; IPO: Azar et al. 2023) as a Criterion, so
// that every layout trains it as it trains next-token loss ([Note: global loss reduction]).
//
// [Note: DPO criterion] A micro-batch of preference data holds whole pairs: each pair's chosen and
// rejected responses are two documents of one row, and its SequenceTable says which sequence each
// target belongs to (src/parallel/parallel_model.ts). The policy's log-probability of a sequence is
// the sum of its trained targets' log-probabilities:
//   tok = -crossEntropy(logits, y, none)     (0 where y is IGNORE_INDEX; vocab-parallel under tp lossParallel)
//   pi  = zeros(nSeq + 1).indexAdd(0, index, tok)[:nSeq]   (slot nSeq collects the untrained targets)
// Under context parallelism each rank holds two chunks of every row, so pi is all-reduced over the
// ring (forward sum, backward identity: each rank's backward reaches its own chunks' tokens) and is
// the same on every cp rank. With h = (pi_c - ref_c) - (pi_r - ref_r):
//   sigmoid: -log sigmoid(beta h)
//   ipo:     (h - 1/(2 beta))^2 on per-token means (pi / trained tokens, as TRL's IPO)
// `apply` returns the loss SUMMED over the micro-batch's pairs; the count is its pairs. Both come
// from context-parallel rank 0 only (the others count 0 and report 0) so that the global count is
// the pairs of the global batch and not cp times them; every cp rank still backpropagates the same
// loss, and DataParallel's average over dp x cp adds their chunks' gradients back to one pair's.
// The rewards are beta times the log-ratios the loss reads (per-token means under ipo, as TRL).
import { logitsOf as headLogits } from '../nn/kernels/lm_head.js';
import { type Tensor, noGrad, tensor, zeros } from '../tensor/index.js';
import { F } from '../nn/index.js';
import { castFor } from '../nn/precision.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import type { Criterion, MicroBatch, SequenceTable, StageValue } from '../parallel/parallel_model.js';
import { reduceFromRegion } from '../parallel/tensor_parallel/comm.js';

export interface DpoOptions {
  beta: number;
  loss: 'sigmoid' | 'ipo';
  /** The context-parallel ring when parallel.cp > 1: its ranks hold chunks of the same sequences. */
  cp?: ProcessGroup;
}

/** The metrics a DPO step reports (sums over pairs in apply; means over the global batch's pairs once reported). */
export const DPO_METRICS = ['rewardsChosen', 'rewardsRejected', 'rewardsMargin', 'rewardsAccuracy'] as const;

function logitsOf(output: StageValue | { logits: Tensor }): Tensor {
  if (Array.isArray(output)) throw new Error('DPO: the model must return one tensor of logits (B, T, vocab)');
  // a hidden state waiting for its head under [train] kernels = "fused" gets its logits made here
  return headLogits('logits' in (output as object) ? (output as { logits: Tensor }).logits : (output as Tensor));
}

export function tableOf(mb: MicroBatch): SequenceTable {
  if (!mb.seqs) throw new Error('train.objective = "dpo" needs preference batches (data.format = "preference"): this micro-batch has no sequence table');
  return mb.seqs;
}

/**
 * Each sequence's summed log-probability under the model whose output this is: (nSeq), in the
 * logits' float dtype (float32 under bf16-mixed), with autograd. Under cp the same on every ring rank.
 */
export function sequenceLogps(output: StageValue, mb: MicroBatch, cp?: ProcessGroup): Tensor {
  const seqs = tableOf(mb);
  const logits = logitsOf(output);
  const [B, T, V] = logits.shape as [number, number, number];
  const [l] = castFor('loss', logits) as [Tensor]; // float32 under bf16-mixed (src/nn/precision.ts)
  const tok = F.crossEntropy(l.reshape([B * T, V]), (mb.y as Tensor).reshape([B * T]), { reduction: 'none' }).neg();
  const pi = zeros([seqs.nSeq + 1], { dtype: tok.dtype }).indexAdd(0, seqs.index.reshape([B * T]), tok).narrow(0, 0, seqs.nSeq);
  return cp && cp.size > 1 ? reduceFromRegion(pi, cp) : pi;
}

/** Each sequence's reference log-probability (float64, filled before the step), for the forward-only pass that makes it. */
export function readSequenceLogps(output: StageValue, mb: MicroBatch, cp?: ProcessGroup): Float64Array {
  return noGrad(() => new Float64Array(sequenceLogps(output, mb, cp).to('float64').toArray() as Float64Array));
}

/** The DPO loss (sigmoid or ipo) of a micro-batch's pairs against its reference log-probabilities. */
export function dpoCriterion(o: DpoOptions): Criterion {
  if (!(o.beta > 0)) throw new Error(`dpo.beta must be > 0, got ${o.beta}`);
  const first = (o.cp?.rank ?? 0) === 0;
  return {
    count(mb) {
      return first ? tableOf(mb).chosen.length : 0;
    },
    apply(output, mb) {
      const seqs = tableOf(mb);
      const pi = sequenceLogps(output, mb, o.cp);
      const n = seqs.chosen.length;
      const none = (loss: Tensor) => ({ loss, value: 0, metrics: Object.fromEntries(DPO_METRICS.map((k) => [k, 0])) });
      if (n === 0) return none(pi.sum().mul(0)); // no pair: no gradient, yet a loss to start backward from
      if (!seqs.ref) throw new Error('DPO: the reference log-probabilities of this micro-batch were not filled before the step (mb.seqs.ref)');
      if (seqs.ref.length !== seqs.nSeq) throw new Error(`DPO: ${seqs.ref.length} reference log-probabilities for ${seqs.nSeq} sequences`);
      let ref = tensor(seqs.ref, { dtype: pi.dtype });
      let policy = pi;
      if (o.loss === 'ipo') {
        const len = tensor(Float64Array.from(seqs.lengths, (k) => Math.max(k, 1)), { dtype: pi.dtype });
        policy = pi.div(len);
        ref = ref.div(len);
      }
      const c = tensor(seqs.chosen, { dtype: 'int64' });
      const r = tensor(seqs.rejected, { dtype: 'int64' });
      const chosen = policy.indexSelect(0, c).sub(ref.indexSelect(0, c)); // log-ratios to the reference
      const rejected = policy.indexSelect(0, r).sub(ref.indexSelect(0, r));
      const h = chosen.sub(rejected);
      const losses = o.loss === 'sigmoid' ? h.mul(o.beta).logSigmoid().neg() : h.sub(1 / (2 * o.beta)).square();
      const loss = losses.sum();
      if (!first) return none(loss);
      const [rc, rr] = noGrad(() => [Array.from(chosen.to('float64').toArray() as Float64Array, (x) => o.beta * x), Array.from(rejected.to('float64').toArray() as Float64Array, (x) => o.beta * x)]) as [number[], number[]];
      let sc = 0, sr = 0, acc = 0;
      for (let i = 0; i < n; i++) {
        sc += rc[i]!;
        sr += rr[i]!;
        if (rc[i]! > rr[i]!) acc++;
      }
      const value = noGrad(() => loss.to('float64').item());
      return { loss, value, metrics: { rewardsChosen: sc, rewardsRejected: sr, rewardsMargin: sc - sr, rewardsAccuracy: acc } };
    },
  };
}
