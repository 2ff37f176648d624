// Mixed precision as a policy: one table says which op runs in which dtype, and the nn layers ask it
// (castFor / castParam) instead of carrying flags. The trainer opens one autocast() scope per step.
//
// [Note: bf16-mixed]
// - Master parameters, optimizer state and the flat gradient buckets stay float32 (Megatron's
//   main_grad): the never-None gradient views, the gradient API, clipping and checkpoints do not
//   know mixed precision exists.
// - A parameter's bfloat16 copy is made once per autocast scope (once per training step) with
//   autograd (`p.to('bfloat16')`, ToCopyBackward, which saves no tensors and so can be backpropagated
//   through once per micro-batch): its backward converts the bf16 weight gradient to float32 and the
//   engine accumulates it into the float32 .grad view, so each micro-batch's graph still reaches the
//   float32 leaf and the data-parallel readiness hooks fire as in float32. (ZeRO-3 makes no such
//   copy: see the end of this note.)
// - Activations are cast at the op that needs another dtype (LayerNorm's float32 output feeds a
//   bf16 Linear); the residual stream stays float32 (bf16 + fp32 promotes to fp32).
//
// The op list, and how it compares with PyTorch 1.13's CPU autocast (checked by
// test/precision_oracle.test.ts):
//   op          bf16-mixed   autocast(cpu, bf16)  why
//   linear      bfloat16     bfloat16             every Linear, the head included (autocast's lower-precision list)
//   matmul      bfloat16     bfloat16             attention's q@k^T (with its scale and mask) and att@v
//   softmax     bfloat16     bfloat16             in and out: the CPU kernels compute in float32 and round once
//   gelu        bfloat16     bfloat16             (test/precision_kernels.test.ts)
//   swiglu      float32      bfloat16             silu(gate) * up: libtorch's bf16 silu took 4.8 ms fwd + bwd per Llama block, float32 with its casts 2.2; one rounding, into down
//   layerNorm   float32      float32              its input is the float32 residual stream in both
//   rmsNorm     float32      float32              (a reduction: float32)
//   embedding   float32      float32              a gather from the float32 master weight
//   loss        float32      float32              cross-entropy is on autocast's float32 list
//   router      float32      (none)               an MoE router's scores (src/nn/moe.ts): a bf16 rounding can flip a choice
// Softmax still computes in float32, where precision matters: inside libtorch's bf16 kernel. Its
// forward is bit-identical to float32 then a cast, its backward within a bf16 ulp or two. libtorch
// 1.13's bf16 GELU (AVX2 and default kernels) rounds each of its steps to bfloat16 instead, as
// autocast's does: within 3u*|x| of exact forward and 5.35u*|g| backward (u = 2^-9; [Note: bf16 GELU
// bound] in test/precision_kernels.test.ts), against u*|y| for float32 then a cast. Their outputs
// feed bf16 matmuls, so a rounding happens anyway. Running them in bfloat16 saves two casts of the
// largest activations each way (about 10% of a bf16 step at width 256).
// Reductions (norms, clipping) are outside forward and stay float32/float64 as before.
// Under ZeRO-3 ([Note: bf16 gathers] in src/parallel/data_parallel/fsdp_bf16.ts) a unit's parameters are all
// gathered in bfloat16, as FSDP2's MixedPrecisionPolicy(param_dtype=bf16) does: layers read the
// gathered copy itself (no per-step copy), and the float32 ops above (layerNorm, rmsNorm,
// embedding) read an upcast of the bfloat16 weight, not the float32 master (their float32 weight
// gradients go to the master unrounded). So every layer asks
// castParam for every parameter, float32 ops included, and a module class declares that it does
// (readsParametersThroughPolicy); a unit holding a parameter of any other module is gathered in
// float32 and gets the per-step copies described above.
import { type Tensor, type DType, isGradEnabled, keep, getDefaultDtype } from '../tensor/index.js';
import type { PlanAxis } from '../distributed/plan_terms.js';

export type Precision = 'fp32' | 'bf16-mixed';
export const PRECISIONS: readonly Precision[] = ['fp32', 'bf16-mixed'];

export type OpClass = 'linear' | 'matmul' | 'softmax' | 'gelu' | 'swiglu' | 'layerNorm' | 'rmsNorm' | 'embedding' | 'loss' | 'router';

