// [Note: pointwise kernels] RMSNorm, LayerNorm, SwiGLU, GELU and rotary, forward and backward, each
// one pass over its rows (pointwise_kernel.h): where the op-by-op path writes and reads a tensor per
// step (the mean square, the normalised x, sigmoid, the swapped halves ...), these read their inputs
// once and write their outputs once. Computation only; when they run is TypeScript's choice
// (src/nn/kernels/pointwise.ts). float32, float64 and bfloat16 (bfloat16 computed in float32).
//   - the norms save per row the inverse rms (and LayerNorm's mean) in the accumulation type; their
//     backward sums dweight (and dbias) into one partial row per chunk of rows (a few per thread),
//     never a (rows x d) temporary.
//   - rotary takes x (B, T, H, D) and cos / signed sin tables (T, D) or (B, T, D); backward is the
//     rotation by -theta of the gradient.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace flotilla {
namespace pointwise {

struct Bf16 {
  uint16_t x;
};

struct Norm {
  const void *x, *w, *b, *dy;
  void *y, *dx, *dw, *db, *mean, *rstd;  // mean and rstd: written by forward, read by backward
  int64_t rows, d, chunks;
  double eps;
  bool layer;
};
struct Elementwise {
  const void *a, *b, *dy;
  void *out, *da, *db;
  bool tanh;
};
struct Rotation {
  const void *x, *cos, *sin;
  void* out;
  int64_t T, H, D;
  bool perBatch, inverse;
};

#define KERNEL_HEADER "pointwise_kernel.h"
#include "kernel_variants.h"

// Picks the entry for a dtype and the CPU: PICK(Name) is avx2::NameF32 or base::NameF32 ...
#define PICK(st, Name)                                                               \
  ((st) == at::kFloat ? (HasAvx2() ? avx2::Name##F32 : base::Name##F32)              \
   : (st) == at::kDouble ? (HasAvx2() ? avx2::Name##F64 : base::Name##F64)           \
                         : (HasAvx2() ? avx2::Name##BF16 : base::Name##BF16))

static at::ScalarType AccType(at::ScalarType st) { return st == at::kDouble ? at::kDouble : at::kFloat; }

static void CheckDtype(const at::Tensor& t, const char* what) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kBFloat16, what, " takes float32, float64 or bfloat16, got ", DescribeTensor(t));
}

static at::Tensor Optional(const Napi::Value& v) {
  return v.IsUndefined() || v.IsNull() ? at::Tensor() : TensorHandle::Get(v);
}

// Elementwise work in chunks of a few blocks, the range split over threads.
template <typename P>
static void Parallel(int64_t n, const P& p, void (*fn)(const P&, int64_t, int64_t)) {
  at::parallel_for(0, n, 8 * 512, [&](int64_t b, int64_t e) { fn(p, b, e); });
}

// normForward(x, weight, bias?, eps, layer) -> [y, rstd, mean?]: over the last dim; weight and bias
// (d) in x's dtype; rstd and mean (x's leading shape) in the accumulation type.
static Napi::Value NormForward(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor x = TensorHandle::Get(info[0]).contiguous();
  CheckDtype(x, "a fused norm");
  const auto st = x.scalar_type();
  const int64_t d = x.size(-1);
  const at::Tensor w = TensorHandle::Get(info[1]).to(st).contiguous(), bias = Optional(info[2]);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == d, "the norm's weight must be (", d, "), got ", DescribeTensor(w));
  const at::Tensor b = bias.defined() ? bias.to(st).contiguous() : bias;
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == d), "the norm's bias must be (", d, "), got ", DescribeTensor(b));
  const bool layer = info[4].As<Napi::Boolean>().Value();
  Norm p{};
  p.rows = d == 0 ? 0 : x.numel() / d, p.d = d, p.eps = info[3].As<Napi::Number>().DoubleValue(), p.layer = layer;
  at::Tensor y = at::empty_like(x), rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(AccType(st)));
  at::Tensor mean = layer ? at::empty_like(rstd) : at::Tensor();
  p.x = x.data_ptr(), p.w = w.data_ptr(), p.b = b.defined() ? b.data_ptr() : nullptr;
  p.y = y.data_ptr(), p.rstd = rstd.data_ptr(), p.mean = layer ? mean.data_ptr() : nullptr;
  const auto fn = PICK(st, NormForward);
  at::parallel_for(0, p.rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(d, 1)), [&](int64_t r0, int64_t r1) { fn(p, r0, r1); });
  return layer ? WrapTensors(env, {y, rstd, mean}) : WrapTensors(env, {y, rstd});
  FLOTILLA_CATCH(env, "normForward")
}

