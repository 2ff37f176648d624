// A ZeRO-3 unit's bfloat16 copy under bf16-mixed (FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
// reduce_dtype=fp32)).
//
// [Note: bf16 gathers]
// - Under bf16-mixed a unit's gather casts this rank's float32 shard to bfloat16 and all-gathers
//   bfloat16 into a flat bfloat16 buffer the size of the unit's bucket: half the bytes on the wire,
//   and the float32 full bucket is not materialised in such a step. This buffer is what the unit
//   lifecycle ([Note: unit lifecycle] in fsdp.ts) allocates and frees. Paths that need float32 full
//   parameters (withFullParameters: checkpoints, export; a forward outside bf16-mixed) still gather
//   the float32 bucket.
// - Each parameter has one bfloat16 alias of its range in the buffer, made once, with its own
//   version counter (writes into the buffer go through the flat tensor, so the counters autograd
//   checks on saved tensors do not move). Layers get it through castParam ([Note: bf16-mixed] in
//   src/nn/precision.ts): no cast per op or per step. The tensors autograd saves are these aliases,
//   so they lose their bytes when the unit is freed after forward and see the regathered bytes in
//   backward, which is what keeps ZeRO-3's memory saving on the bfloat16 side.
// - castParam gets, per call, the alias as the output of a custom autograd function whose input
//   is the float32 parameter ([Note: alias gradient]); a float32 op (LayerNorm, embedding) gets an
//   upcast of the alias from the same function instead.
// - Only units whose parameters are all read through the policy (readsParametersThroughPolicy) are
//   gathered this way; any other unit is gathered in float32 and gets castParam's per-step copies.
//
// [Note: alias gradient] The function's forward returns the alias itself, and the function node
// ([Note: function node] in src/tensor/function.ts) hands out an alias of it: the same storage, no
// copy, its grad_fn the node with an edge to the float32 parameter. The node reads nothing of the
// parameter (whose float32 storage is not there). Its backward converts the gradient to float32
// and the engine accumulates it into the parameter's .grad view of the flat bucket, so the
// reducer's hooks on the parameter fire as for castParam's float32-path copy (ToCopyBackward),
// once per backward that reaches it, all uses summed first; a backward with `inputs` naming the
// parameters (activation checkpointing's recompute asks for them) reaches them too. For an upcast the forward returns a float32 copy and its gradient, already float32,
// goes to the parameter without being rounded to bfloat16.
import { type Tensor, type DType, defineFunction, emptyMapped, noGrad, keep } from '../../tensor/index.js';
import { freeStorage, type Bucket } from './grad_buffer.js';

// [Note: alias gradient]
const fromAlias = defineFunction<[Tensor, Tensor, DType]>({
  forward(_ctx, _param, alias, dtype) {
    return alias.dtype === dtype ? alias : alias.to(dtype);
  },
  backward(_ctx, g) {
    return [g, undefined, undefined]; // converted to the parameter's float32 by the function
  },
}, 'GatheredParam');

export class Bf16UnitCopy {
  /** The unit's parameters in bfloat16, flat like its bucket (storage freed between uses). */
  readonly data: Tensor;
  private readonly aliases = new Map<Tensor, Tensor>();

  constructor(bucket: Bucket) {
    this.data = keep(emptyMapped([bucket.numel + bucket.frozenNumel], { dtype: 'bfloat16' }));
    noGrad(() => {
      for (const s of [...bucket.slots, ...bucket.frozenSlots]) {
        const v = this.data.narrow(0, s.offset - bucket.offset, s.numel).view(...s.shape);
        this.aliases.set(s.param, keep(v.variableData())); // the same storage, its own version counter
        v.dispose();
      }
    });
    freeStorage(this.data);
  }

  /**
   * The parameter in `dtype` from this copy (its bytes must be there): the bfloat16 alias itself,
   * or an upcast, with a gradient path to the float32 parameter ([Note: alias gradient]).
   */
  param(param: Tensor, dtype: DType): Tensor {
    return fromAlias(param, this.aliases.get(param)!, dtype) as Tensor;
  }

  dispose(): void {
    for (const a of this.aliases.values()) a.dispose();
    this.aliases.clear();
    this.data.dispose();
  }
}