/** The table (see [Note: bf16-mixed]); fp32 has none: every op runs in its inputs' dtype. */
export const BF16_MIXED_OPS: Readonly<Record<OpClass, DType>> = {
  linear: 'bfloat16',
  matmul: 'bfloat16',
  softmax: 'bfloat16',
  gelu: 'bfloat16',
  swiglu: 'float32',
  layerNorm: 'float32',
  rmsNorm: 'float32',
  embedding: 'float32',
  loss: 'float32',
  router: 'float32',
};

/** Checks a precision name from a config or the API; fp16 is named as out of scope. */
export function parsePrecision(p: string): Precision {
  if ((PRECISIONS as readonly string[]).includes(p)) return p as Precision;
  if (/^(fp16|float16|16|16-mixed|fp16-mixed)$/.test(p)) {
    throw new Error(`precision "${p}": float16 is not supported (it needs loss scaling); use "bf16-mixed" or "fp32"`);
  }
  throw new Error(`precision "${p}" is not one of ${PRECISIONS.map((x) => `"${x}"`).join(', ')}`);
}

/**
 * Where a parameter's gathered low-precision copy comes from while ZeRO-3 holds one: given the
 * op's dtype, the copy (or its upcast) with a gradient path to the parameter; undefined when the
 * parameter's unit is not gathered that way now.
 */
export type GatheredSource = (dtype: DType) => Tensor | undefined;
const gatheredSources = new WeakMap<Tensor, GatheredSource>();

/** Registers (or, with undefined, removes) the gathered-copy source of a parameter (src/parallel/data_parallel/fsdp.ts). */
export function setGatheredSource(p: Tensor, source: GatheredSource | undefined): void {
  if (source) gatheredSources.set(p, source);
  else gatheredSources.delete(p);
}

const policyReaders: (abstract new (...args: any[]) => object)[] = [];

/**
 * Declares that instances of `cls` read every parameter they own through castParam, float32 ops
 * included, so ZeRO-3 may hold those parameters only as a gathered bfloat16 copy. A module that
 * reads a parameter directly must not be declared (its unit is then gathered in float32). A
 * subclass that defines its own forward is not covered by its parent's declaration.
 */
export function readsParametersThroughPolicy(cls: abstract new (...args: any[]) => object): void {
  if (!policyReaders.includes(cls)) policyReaders.push(cls);
}

/**
 * Whether a module's class, or a parent class whose forward it inherits, was declared with
 * readsParametersThroughPolicy. (A forward replaced on the instance, as tensor-parallel styles do,
 * is judged with the class: those wrappers read through castParam too.)
 */
export function isPolicyReader(m: object): boolean {
  for (let proto = Object.getPrototypeOf(m); proto && proto !== Object.prototype; proto = Object.getPrototypeOf(proto)) {
    if (policyReaders.includes(proto.constructor)) return true;
    if (Object.prototype.hasOwnProperty.call(proto, 'forward')) return false; // an undeclared class's own forward
  }
  return false;
}

interface Scope {
  ops: Readonly<Record<OpClass, DType>> | undefined;
  /** Parameter copies made in this scope, with and without autograd history. */
  withGrad: Map<Tensor, Tensor>;
  noGrad: Map<Tensor, Tensor>;
}

const scopes: Scope[] = [];

/**
 * Runs fn with a precision policy: layers inside cast as the table says. Parameter copies live as
 * long as the scope (one training step: open it around all micro-batches, close it before the
 * optimizer step, which changes the float32 masters the copies were made from).
 */
export function autocast<T>(precision: Precision, fn: () => T): T {
  const s: Scope = { ops: precision === 'bf16-mixed' ? BF16_MIXED_OPS : undefined, withGrad: new Map(), noGrad: new Map() };
  scopes.push(s);
  try {
    const r = fn();
    if (r instanceof Promise) throw new Error('autocast() takes a synchronous function');
    return r;
  } finally {
    scopes.pop();
    for (const t of s.withGrad.values()) t.dispose();
    for (const t of s.noGrad.values()) t.dispose();
  }
}

/** The precision in force ('fp32' outside any autocast scope). */
export function currentPrecision(): Precision {
  const s = scopes[scopes.length - 1];
  return s?.ops ? 'bf16-mixed' : 'fp32';
}