// normBackward(dy, x, weight, withBias, rstd, mean?) -> [dx, dweight, dbias?] (LayerNorm when mean is given).
static Napi::Value NormBackward(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor x = TensorHandle::Get(info[1]).contiguous();
  CheckDtype(x, "a fused norm");
  const auto st = x.scalar_type(), acc = AccType(st);
  const at::Tensor dy = TensorHandle::Get(info[0]).to(st).contiguous(), w = TensorHandle::Get(info[2]).to(st).contiguous();
  const bool withBias = info[3].As<Napi::Boolean>().Value();
  const at::Tensor rstd = TensorHandle::Get(info[4]).to(acc).contiguous(), meanIn = Optional(info[5]);
  const at::Tensor mean = meanIn.defined() ? meanIn.to(acc).contiguous() : meanIn;
  TORCH_CHECK(dy.sizes() == x.sizes(), "dy must have x's shape ", DescribeTensor(x), ", got ", DescribeTensor(dy));
  Norm p{};
  p.d = x.size(-1), p.rows = p.d == 0 ? 0 : x.numel() / p.d, p.layer = mean.defined();
  TORCH_CHECK(rstd.numel() == p.rows && w.numel() == p.d, "rstd must have a value per row and weight one per column");
  // A few chunks per thread (rows split evenly); each sums its own partial dweight row.
  p.chunks = std::max<int64_t>(1, std::min<int64_t>(p.rows, 4 * at::get_num_threads()));
  at::Tensor dx = at::empty_like(x), dw = at::zeros({p.chunks, p.d}, x.options().dtype(acc));
  at::Tensor db = withBias ? at::zeros({p.chunks, p.d}, x.options().dtype(acc)) : at::Tensor();
  p.x = x.data_ptr(), p.dy = dy.data_ptr(), p.w = w.data_ptr(), p.rstd = rstd.data_ptr(), p.mean = p.layer ? mean.data_ptr() : nullptr;
  p.dx = dx.data_ptr(), p.dw = dw.data_ptr(), p.db = withBias ? db.data_ptr() : nullptr;
  const auto fn = PICK(st, NormBackward);
  at::parallel_for(0, p.chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) fn(p, c);
  });
  const at::Tensor dweight = dw.sum(0).to(st);
  return withBias ? WrapTensors(env, {dx, dweight, db.sum(0).to(st)}) : WrapTensors(env, {dx, dweight});
  FLOTILLA_CATCH(env, "normBackward")
}

// swigluForward(gate, up) -> silu(gate) * up, in the two inputs' promoted dtype.
static Napi::Value SwigluForward(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor a0 = TensorHandle::Get(info[0]), b0 = TensorHandle::Get(info[1]);
  TORCH_CHECK(a0.sizes() == b0.sizes(), "gate and up must have one shape, got ", DescribeTensor(a0), " and ", DescribeTensor(b0));
  const auto st = at::result_type(a0, b0);
  const at::Tensor a = a0.to(st).contiguous(), b = b0.to(st).contiguous();
  CheckDtype(a, "fused SwiGLU");
  at::Tensor out = at::empty_like(a);
  Elementwise p{};
  p.a = a.data_ptr(), p.b = b.data_ptr(), p.out = out.data_ptr();
  Parallel(a.numel(), p, PICK(st, SwigluForward));
  return TensorHandle::Wrap(env, out);
  FLOTILLA_CATCH(env, "swigluForward")
}

// swigluBackward(dy, gate, up) -> [dgate, dup]
static Napi::Value SwigluBackward(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor a0 = TensorHandle::Get(info[1]), b0 = TensorHandle::Get(info[2]);
  const auto st = at::result_type(a0, b0);
  const at::Tensor a = a0.to(st).contiguous(), b = b0.to(st).contiguous(), dy = TensorHandle::Get(info[0]).to(st).contiguous();
  CheckDtype(a, "fused SwiGLU");
  TORCH_CHECK(a.sizes() == b.sizes() && dy.sizes() == a.sizes(), "dy, gate and up must have one shape");
  at::Tensor da = at::empty_like(a), db = at::empty_like(a);
  Elementwise p{};
  p.a = a.data_ptr(), p.b = b.data_ptr(), p.dy = dy.data_ptr(), p.da = da.data_ptr(), p.db = db.data_ptr();
  Parallel(a.numel(), p, PICK(st, SwigluBackward));
  return WrapTensors(env, {da, db});
  FLOTILLA_CATCH(env, "swigluBackward")
}

