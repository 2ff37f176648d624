// The language-model head: a Linear whose forward, asked with targets, returns the summed
// cross-entropy from its input hidden state (the chunked kernel, linear_cross_entropy.ts) instead of
// the logits.
//
// [Note: deferred head] Under `[train] kernels = "fused"` ([Note: kernel choice]) a model's training forward (gradients on)
// stops before its head and returns the final norm's output, recorded here as waiting for its head;
// the model's criterion then calls the head with the targets (headOutput). The head still runs
// through Module.call, so whatever wraps it acts as around any forward: ZeRO-3 gathers its unit
// before and regathers it for backward from the hook on its output (here the loss), tensor
// parallelism's lossParallel style prepares the input and adds the vocabulary shard to the request.
// A wrapper that does not pass the request on (LoRA's adapter on the head, a colwise head that
// gathers its logits) leaves the head computing logits, and the criterion takes the eager path on
// them; so does a frozen bfloat16 head (its widened GEMMs). Evaluation and generation run without
// gradients and get logits as before. Anything else that reads a model's output as logits goes
// through logitsOf.
import { type Tensor, isGradEnabled } from '../../tensor/index.js';
import { Linear } from '../layers.js';
import { castFor, castParam, readsParametersThroughPolicy, widenedDtype } from '../precision.js';
import { linearCrossEntropy, type VocabShard } from './linear_cross_entropy.js';
import { kernelChoice } from './choice.js';

/** What a loss asks of the head. */
export interface HeadLossRequest {
  /** Targets of the head's input rows ((B, T) for a (B, T, d) input); IGNORE_INDEX (-100) rows are left out. */
  targets: Tensor;
  labelSmoothing?: number;
  /** Set by tensor parallelism's lossParallel style: the head holds a vocabulary shard. */
  vocabShard?: VocabShard;
}

export class LMHead extends Linear {
  /** Logits (.., V); with a request, the summed cross-entropy (a scalar) when the head can compute it fused. */
  override forward(x: Tensor, req?: HeadLossRequest): Tensor {
    if (!req || !this.weight.requiresGrad && widenedDtype(this.weight) !== undefined) return super.forward(x);
    const [xc] = castFor('linear', x) as [Tensor];
    const w = castParam('linear', this.weight), b = castParam('linear', this.bias);
    const d = xc.shape[xc.ndim - 1]!;
    return linearCrossEntropy(xc.reshape(-1, d), w, req.targets.reshape(-1), {
      bias: b, labelSmoothing: req.labelSmoothing ?? 0, ...(req.vocabShard ? { vocabShard: req.vocabShard } : {}),
    }).loss;
  }
}
readsParametersThroughPolicy(LMHead);

const waiting = new WeakMap<Tensor, LMHead>();

/** The head's input in a fused training forward (gradients on), else the head's logits. */
export function runHead(head: LMHead, hidden: Tensor): Tensor {
  if (kernelChoice() !== 'fused' || !isGradEnabled()) return head.call(hidden);
  waiting.set(hidden, head);
  return hidden;
}

/**
 * What the loss reads from a model's output: a scalar, the summed cross-entropy, when the output is
 * a hidden state waiting for its head and the head computed it fused; else logits (the output
 * itself, or the waiting head's logits).
 */
export function headOutput(output: Tensor, req: HeadLossRequest): Tensor {
  const head = waiting.get(output);
  if (!head) return output;
  waiting.delete(output);
  return head.call(output, req);
}

/** A model's output as logits: the waiting head's when the output is its hidden state. */
export function logitsOf(output: Tensor): Tensor {
  const head = waiting.get(output);
  if (!head) return output;
  waiting.delete(output);
  return head.call(output);
}
