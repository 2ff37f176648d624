// [Note: fused optimizer] AdamW and SGD updates as one pass over a flat range: parameters, gradient
// and state are each read once and written once (the eager path, src/optim/, is a chain of
// elementwise ops, each a pass). Elementwise in the order torch.optim computes, so results agree to
// rounding. Computation only: the hyper-parameters (bias corrections, decay factors) and when to use
// it are TypeScript's (src/optim/fused.ts). Parameters and state are float32 or float64 (the
// arithmetic's type); the gradient is the parameter's dtype, or bfloat16 under float32.
//
// [Note: folded clip] Each update takes the factor gradient clipping computed (src/optim/clipped_step.ts)
// and multiplies the gradient by it as it reads it, so clipping costs no pass of its own: the
// gradient buffer keeps its unclipped values. Whether to clip and the factor are TypeScript's.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace flotilla {
namespace optim {

struct AdamWArgs {
  double decay, beta1, beta2, eps, stepSize, bc2sqrt, gradScale;
};

struct SgdArgs {
  double lr, momentum, dampening, weightDecay, gradScale;
  bool nesterov, first;
};

#define KERNEL_HEADER "optim_kernel.h"
#include "kernel_variants.h"

// Elements per parallel task: large enough that a task's setup is noise, small enough for both cores.
constexpr int64_t kGrain = 32768;

static const at::Tensor& Flat(const at::Tensor& t, const at::Tensor& p, const char* what) {
  TORCH_CHECK(t.is_contiguous() && t.numel() == p.numel(), what, " must be contiguous with the parameters' ", p.numel(), " elements, got ", DescribeTensor(t));
  return t;
}

// Checks the dtypes; returns 0 float32, 1 float32 with a bfloat16 gradient, 2 float64.
static int Kind(const at::Tensor& p, const at::Tensor& g) {
  TORCH_CHECK(p.is_contiguous(), "parameters must be contiguous, got ", DescribeTensor(p));
  Flat(g, p, "the gradient");
  if (p.scalar_type() == at::kDouble) {
    TORCH_CHECK(g.scalar_type() == at::kDouble, "float64 parameters take a float64 gradient, got ", DescribeTensor(g));
    return 2;
  }
  TORCH_CHECK(p.scalar_type() == at::kFloat, "fused optimizer steps take float32 or float64 parameters, got ", DescribeTensor(p));
  TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16, "float32 parameters take a float32 or bfloat16 gradient, got ", DescribeTensor(g));
  return g.scalar_type() == at::kFloat ? 0 : 1;
}

static const at::Tensor& State(const at::Tensor& t, const at::Tensor& p, const char* what) {
  TORCH_CHECK(t.scalar_type() == p.scalar_type(), what, " must have the parameters' dtype, got ", DescribeTensor(t));
  return Flat(t, p, what);
}

template <typename F>
static void Parallel(int64_t n, const F& f) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { f(begin, end); });
}

