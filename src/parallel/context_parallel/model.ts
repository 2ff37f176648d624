// Context parallelism as a ParallelModel: the layout's model (data parallel, ZeRO, pipeline, tensor
// parallel) with each micro-batch's sequences cut to this rank's two chunks ([Note: load-balanced
// chunks] in ring_attention.ts) and the step run inside a sequence shard ([Note: sequence shard] in
// src/nn/sequence_shard.ts), so the model takes its positions at each token's global index and its
// attention from the ring.
//
// [Note: context parallelism] The cp ranks of one data-parallel rank read the same samples and hold
// the same parameters: to the gradient reduction they are data-parallel ranks like the others (the
// mesh's dp group spans dpReplicate x dpShard x cp and its shard group dpShard x cp, torchtitan's
// dp_shard_cp), so ZeRO shards over both and the buckets are averaged over dp x cp. The targets
// are chunked before the criterion counts them, so each cp rank's sum and count cover its own
// chunks: they partition the sequences' tokens, and the sum over dp x cp over the global count
// ([Note: global loss reduction] in ../loss_reduction.ts) is one process's loss and gradient, however
// the trained tokens fall among the chunks. A micro-batch's documents and preference sequences are
// chunked alike (the ring masks with the whole rows' document ids, DocumentLayout.full).
import { type Tensor, arange, cat, empty } from '../../tensor/index.js';
import type { ProcessGroup } from '../../distributed/process_group.js';
import { withSequenceShard, type SequenceShard } from '../../nn/sequence_shard.js';
import { documents } from '../../nn/documents.js';
import { WrappedModel, disposeDocuments, type MicroBatch, type ParallelModel, type StageValue, type StepResult } from '../parallel_model.js';
import { meanOverRanks } from '../data_parallel/model.js';
import { chunksOf, ringAttention } from './ring_attention.js';
import { axisStride, computeBytes, crossesHosts, type PlanAxis } from '../../distributed/plan_terms.js';

/** The sequence shard of cp rank group.rank: its chunks' global positions and the ring's attention (calls counted). */
export function ringShard(group: ProcessGroup): SequenceShard & { attentionCalls: number } {
  const [a, b] = chunksOf(group.rank, group.size);
  return {
    attentionCalls: 0,
    positions(T) {
      const c = T / 2;
      return cat([arange(a * c, (a + 1) * c), arange(b * c, (b + 1) * c)]);
    },
    attention(q, k, v, scale, window) {
      this.attentionCalls++;
      // Packed rows: every rank holds the whole rows' document ids ([Note: ring documents]).
      return ringAttention(q, k, v, group, scale, documents()?.full, undefined, window);
    },
    wholeSequences(t) {
      const C = group.size, c = t.shape[1]! / 2;
      const parts = Array.from({ length: C }, () => empty(t.shape, { dtype: t.dtype }));
      group.allGather(parts, t.contiguous()).wait();
      const chunks = new Array<Tensor>(2 * C);
      parts.forEach((p, s) => {
        const [a, b] = chunksOf(s, C);
        chunks[a] = p.narrow(1, 0, c);
        chunks[b] = p.narrow(1, c, c);
      });
      return cat(chunks, 1);
    },
  };
}

/** This rank's two chunks of every sequence of t (sequences along dim 1). */
export function sequenceChunks(t: Tensor, group: ProcessGroup): Tensor {
  const C = group.size, T = t.shape[1];
  if (T === undefined) {
    throw new Error(`context parallelism cuts every micro-batch tensor along dim 1, the sequence, and a tensor of shape [${t.shape}] has none: it applies to models whose inputs and targets are per token (B, T, ...), not per sequence; set parallel.cp = 1`);
  }
  if (T % (2 * C) !== 0) {
    throw new Error(`context parallelism: a micro-batch tensor of shape [${t.shape}] does not split into ${2 * C} chunks along dim 1 (the sequence); its length must divide by 2 x parallel.cp = ${2 * C}`);
  }
  const c = T / (2 * C);
  const [a, b] = chunksOf(group.rank, C);
  return cat([t.narrow(1, a * c, c), t.narrow(1, b * c, c)], 1);
}

function chunksOfValue(v: StageValue, group: ProcessGroup): StageValue {
  return Array.isArray(v) ? (v as readonly Tensor[]).map((t) => sequenceChunks(t, group)) : sequenceChunks(v as Tensor, group);
}