// geluForward(x, tanh) -> gelu(x), exact (erf) or with the tanh approximation.
static Napi::Value GeluForward(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor x = TensorHandle::Get(info[0]).contiguous();
  CheckDtype(x, "fused GELU");
  at::Tensor out = at::empty_like(x);
  Elementwise p{};
  p.a = x.data_ptr(), p.out = out.data_ptr(), p.tanh = info[1].As<Napi::Boolean>().Value();
  Parallel(x.numel(), p, PICK(x.scalar_type(), GeluForward));
  return TensorHandle::Wrap(env, out);
  FLOTILLA_CATCH(env, "geluForward")
}

// geluBackward(dy, x, tanh) -> dx
static Napi::Value GeluBackward(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor x = TensorHandle::Get(info[1]).contiguous();
  CheckDtype(x, "fused GELU");
  const at::Tensor dy = TensorHandle::Get(info[0]).to(x.scalar_type()).contiguous();
  TORCH_CHECK(dy.sizes() == x.sizes(), "dy must have x's shape ", DescribeTensor(x));
  at::Tensor dx = at::empty_like(x);
  Elementwise p{};
  p.a = x.data_ptr(), p.dy = dy.data_ptr(), p.da = dx.data_ptr(), p.tanh = info[2].As<Napi::Boolean>().Value();
  Parallel(x.numel(), p, PICK(x.scalar_type(), GeluBackward));
  return TensorHandle::Wrap(env, dx);
  FLOTILLA_CATCH(env, "geluBackward")
}

// rotary(x, cos, sinSigned, inverse) -> x (B, T, H, D) rotated, in x's and the tables' promoted
// dtype; tables (T, D), (1, T, D) or (B, T, D).
static Napi::Value Rotary(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor x0 = TensorHandle::Get(info[0]), c0 = TensorHandle::Get(info[1]), s0 = TensorHandle::Get(info[2]);
  TORCH_CHECK(x0.dim() == 4 && x0.size(3) % 2 == 0, "rotary takes x (B, T, H, D) with D even, got ", DescribeTensor(x0));
  const int64_t B = x0.size(0), T = x0.size(1), D = x0.size(3);
  TORCH_CHECK(c0.sizes() == s0.sizes(), "cos and sin must have one shape");
  const bool perBatch = c0.dim() == 3 && c0.size(0) == B && B > 1;
  const bool fits = c0.size(-1) == D && c0.size(-2) == T && (c0.dim() == 2 || (c0.dim() == 3 && (c0.size(0) == 1 || c0.size(0) == B)));
  TORCH_CHECK(fits, "rotary tables must be (T, D), (1, T, D) or (B, T, D) for x ", DescribeTensor(x0), ", got ", DescribeTensor(c0));
  const auto st = at::result_type(x0, c0);
  const at::Tensor x = x0.to(st).contiguous();
  CheckDtype(x, "fused rotary");
  const at::Tensor c = c0.to(AccType(st)).contiguous(), s = s0.to(AccType(st)).contiguous();
  at::Tensor out = at::empty_like(x);
  Rotation p{};
  p.x = x.data_ptr(), p.cos = c.data_ptr(), p.sin = s.data_ptr(), p.out = out.data_ptr();
  p.T = T, p.H = x.size(2), p.D = D, p.perBatch = perBatch, p.inverse = info[3].As<Napi::Boolean>().Value();
  const auto fn = PICK(st, Rotate);
  at::parallel_for(0, B * T, std::max<int64_t>(1, 4096 / std::max<int64_t>(p.H * D, 1)), [&](int64_t r0, int64_t r1) { fn(p, r0, r1); });
  return TensorHandle::Wrap(env, out);
  FLOTILLA_CATCH(env, "rotary")
}

#undef PICK

}  // namespace pointwise

void InitPointwise(Napi::Env env, Napi::Object exports) {
  exports.Set("normForward", Napi::Function::New(env, pointwise::NormForward));
  exports.Set("normBackward", Napi::Function::New(env, pointwise::NormBackward));
  exports.Set("swigluForward", Napi::Function::New(env, pointwise::SwigluForward));
  exports.Set("swigluBackward", Napi::Function::New(env, pointwise::SwigluBackward));
  exports.Set("geluForward", Napi::Function::New(env, pointwise::GeluForward));
  exports.Set("geluBackward", Napi::Function::New(env, pointwise::GeluBackward));
  exports.Set("rotary", Napi::Function::New(env, pointwise::Rotary));
}

}  // namespace flotilla
