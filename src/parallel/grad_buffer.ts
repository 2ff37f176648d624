// [Note: flat buffers] The one gradient store under every parallel feature.
//
// Parameters of one dtype are laid out in a single contiguous parameter buffer and a matching
// gradient buffer, in reverse registration order (about the order backward produces gradients),
// cut into buckets of about `bucketBytes`. A parameter is never split across buckets. After
// construction:
//   - every parameter is a shaped view of the parameter buffer (its old storage is released), and
//   - every `param.grad` is a zero-initialised view of the gradient buffer, assigned once, so
//     autograd accumulates into the buffer in place and a gradient is never missing.
// Each bucket is padded to a multiple of `padMultiple` elements so that it splits evenly into
// `padMultiple` shards: data parallelism all-reduces a bucket, ZeRO reduce-scatters it and owns a
// shard, FSDP also shards the parameter bucket, and clipping and the gradient API read the same
// memory. Padding is zero and stays zero (nothing writes to it).
import { Tensor, zeros, noGrad, keep, elementSize, type DType } from '../tensor/index.js';

export interface ParamSlot {
  readonly name: string;
  readonly param: Tensor;
  readonly shape: readonly number[];
  /** Element offset of the parameter in the flat buffers. */
  readonly offset: number;
  readonly numel: number;
  readonly bucket: Bucket;
}

export interface Bucket {
  readonly index: number;
  /** Element range [offset, offset + numel) in the flat buffers; numel includes padding. */
  readonly offset: number;
  readonly numel: number;
  readonly slots: ParamSlot[];
  /** Views of this bucket's range. */
  readonly grad: Tensor;
  readonly data: Tensor;
}

export interface GradBufferOptions {
  /** Target bucket size in bytes (a bucket may exceed it to hold one large parameter). */
  bucketBytes?: number;
  /** Pad each bucket to a multiple of this many elements (the shard count, for ZeRO/FSDP). */
  padMultiple?: number;
}

/** Flat parameter and gradient buffers for the parameters of one dtype. */
export class GradBuffer {
  readonly dtype: DType;
  readonly numel: number;
  readonly data: Tensor;
  readonly grad: Tensor;
  readonly buckets: Bucket[] = [];
  readonly slots: ParamSlot[] = [];

  constructor(params: [string, Tensor][], opts: GradBufferOptions = {}) {
    if (params.length === 0) throw new Error('GradBuffer: no parameters');
    const dtype = params[0]![1].dtype;
    for (const [n, p] of params) {
      if (p.dtype !== dtype) throw new Error(`GradBuffer: parameter ${n} is ${p.dtype}, buffer is ${dtype}; group parameters by dtype`);
      if (!p.isLeaf) throw new Error(`GradBuffer: parameter ${n} is not a leaf tensor`);
    }
    this.dtype = dtype;
    const bucketBytes = opts.bucketBytes ?? 25 * 2 ** 20;
    const pad = opts.padMultiple ?? 1;
    const bucketElems = Math.max(1, Math.floor(bucketBytes / elementSize(dtype)));

    // Plan: reverse registration order, fill buckets, never split a parameter.
    type Plan = { members: { name: string; p: Tensor; numel: number; offset: number }[]; offset: number; numel: number };
    const plans: Plan[] = [];
    let cur: Plan | undefined;
    let offset = 0;
    for (const [name, p] of [...params].reverse()) {
      const n = p.numel();
      if (cur && cur.numel > 0 && cur.numel + n > bucketElems) {
        cur.numel = roundUp(cur.numel, pad);
        offset = cur.offset + cur.numel;
        cur = undefined;
      }
      if (!cur) {
        cur = { members: [], offset, numel: 0 };
        plans.push(cur);
      }
      cur.members.push({ name, p, numel: n, offset: cur.offset + cur.numel });
      cur.numel += n;
    }
    cur!.numel = roundUp(cur!.numel, pad);
    this.numel = cur!.offset + cur!.numel;

    this.data = keep(zeros([this.numel], { dtype }));
    this.grad = keep(zeros([this.numel], { dtype }));
    noGrad(() => {
      for (const plan of plans) {
        const bucket: Bucket = {
          index: this.buckets.length,
          offset: plan.offset,
          numel: plan.numel,
          slots: [],
          grad: keep(this.grad.narrow(0, plan.offset, plan.numel)),
          data: keep(this.data.narrow(0, plan.offset, plan.numel)),
        };
        for (const m of plan.members) {
          const shape = m.p.shape;
          const dataView = this.data.narrow(0, m.offset, m.numel).view(...shape);
          dataView.copy_(m.p);
          // The parameter object stays the same leaf (optimizers and hooks keep their references);
          // only its storage moves into the flat buffer.
          m.p.set_(dataView);
          dataView.dispose();
          const gradView = this.grad.narrow(0, m.offset, m.numel).view(...shape);
          m.p.grad = gradView;
          gradView.dispose();
          const slot: ParamSlot = { name: m.name, param: m.p, shape, offset: m.offset, numel: m.numel, bucket };
          bucket.slots.push(slot);
          this.slots.push(slot);
        }
        this.buckets.push(bucket);
      }
    });
  }

  /** Zeroes every gradient (one fill over the buffer; views stay assigned). */
  zeroGrad(): void {
    noGrad(() => this.grad.zero_());
  }

  dispose(): void {
    for (const b of this.buckets) {
      b.grad.dispose();
      b.data.dispose();
    }
    this.grad.dispose();
    this.data.dispose();
  }
}

/** A view of a parameter's gradient in its bucket, shaped like the parameter. */
export function gradView(slot: ParamSlot): Tensor {
  return slot.bucket.grad.narrow(0, slot.offset - slot.bucket.offset, slot.numel).view(...slot.shape);
}

function roundUp(n: number, m: number): number {
  return Math.ceil(n / m) * m;
}

/** Splits named parameters by dtype into one GradBuffer each (registration order kept). */
export function buildGradBuffers(params: [string, Tensor][], opts: GradBufferOptions = {}): GradBuffer[] {
  const byDtype = new Map<DType, [string, Tensor][]>();
  for (const e of params) {
    const d = e[1].dtype;
    if (!byDtype.has(d)) byDtype.set(d, []);
    byDtype.get(d)!.push(e);
  }
  return [...byDtype.values()].map((ps) => new GradBuffer(ps, opts));
}
