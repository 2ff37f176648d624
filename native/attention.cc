// [Note: fused attention] Causal attention forward and backward in one kernel, blocked over queries
// and keys with an online softmax (FlashAttention-2's order), so no (Tq x Tk) matrix is ever made:
// each task holds one query block's and one key block's tiles. Computation only; when to use it is
// TypeScript's choice (src/nn/kernels/attention.ts).
//   q (B, Hq, Tq, D), k and v (B, Hkv, Tk, D), Hq a multiple of Hkv: query head h reads kv head
//   h / (Hq / Hkv) in place (never repeated). Query i sits at key position i + offset; it sees key j
//   when j <= i + offset, with a window W > 0 also i + offset - j < W, and with document ids
//   (B, Tq) and (B, Tk) only keys of its own document. float32, float64 and bfloat16 (bfloat16 and
//   float32 accumulate in float32, float64 in float64).
//   Forward returns out and the log-sum-exp (B, Hq, Tq) of the scaled scores over the visible keys
//   (-inf and out 0 for a row that sees none); backward recomputes the probabilities from it and
//   D_i = rowsum(dOut * out).
// Tasks: forward and dq per (batch, query head, query block); dk and dv per (batch, kv head, key
// block), summed over the group's query heads there, so no two tasks write the same rows.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace flotilla {
namespace attention {

struct Bf16 {
  uint16_t x;
};

struct Problem {
  const void *q, *k, *v, *dout, *di;
  void *out, *lse, *dq, *dk, *dv;
  int64_t B, Hq, Hkv, Tq, Tk, D;
  double scale;
  int64_t offset, window;
  const int64_t *qdoc, *kdoc;
};

#define KERNEL_HEADER "attention_kernel.h"
#include "kernel_variants.h"

template <typename A_t>
using TaskFn = void (*)(const Problem&, int64_t, A_t*);

template <typename A_t>
static void RunTasks(const Problem& p, int64_t tasks, size_t scratch, TaskFn<A_t> fn) {
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<A_t> s(scratch);
    for (int64_t t = begin; t < end; ++t) fn(p, t, s.data());
  });
}

static at::Tensor Docs(const Napi::Value& v, int64_t B, int64_t T, const char* what) {
  if (v.IsUndefined() || v.IsNull()) return at::Tensor();
  at::Tensor d = TensorHandle::Get(v);
  TORCH_CHECK(d.dim() == 2 && d.size(0) == B && d.size(1) == T, what, " must be (B, T) = (", B, ", ", T, "), got ", DescribeTensor(d));
  TORCH_CHECK(d.scalar_type() == at::kLong || d.scalar_type() == at::kInt, what, " must be int32 or int64, got ", DescribeTensor(d));
  return d.to(at::kLong).contiguous();
}

// Checks shapes and fills the problem's sizes and options from (q, k, v, scale, offset, window, qDocs, kDocs).
static Problem Describe(const Napi::CallbackInfo& info, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        int first, at::Tensor* qd, at::Tensor* kd) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be (B, H, T, D), got ", DescribeTensor(q), ", ",
              DescribeTensor(k), ", ", DescribeTensor(v));
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, got ", DescribeTensor(k), " and ", DescribeTensor(v));
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "q and k must share B and D, got ", DescribeTensor(q), " and ", DescribeTensor(k));
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "the query heads (", q.size(1), ") must be a multiple of the key/value heads (", k.size(1), ")");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v must share a dtype");
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kBFloat16, "fused attention takes float32, float64 or bfloat16, got ", DescribeTensor(q));
  Problem p{};
  p.B = q.size(0), p.Hq = q.size(1), p.Hkv = k.size(1), p.Tq = q.size(2), p.Tk = k.size(2), p.D = q.size(3);
  p.scale = info[first].As<Napi::Number>().DoubleValue();
  p.offset = info[first + 1].As<Napi::Number>().Int64Value();
  p.window = info[first + 2].As<Napi::Number>().Int64Value();
  TORCH_CHECK(p.window >= 0, "window must be >= 0 (0: none), got ", p.window);
  *qd = Docs(info[first + 3], p.B, p.Tq, "query document ids");
  *kd = Docs(info[first + 4], p.B, p.Tk, "key document ids");
  TORCH_CHECK(qd->defined() == kd->defined(), "document ids are given for both queries and keys or for neither");
  p.qdoc = qd->defined() ? qd->data_ptr<int64_t>() : nullptr;
  p.kdoc = kd->defined() ? kd->data_ptr<int64_t>() : nullptr;
  return p;
}