export class ContextParallelModel extends WrappedModel {
  private readonly shard: ReturnType<typeof ringShard>;
  private attentionSeen = false;

  /** `stages`: the pipeline ranks of this rank's position (a group of one without a pipeline). */
  constructor(inner: ParallelModel, readonly group: ProcessGroup, private readonly stages: ProcessGroup) {
    super(inner);
    this.shard = ringShard(group);
  }

  /** This rank's chunks of each micro-batch: x, y, the documents (the whole rows own and free their chunks) and the sequence index. */
  private local(microBatches: MicroBatch[]): MicroBatch[] {
    return microBatches.map((mb) => ({
      x: chunksOfValue(mb.x, this.group),
      y: chunksOfValue(mb.y, this.group),
      ...(mb.docs ? { docs: mb.docs.chunked(this.group) } : {}),
      ...(mb.seqs ? { seqs: { ...mb.seqs, index: sequenceChunks(mb.seqs.index, this.group) } } : {}),
    }));
  }

  /** Runs fn on this rank's chunks inside the sequence shard; the whole rows' documents are disposed after when `dispose`. */
  private onChunks<R>(microBatches: MicroBatch[], fn: (local: MicroBatch[]) => R, dispose: boolean): R {
    try {
      return withSequenceShard(this.shard, () => fn(this.local(microBatches)));
    } finally {
      if (dispose) disposeDocuments(microBatches);
    }
  }

  override step(microBatches: MicroBatch[]): StepResult {
    const r = this.onChunks(microBatches, (local) => this.inner.step(local), true);
    // A model whose attention does not go through the shard would attend within its own chunks
    // only: wrong without any error, so it is refused after the first step. Counted over the
    // pipeline's stages (a stage may hold no attention), so that every rank decides alike.
    if (!this.attentionSeen) {
      this.attentionSeen = meanOverRanks(this.stages, this.shard.attentionCalls) > 0;
      if (!this.attentionSeen) throw new Error(`parallel.cp = ${this.group.size}: the model ran no attention through the sequence shard, so its tokens would only see their own rank's chunks; context parallelism needs a model whose causal attention calls sequenceShard().attention (src/nn/sequence_shard.ts; the GPT's and the Llama's do). Set parallel.cp = 1`);
    }
    return r;
  }
  override evaluate(microBatches: MicroBatch[]): StepResult {
    return this.onChunks(microBatches, (local) => this.inner.evaluate(local), true);
  }
  /** The inner forwardOnly on this rank's chunks: `read` sees chunks (summing over cp is the reader's). */
  override forwardOnly(microBatches: MicroBatch[], read: (output: StageValue, mb: MicroBatch) => Float64Array): Float64Array[] {
    return this.onChunks(microBatches, (local) => this.inner.forwardOnly(local, read), false);
  }
  override summary(): string {
    return `context parallel ${this.group.size} (ring attention over ${2 * this.group.size} chunks); ${this.inner.summary()}`;
  }
}

/**
 * What context parallelism changes on a rank, for the planner ([Note: plan terms] in
 * src/distributed/plan_terms.ts; [Note: context parallelism]): the rank computes 1 / cp of each
 * sequence's tokens (its two chunks) with every parameter; its gradients are reduced and sharded
 * with the data-parallel ranks (the data-parallel axis counts cp in). Ring attention passes this
 * rank's keys and values around the ring in forward (cp - 1 steps per block) and keys, values and
 * their gradients in backward (twice that).
 */
export const contextParallelPlanAxis = {
  name: 'context parallel',
  fields: ['cp'] as const,
  apply(b, ctx) {
    const l = ctx.layout;
    if (l.cp === 1) return;
    b.tokens = b.tokens / l.cp;
    const elem = computeBytes(l);
    const kv = 2 * b.samples * b.tokens * (ctx.model.nEmbd / l.tp) * elem;
    b.comm.push({
      what: 'ring attention keys/values (and their gradients)', op: 'sendRecv', group: l.cp, bytes: kv, times: 3 * (l.cp - 1) * b.blocks * l.microBatches, overlaps: 'none', inStep: 'cp',
      crossHost: crossesHosts(axisStride(l, 'cp'), l.cp, ctx.ranksPerHost),
    });
  },
} satisfies PlanAxis;
