// Vocab-parallel cross-entropy (Megatron's, torchtitan's loss_parallel): the logits stay sharded
// over the vocabulary on the tensor-parallel group and are never gathered. Per row:
//   loss = log(sum_all exp(z - m)) - (z_target - m),   m = the row's max over every rank
// Each rank sums its own exp and picks the target logit if it holds that id; two all-reduces of one
// number per row (reduceFromRegion: the loss is replicated, so each rank's backward is its own
// part of softmax - onehot) and one max give the loss every rank agrees on.
import { type Tensor, noGrad } from '../../tensor/index.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import type { CrossEntropyFn } from '../../nn/functional.js';
import { allReduceInPlace, reduceFromRegion } from './comm.js';

/** Cross-entropy of logits (N, V/n) sharded over g's vocabulary rows against whole-vocabulary targets (N). */
export function vocabParallelCrossEntropy(g: ProcessGroup): CrossEntropyFn {
  return (logits, targets, opts) => {
    if ((opts.labelSmoothing ?? 0) !== 0) throw new Error('loss parallel: label smoothing is not supported; set parallel.lossParallel = false to use it');
    if (logits.ndim !== 2) throw new Error(`loss parallel: logits must be (N, V/tp), got [${logits.shape}]`);
    const Vl = logits.shape[1]!;
    const lo = g.rank * Vl;
    const ignore = opts.ignoreIndex ?? -100;
    const m = noGrad(() => {
      const mx = logits.amax(-1, true).contiguous();
      allReduceInPlace(mx, g, 'max');
      return mx;
    });
    const z = logits.sub(m);
    const sumExp = reduceFromRegion(z.exp().sum(-1), g);
    const mine = targets.ge(lo).to(z.dtype).mul(targets.lt(lo + Vl).to(z.dtype));
    const picked = z.gather(1, targets.sub(lo).clamp(0, Vl - 1).unsqueeze(1)).squeeze(1).mul(mine);
    const zTarget = reduceFromRegion(picked, g);
    const perRow = sumExp.log().sub(zTarget);
    const valid = targets.ne(ignore).to(z.dtype);
    const losses = perRow.mul(valid);
    const reduction = opts.reduction ?? 'mean';
    if (reduction === 'none') return losses;
    if (reduction === 'sum') return losses.sum();
    return losses.sum().div(valid.sum());
  };
}