static at::ScalarType AccType(at::ScalarType st) { return st == at::kDouble ? at::kDouble : at::kFloat; }

// attentionForward(q, k, v, scale, offset, window, qDocs?, kDocs?) -> [out, lse]
static Napi::Value Forward(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor q = TensorHandle::Get(info[0]).contiguous(), k = TensorHandle::Get(info[1]).contiguous(),
                   v = TensorHandle::Get(info[2]).contiguous();
  at::Tensor qd, kd;
  Problem p = Describe(info, q, k, v, 3, &qd, &kd);
  at::Tensor out = at::empty_like(q), lse = at::empty({p.B, p.Hq, p.Tq}, q.options().dtype(AccType(q.scalar_type())));
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.out = out.data_ptr(), p.lse = lse.data_ptr();
  const int64_t tasks = p.B * p.Hq * ((p.Tq + 63) / 64);
  const int Dp = base::PadD(p.D);
  const bool fast = HasAvx2();
  switch (q.scalar_type()) {
    case at::kFloat: RunTasks<float>(p, tasks, base::ForwardScratch(Dp), fast ? avx2::ForwardF32 : base::ForwardF32); break;
    case at::kDouble: RunTasks<double>(p, tasks, base::ForwardScratch(Dp), fast ? avx2::ForwardF64 : base::ForwardF64); break;
    default: RunTasks<float>(p, tasks, base::ForwardScratch(Dp), fast ? avx2::ForwardBF16 : base::ForwardBF16); break;
  }
  return WrapTensors(env, {out, lse});
  FLOTILLA_CATCH(env, "attentionForward")
}

// attentionBackward(q, k, v, out, lse, dOut, scale, offset, window, qDocs?, kDocs?) -> [dq, dk, dv]
static Napi::Value Backward(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor q = TensorHandle::Get(info[0]).contiguous(), k = TensorHandle::Get(info[1]).contiguous(),
                   v = TensorHandle::Get(info[2]).contiguous();
  at::Tensor qd, kd;
  Problem p = Describe(info, q, k, v, 6, &qd, &kd);
  const auto acc = AccType(q.scalar_type());
  const at::Tensor out = TensorHandle::Get(info[3]), dout = TensorHandle::Get(info[5]).to(q.scalar_type()).contiguous();
  const at::Tensor lse = TensorHandle::Get(info[4]).to(acc).contiguous();
  TORCH_CHECK(out.sizes() == q.sizes() && dout.sizes() == q.sizes(), "out and dOut must have q's shape ", DescribeTensor(q));
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == p.B && lse.size(1) == p.Hq && lse.size(2) == p.Tq, "lse must be (B, Hq, Tq), got ", DescribeTensor(lse));
  const at::Tensor di = (dout.to(acc) * out.to(acc)).sum(-1).contiguous();
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.dout = dout.data_ptr(), p.lse = lse.data_ptr(), p.di = di.data_ptr();
  p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
  const int64_t qTasks = p.B * p.Hq * ((p.Tq + 63) / 64), kvTasks = p.B * p.Hkv * ((p.Tk + 63) / 64);
  const size_t scratch = base::BackwardScratch(base::PadD(p.D));
  const bool fast = HasAvx2();
  switch (q.scalar_type()) {
    case at::kFloat:
      RunTasks<float>(p, qTasks, scratch, fast ? avx2::GradQueryF32 : base::GradQueryF32);
      RunTasks<float>(p, kvTasks, scratch, fast ? avx2::GradKeyValueF32 : base::GradKeyValueF32);
      break;
    case at::kDouble:
      RunTasks<double>(p, qTasks, scratch, fast ? avx2::GradQueryF64 : base::GradQueryF64);
      RunTasks<double>(p, kvTasks, scratch, fast ? avx2::GradKeyValueF64 : base::GradKeyValueF64);
      break;
    default:
      RunTasks<float>(p, qTasks, scratch, fast ? avx2::GradQueryBF16 : base::GradQueryBF16);
      RunTasks<float>(p, kvTasks, scratch, fast ? avx2::GradKeyValueBF16 : base::GradKeyValueBF16);
      break;
  }
  return WrapTensors(env, {dq, dk, dv});
  FLOTILLA_CATCH(env, "attentionBackward")
}

}  // namespace attention

void InitAttention(Napi::Env env, Napi::Object exports) {
  exports.Set("attentionForward", Napi::Function::New(env, attention::Forward));
  exports.Set("attentionBackward", Napi::Function::New(env, attention::Backward));
}

}  // namespace flotilla