// adamwStep(param, grad, expAvg, expAvgSq, decay, beta1, beta2, eps, stepSize, bc2sqrt, gradScale): in place,
// with g = gradScale grad:
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g g;
//   param = decay param - stepSize m / (sqrt(v) / bc2sqrt + eps)
static Napi::Value AdamWStep(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::Tensor& p = TensorHandle::Get(info[0]);
  const at::Tensor& g = TensorHandle::Get(info[1]);
  at::Tensor& m = TensorHandle::Get(info[2]);
  at::Tensor& v = TensorHandle::Get(info[3]);
  const int kind = Kind(p, g);
  State(m, p, "exp_avg");
  State(v, p, "exp_avg_sq");
  AdamWArgs a{};
  a.decay = info[4].As<Napi::Number>().DoubleValue();
  a.beta1 = info[5].As<Napi::Number>().DoubleValue();
  a.beta2 = info[6].As<Napi::Number>().DoubleValue();
  a.eps = info[7].As<Napi::Number>().DoubleValue();
  a.stepSize = info[8].As<Napi::Number>().DoubleValue();
  a.bc2sqrt = info[9].As<Napi::Number>().DoubleValue();
  a.gradScale = info[10].As<Napi::Number>().DoubleValue();
  const bool fast = HasAvx2();
  const int64_t n = p.numel();
  if (kind == 2) {
    auto fn = fast ? avx2::AdamWDouble : base::AdamWDouble;
    double *pp = p.data_ptr<double>(), *mp = m.data_ptr<double>(), *vp = v.data_ptr<double>();
    const double* gp = g.data_ptr<double>();
    Parallel(n, [&](int64_t b, int64_t e) { fn(a, pp, gp, mp, vp, b, e); });
  } else {
    float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
    if (kind == 0) {
      auto fn = fast ? avx2::AdamWFloat : base::AdamWFloat;
      const float* gp = g.data_ptr<float>();
      Parallel(n, [&](int64_t b, int64_t e) { fn(a, pp, gp, mp, vp, b, e); });
    } else {
      auto fn = fast ? avx2::AdamWFloatBf16 : base::AdamWFloatBf16;
      const uint16_t* gp = reinterpret_cast<const uint16_t*>(g.data_ptr());
      Parallel(n, [&](int64_t b, int64_t e) { fn(a, pp, gp, mp, vp, b, e); });
    }
  }
  return env.Undefined();
  FLOTILLA_CATCH(env, "adamwStep")
}

// sgdStep(param, grad, momentumBuffer?, lr, momentum, dampening, weightDecay, nesterov, first, gradScale):
// in place, d = gradScale grad + weightDecay param; with a buffer: buf = first ? d : momentum buf + (1 - dampening) d,
//   d = nesterov ? d + momentum buf : buf;  param = param - lr d
static Napi::Value SgdStep(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::Tensor& p = TensorHandle::Get(info[0]);
  const at::Tensor& g = TensorHandle::Get(info[1]);
  const bool hasBuf = !(info[2].IsUndefined() || info[2].IsNull());
  at::Tensor buf = hasBuf ? TensorHandle::Get(info[2]) : at::Tensor();
  const int kind = Kind(p, g);
  if (hasBuf) State(buf, p, "momentum_buffer");
  SgdArgs a{};
  a.lr = info[3].As<Napi::Number>().DoubleValue();
  a.momentum = info[4].As<Napi::Number>().DoubleValue();
  a.dampening = info[5].As<Napi::Number>().DoubleValue();
  a.weightDecay = info[6].As<Napi::Number>().DoubleValue();
  a.nesterov = info[7].As<Napi::Boolean>().Value();
  a.first = info[8].As<Napi::Boolean>().Value();
  a.gradScale = info[9].As<Napi::Number>().DoubleValue();
  const bool fast = HasAvx2();
  const int64_t n = p.numel();
  if (kind == 2) {
    auto fn = fast ? avx2::SgdDouble : base::SgdDouble;
    double* pp = p.data_ptr<double>();
    double* bp = hasBuf ? buf.data_ptr<double>() : nullptr;
    const double* gp = g.data_ptr<double>();
    Parallel(n, [&](int64_t b, int64_t e) { fn(a, pp, gp, bp, b, e); });
  } else {
    float* pp = p.data_ptr<float>();
    float* bp = hasBuf ? buf.data_ptr<float>() : nullptr;
    if (kind == 0) {
      auto fn = fast ? avx2::SgdFloat : base::SgdFloat;
      const float* gp = g.data_ptr<float>();
      Parallel(n, [&](int64_t b, int64_t e) { fn(a, pp, gp, bp, b, e); });
    } else {
      auto fn = fast ? avx2::SgdFloatBf16 : base::SgdFloatBf16;
      const uint16_t* gp = reinterpret_cast<const uint16_t*>(g.data_ptr());
      Parallel(n, [&](int64_t b, int64_t e) { fn(a, pp, gp, bp, b, e); });
    }
  }
  return env.Undefined();
  FLOTILLA_CATCH(env, "sgdStep")
}

}  // namespace optim

void InitOptim(Napi::Env env, Napi::Object exports) {
  exports.Set("adamwStep", Napi::Function::New(env, optim::AdamWStep));
  exports.Set("sgdStep", Napi::Function::New(env, optim::SgdStep));
}

}  // namespace flotilla
