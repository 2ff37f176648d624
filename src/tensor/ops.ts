// The op table: every ATen operator flotilla calls, by schema name and overload. The addon converts
// arguments by the operator's own schema, so adding an op is one line here plus its TS method.
import { native, type NativeValue } from './native.js';

const OPS = {
  // elementwise
  add: ['aten::add', 'Tensor'], addScalar: ['aten::add', 'Scalar'], sub: ['aten::sub', 'Tensor'], subScalar: ['aten::sub', 'Scalar'],
  mul: ['aten::mul', 'Tensor'], mulScalar: ['aten::mul', 'Scalar'], div: ['aten::div', 'Tensor'], divScalar: ['aten::div', 'Scalar'],
  neg: ['aten::neg', ''], exp: ['aten::exp', ''], log: ['aten::log', ''], sqrt: ['aten::sqrt', ''], rsqrt: ['aten::rsqrt', ''],
  powScalar: ['aten::pow', 'Tensor_Scalar'], pow: ['aten::pow', 'Tensor_Tensor'], abs: ['aten::abs', ''], tanh: ['aten::tanh', ''],
  sigmoid: ['aten::sigmoid', ''], logSigmoid: ['aten::log_sigmoid', ''], relu: ['aten::relu', ''], gelu: ['aten::gelu', ''], silu: ['aten::silu', ''],
  sin: ['aten::sin', ''], cos: ['aten::cos', ''], reciprocal: ['aten::reciprocal', ''], sign: ['aten::sign', ''],
  square: ['aten::square', ''], addcmul: ['aten::addcmul', ''], maximum: ['aten::maximum', ''], minimum: ['aten::minimum', ''],
  softmax: ['aten::softmax', 'int'], logSoftmax: ['aten::log_softmax', 'int'],
  // comparison and selection
  eq: ['aten::eq', 'Tensor'], eqScalar: ['aten::eq', 'Scalar'], ne: ['aten::ne', 'Tensor'], neScalar: ['aten::ne', 'Scalar'],
  lt: ['aten::lt', 'Tensor'], ltScalar: ['aten::lt', 'Scalar'], le: ['aten::le', 'Tensor'], leScalar: ['aten::le', 'Scalar'],
  gt: ['aten::gt', 'Tensor'], gtScalar: ['aten::gt', 'Scalar'], ge: ['aten::ge', 'Tensor'], geScalar: ['aten::ge', 'Scalar'],
  where: ['aten::where', 'self'], clamp: ['aten::clamp', ''], isnan: ['aten::isnan', ''], isfinite: ['aten::isfinite', ''],
  logicalNot: ['aten::logical_not', ''], logicalAnd: ['aten::logical_and', ''], logicalOr: ['aten::logical_or', ''], any: ['aten::any', ''], all: ['aten::all', ''],
  maskedFill: ['aten::masked_fill', 'Scalar'], maskedFill_: ['aten::masked_fill_', 'Scalar'],
  // linear algebra
  matmul: ['aten::matmul', ''], mm: ['aten::mm', ''], bmm: ['aten::bmm', ''], baddbmm: ['aten::baddbmm', ''], linear: ['aten::linear', ''],
  // reductions
  sum: ['aten::sum', ''], sumDim: ['aten::sum', 'dim_IntList'], mean: ['aten::mean', ''], meanDim: ['aten::mean', 'dim'],
  max: ['aten::max', ''], maxDim: ['aten::max', 'dim'], min: ['aten::min', ''], minDim: ['aten::min', 'dim'],
  amax: ['aten::amax', ''], amin: ['aten::amin', ''],
  argmax: ['aten::argmax', ''], argmin: ['aten::argmin', ''], norm: ['aten::linalg_vector_norm', ''],
  var: ['aten::var', 'correction'], prod: ['aten::prod', ''],
  // shape and indexing
  view: ['aten::view', ''], viewDtype: ['aten::view', 'dtype'], reshape: ['aten::reshape', ''], permute: ['aten::permute', ''], transpose: ['aten::transpose', 'int'],
  contiguous: ['aten::contiguous', ''], narrow: ['aten::narrow', ''], slice: ['aten::slice', 'Tensor'], select: ['aten::select', 'int'],
  cat: ['aten::cat', ''], stack: ['aten::stack', ''], split: ['aten::split', 'Tensor'], splitSizes: ['aten::split_with_sizes', ''],
  chunk: ['aten::chunk', ''], unbind: ['aten::unbind', 'int'], flatten: ['aten::flatten', 'using_ints'], squeeze: ['aten::squeeze', ''], squeezeDim: ['aten::squeeze', 'dim'],
  unsqueeze: ['aten::unsqueeze', ''], expand: ['aten::expand', ''], indexSelect: ['aten::index_select', ''], gather: ['aten::gather', ''],
  repeat: ['aten::repeat', ''], sortStable: ['aten::sort', 'stable'], indexAdd: ['aten::index_add', ''], tril: ['aten::tril', ''], triu: ['aten::triu', ''], flip: ['aten::flip', ''],
  // conversion and copies
  to: ['aten::to', 'dtype'], clone: ['aten::clone', ''], detach: ['aten::detach', ''], item: ['aten::item', ''],
  // in-place (optimizers, buffers)
  add_: ['aten::add_', 'Tensor'], addScalar_: ['aten::add_', 'Scalar'], sub_: ['aten::sub_', 'Tensor'],
  mul_: ['aten::mul_', 'Tensor'], mulScalar_: ['aten::mul_', 'Scalar'], div_: ['aten::div_', 'Tensor'], divScalar_: ['aten::div_', 'Scalar'],
  addcmul_: ['aten::addcmul_', ''], addcdiv_: ['aten::addcdiv_', ''], lerp_: ['aten::lerp_', 'Scalar'], lerpTensor_: ['aten::lerp_', 'Tensor'],
  copy_: ['aten::copy_', ''], zero_: ['aten::zero_', ''], fill_: ['aten::fill_', 'Scalar'], clamp_: ['aten::clamp_', ''],
  sqrt_: ['aten::sqrt_', ''], set_: ['aten::set_', 'source_Tensor'], normal_: ['aten::normal_', ''], uniform_: ['aten::uniform_', ''],
  // creation
  empty: ['aten::empty', 'memory_format'], zeros: ['aten::zeros', ''], ones: ['aten::ones', ''], full: ['aten::full', ''],
  arange: ['aten::arange', 'start_step'], rand: ['aten::rand', ''], randn: ['aten::randn', ''], randint: ['aten::randint', 'low'],
  zerosLike: ['aten::zeros_like', ''], onesLike: ['aten::ones_like', ''], fullLike: ['aten::full_like', ''],
  randnLike: ['aten::randn_like', ''], randLike: ['aten::rand_like', ''], emptyLike: ['aten::empty_like', ''],
  // neural-network functions
  embedding: ['aten::embedding', ''], layerNorm: ['aten::layer_norm', ''], dropout: ['aten::dropout', ''],
  crossEntropy: ['aten::cross_entropy_loss', ''], mseLoss: ['aten::mse_loss', ''],
} as const satisfies Record<string, readonly [string, string]>;

export type OpName = keyof typeof OPS;

const ids = new Map<OpName, number>();

/** Calls an ATen op by its table name; arguments are positional in schema order. */
export function callOp(name: OpName, args: unknown[]): NativeValue {
  let id = ids.get(name);
  if (id === undefined) {
    const [schema, overload] = OPS[name];
    id = native.lookupOp(schema, overload);
    ids.set(name, id);
  }
  return native.callOp(id, args);
}
