// Megatron-LM's communication ops for tensor and sequence parallelism, as differentiable functions
// over a tensor-parallel group (built on defineFunction, src/tensor/function.ts). Each op's
// backward is the adjoint of its forward:
//
//   op                      forward                              backward
//   copyToRegion            identity                             all-reduce (sum)
//   reduceFromRegion        all-reduce (sum)                     identity
//   gatherLastDim           all-gather along the last dim        keep this rank's slice
//   scatterLastDim          keep this rank's slice               all-gather along the last dim
//   gatherSequence          all-gather along dim 1 (tokens)      reduce-scatter along dim 1
//   reduceScatterSequence   reduce-scatter along dim 1           all-gather along dim 1
//   scatterSequence         keep this rank's tokens              all-gather along dim 1
//
// "Region" is the tensor-parallel region between a column-parallel and a row-parallel layer,
// where activations are sharded over the group. Every op is the identity on a group of one.
import { type Tensor, cat, defineFunction, empty, noGrad } from '../../tensor/index.js';
import type { ProcessGroup } from '../../distributed/process_group.js';

/**
 * Bytes the tensor-parallel collectives sent from this rank, by kind, as a ring sends them (bus
 * bytes): an all-reduce of S bytes over n ranks 2(n-1)/n S, an all-gather into S bytes or a
 * reduce-scatter of S bytes (n-1)/n S. Benchmarks compare them with Megatron's count.
 */
export const tpTraffic = { allReduce: 0, allGather: 0, reduceScatter: 0, calls: 0 };

/** Zeroes tpTraffic (benchmarks read it per step). */
export function resetTpTraffic(): void {
  tpTraffic.allReduce = tpTraffic.allGather = tpTraffic.reduceScatter = tpTraffic.calls = 0;
}

function bytesOf(t: Tensor): number {
  return t.numel() * (t.dtype === 'float64' ? 8 : t.dtype === 'float32' ? 4 : 2);
}

/** All-reduces a contiguous tensor in place over the group (counted in tpTraffic). */
export function allReduceInPlace(t: Tensor, g: ProcessGroup, op: 'sum' | 'max' = 'sum'): void {
  if (g.size === 1) return;
  tpTraffic.allReduce += (2 * (g.size - 1) / g.size) * bytesOf(t);
  tpTraffic.calls++;
  g.allReduce(t, op).wait();
}

/** Sum over the group, returning a new tensor (the input is left alone). */
export function allReduceSum(x: Tensor, g: ProcessGroup): Tensor {
  const out = noGrad(() => x.contiguous().clone());
  allReduceInPlace(out, g);
  return out;
}

/** Every member's x concatenated along `dim`, in group-rank order. */
export function allGatherDim(x: Tensor, g: ProcessGroup, dim: number): Tensor {
  if (g.size === 1) return x;
  return noGrad(() => {
    const xc = x.contiguous();
    const flat = empty([g.size * xc.numel()], { dtype: xc.dtype });
    tpTraffic.allGather += ((g.size - 1) / g.size) * bytesOf(flat);
    tpTraffic.calls++;
    g.allGatherInto(flat, xc.reshape(-1)).wait();
    const parts = flat.view(g.size, ...xc.shape).split(1, 0).map((p) => p.squeeze(0));
    const d = dim < 0 ? xc.ndim + dim : dim;
    return d === 0 ? flat.view(g.size * xc.shape[0]!, ...xc.shape.slice(1)) : cat(parts, d);
  });
}

/** The sum over the group of x, split along `dim`: this rank's part. */
export function reduceScatterDim(x: Tensor, g: ProcessGroup, dim: number): Tensor {
  if (g.size === 1) return x;
  return noGrad(() => {
    const d = dim < 0 ? x.ndim + dim : dim;
    const n = x.shape[d]!;
    if (n % g.size !== 0) throw new Error(`reduce-scatter along dim ${d}: size ${n} does not divide by the tensor-parallel degree ${g.size}`);
    // Chunks along dim, laid out one after another so chunk k is the k-th flat block.
    const input = d === 0 ? x.contiguous() : cat(x.chunk(g.size, d).map((c) => c.contiguous().reshape(-1)), 0);
    const shape = x.shape.slice();
    shape[d] = n / g.size;
    const out = empty(shape, { dtype: x.dtype });
    tpTraffic.reduceScatter += ((g.size - 1) / g.size) * bytesOf(input);
    tpTraffic.calls++;
    g.reduceScatter(out.reshape(-1), input.reshape(-1)).wait();
    return out;
  });
}

/** This rank's part of x split into group.size equal parts along `dim`. */
export function localSlice(x: Tensor, g: ProcessGroup, dim: number): Tensor {
  if (g.size === 1) return x;
  const d = dim < 0 ? x.ndim + dim : dim;
  const n = x.shape[d]!;
  if (n % g.size !== 0) throw new Error(`tensor parallelism: size ${n} along dim ${d} does not divide by the tensor-parallel degree ${g.size}`);
  return x.narrow(d, g.rank * (n / g.size), n / g.size).contiguous();
}

type Op = (x: Tensor, g: ProcessGroup) => Tensor;

/** A differentiable op from a forward and its adjoint, both (tensor, group) -> tensor. */
function commOp(name: string, fwd: Op, bwd: Op): Op {
  const f = defineFunction<[Tensor, ProcessGroup]>({
    forward(ctx, x, g) {
      ctx.state.g = g;
      return fwd(x, g);
    },
    backward(ctx, dy) {
      return [bwd(dy, ctx.state.g as ProcessGroup), undefined];
    },
  }, name);
  return (x, g) => (g.size === 1 ? x : (f(x, g) as Tensor));
}

const SEQ = 1;

/** Identity forward, all-reduce backward: the input of a column-parallel layer. */
export const copyToRegion = commOp('copyToRegion', (x) => x.clone(), allReduceSum);
/** All-reduce forward, identity backward: the output of a row-parallel layer. */
export const reduceFromRegion = commOp('reduceFromRegion', allReduceSum, (dy) => dy.clone());
/** All-gather along the last dim forward, this rank's slice backward. */
export const gatherLastDim = commOp('gatherLastDim', (x, g) => allGatherDim(x, g, -1), (dy, g) => localSlice(dy, g, -1));
/** This rank's slice of the last dim forward, all-gather backward. */
export const scatterLastDim = commOp('scatterLastDim', (x, g) => localSlice(x, g, -1), (dy, g) => allGatherDim(dy, g, -1));
/** Sequence parallelism: the whole sequence from every rank's tokens, reduce-scatter backward. */
export const gatherSequence = commOp('gatherSequence', (x, g) => allGatherDim(x, g, SEQ), (dy, g) => reduceScatterDim(dy, g, SEQ));
/** Sequence parallelism: summed partial outputs, each rank keeping its tokens; all-gather backward. */
export const reduceScatterSequence = commOp('reduceScatterSequence', (x, g) => reduceScatterDim(x, g, SEQ), (dy, g) => allGatherDim(dy, g, SEQ));
/** Sequence parallelism: this rank's tokens of a replicated activation; all-gather backward. */
export const scatterSequence = commOp('scatterSequence', (x, g) => localSlice(x, g, SEQ), (dy, g) => allGatherDim(dy, g, SEQ));