/** The dtype the policy gives an op, or undefined when it leaves the inputs' dtype alone. */
export function opDtype(op: OpClass): DType | undefined {
  return scopes[scopes.length - 1]?.ops?.[op];
}

/** Activations cast to the op's dtype (the same tensors when nothing changes). */
export function castFor(op: OpClass, ...xs: Tensor[]): Tensor[] {
  const d = opDtype(op);
  if (d === undefined) return xs;
  return xs.map((x) => (x.dtype === d || !isFloatingDtype(x.dtype) ? x : x.to(d)));
}

/**
 * A parameter in the op's dtype: one copy per scope, made with autograd so gradients reach the
 * float32 leaf; under ZeRO-3 bf16-mixed, the unit's gathered bfloat16 copy (upcast for float32 ops).
 */
export function castParam(op: OpClass, p: Tensor): Tensor;
export function castParam(op: OpClass, p: Tensor | undefined): Tensor | undefined;
export function castParam(op: OpClass, p: Tensor | undefined): Tensor | undefined {
  const s = scopes[scopes.length - 1];
  const d = s?.ops?.[op];
  if (p === undefined) return p;
  if (d === undefined) return p.dtype === 'bfloat16' ? widened(p) : p;
  // A ZeRO-3 unit gathered in bfloat16 has no float32 parameter to read: its copy (or an upcast of it).
  const gathered = gatheredSources.get(p)?.(d);
  if (gathered) return gathered;
  if (p.dtype === d) return p;
  // A copy made under noGrad has no path to the leaf: keep the two kinds apart.
  const cache = isGradEnabled() ? s!.withGrad : s!.noGrad;
  let c = cache.get(p);
  if (c === undefined || c.isDisposed) {
    c = keep(p.to(d));
    cache.set(p, c);
  }
  return c;
}

/**
 * [Note: bf16 base] A parameter stored in bfloat16 outside bf16-mixed (a frozen LoRA base,
 * applyLora's baseDtype, src/nn/lora.ts) is computed with in the compute dtype (the default dtype:
 * float32, float64 in float64 tests): widened where it is read, a new copy per read that lives only
 * as long as the op's graph keeps it (Linear keeps the bfloat16 weight instead, frozenLinear in
 * layers.ts). Widening is also the fast path on this machine: libtorch 1.13's CPU kernels have no
 * native bfloat16 GEMM (a bf16 matmul ran about 15x slower than float32), so a bfloat16 weight is
 * best multiplied as float32. Under bf16-mixed the policy's dtype decides instead, and a bfloat16
 * parameter is its own bfloat16 copy (no copy is made).
 */
function widened(p: Tensor): Tensor {
  const d = getDefaultDtype();
  return d === 'bfloat16' ? p : p.to(d);
}

/** The dtype a bfloat16 parameter is computed in outside bf16-mixed ([Note: bf16 base]); undefined for none. */
export function widenedDtype(p: Tensor): DType | undefined {
  if (p.dtype !== 'bfloat16' || opDtype('linear') !== undefined) return undefined;
  const d = getDefaultDtype();
  return d === 'bfloat16' ? undefined : d;
}

function isFloatingDtype(d: DType): boolean {
  return d === 'float32' || d === 'float64' || d === 'bfloat16' || d === 'float16';
}

/**
 * What bf16-mixed changes on a rank, for the planner ([Note: plan terms] in
 * src/distributed/plan_terms.ts): the float32 masters, gradients and optimizer state stay as they
 * are, and the step holds a bfloat16 copy of every parameter it computes with (made once per step,
 * dropped before the optimizer step). Its speed and activation bytes are measured, not derived: the
 * planner calibrates the model under the policy itself.
 */
export const precisionPlanAxis = {
  name: 'precision',
  fields: ['precision'] as const,
  apply(b, ctx) {
    // ZeRO-3 copies the gathered units only (counted with its gathers).
    // A LoRA base stored in bfloat16 is its own copy ([Note: bf16 base]).
    const own = ctx.model.lora?.baseBytes === 2 ? b.frozenParams : 0;
    if (ctx.layout.precision === 'bf16-mixed' && ctx.layout.zero !== 3) b.memory.bf16Copies += 2 * (b.params - own);
  },
} satisfies PlanAxis;
