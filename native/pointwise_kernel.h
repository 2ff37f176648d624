// The pointwise kernels' per-chunk work ([Note: pointwise kernels] in pointwise.cc). Plain C++ on raw
// pointers, included twice by pointwise.cc (baseline x86-64, and under `#pragma GCC target("avx2,fma")`),
// as attention_kernel.h is. No include guard and no includes: the includer provides <cmath>,
// <cstdint>, <cstring>, <vector>, the Norm/Elementwise/Rotation structs and Bf16, and wraps this file
// in a namespace. Every kernel computes in the accumulation type (float for float32 and bfloat16,
// double for float64) and rounds once on the way out: the norms and float's exact GELU in 32-byte
// vectors loaded straight from the inputs (LoadAcc), the others on a row or a block of up to kBlock
// values widened into a buffer, in loops the compiler vectorises.

#include "kernel_math.h"

constexpr int64_t kBlock = 512;  // elementwise block: a multiple of 8, a few KB per buffer

template <typename T, typename A_t>
static inline void Widen(A_t* d, const T* s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) d[j] = Load<A_t>(s[j]);
}
template <typename T, typename A_t>
static inline void Narrow(T* d, const A_t* s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) Store(d + j, s[j]);
}
// x[j] = exp(x[j]) for x[j] <= 0, n <= kBlock; float through ExpV (the buffer has room for the
// rounding up to 8), double through std::exp.
static inline void ExpNonPositive(float* x, int64_t n) {
  const int64_t n8 = (n + 7) / 8 * 8;
  for (int64_t j = n; j < n8; ++j) x[j] = 0;
  for (int64_t j = 0; j < n8; j += 8) StoreV(x + j, ExpV(LoadV<VF>(x + j)));
}
static inline void ExpNonPositive(double* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] = std::exp(x[j]);
}

// A vector of the accumulation type from T (8 floats from float or bfloat16, 4 doubles), and back.
static inline VF LoadAcc(const float* p) { return LoadV<VF>(p); }
static inline VD LoadAcc(const double* p) { return LoadV<VD>(p); }
// bfloat16 lane by lane as Load and Store(Bf16*) do (the upper 16 bits of a float; rounded to nearest
// even, NaN kept quiet), in whole vectors.
typedef uint16_t VH __attribute__((vector_size(16)));
typedef uint32_t VU __attribute__((vector_size(32)));
static inline VF LoadAcc(const Bf16* p) {
  VH h;
  std::memcpy(&h, p, sizeof(h));
  return (VF)(__builtin_convertvector(h, VU) << 16);
}
static inline void StoreAcc(float* p, VF v) { StoreV(p, v); }
static inline void StoreAcc(double* p, VD v) { StoreV(p, v); }
static inline void StoreAcc(Bf16* p, VF v) {
  const VU u = (VU)v, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const VH h = __builtin_convertvector(v != v ? VU{} + 0x7fc0u : rounded, VH);
  std::memcpy(p, &h, sizeof(h));
}

// Rows [r0, r1) of RMSNorm (p.layer false) or LayerNorm: y = (x - mean) * rstd * w (+ b), mean 0
// for RMSNorm; saves mean (LayerNorm) and rstd per row. Each row is read three times (sum, sum of
// squares about the mean, output) in vectors straight from x, and written once.
template <typename T, typename A_t>
static void NormForward(const Norm& p, int64_t r0, int64_t r1) {
  typedef typename Vec<A_t>::type V;
  const int64_t d = p.d, L = sizeof(V) / sizeof(A_t), dv = d / L * L;
  std::vector<A_t> buf(2 * d);
  A_t *w = buf.data(), *b = w + d;
  Widen(w, static_cast<const T*>(p.w), d);
  if (p.b) Widen(b, static_cast<const T*>(p.b), d);
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = static_cast<const T*>(p.x) + r * d;
    T* y = static_cast<T*>(p.y) + r * d;
    A_t mu = 0;
    if (p.layer) {
      V s0{}, s1{};  // two chains of adds in flight
      int64_t j = 0;
      for (; j + 2 * L <= dv; j += 2 * L) s0 += LoadAcc(x + j), s1 += LoadAcc(x + j + L);
      if (j < dv) s0 += LoadAcc(x + j);
      A_t t = Sum(s0 + s1);
      for (j = dv; j < d; ++j) t += Load<A_t>(x[j]);
      mu = t / static_cast<A_t>(d);
    }
    V q0{}, q1{};
    int64_t j = 0;
    for (; j + 2 * L <= dv; j += 2 * L) {
      const V c0 = LoadAcc(x + j) - mu, c1 = LoadAcc(x + j + L) - mu;
      q0 += c0 * c0, q1 += c1 * c1;
    }
    if (j < dv) {
      const V c0 = LoadAcc(x + j) - mu;
      q0 += c0 * c0;
    }
    A_t q = Sum(q0 + q1);
    for (j = dv; j < d; ++j) q += (Load<A_t>(x[j]) - mu) * (Load<A_t>(x[j]) - mu);
    const A_t rstd = A_t(1) / std::sqrt(q / static_cast<A_t>(d) + static_cast<A_t>(p.eps));
    if (p.b) {
      for (j = 0; j < dv; j += L) StoreAcc(y + j, (LoadAcc(x + j) - mu) * rstd * LoadV<V>(w + j) + LoadV<V>(b + j));
      for (; j < d; ++j) Store(y + j, (Load<A_t>(x[j]) - mu) * rstd * w[j] + b[j]);
    } else {
      for (j = 0; j < dv; j += L) StoreAcc(y + j, (LoadAcc(x + j) - mu) * rstd * LoadV<V>(w + j));
      for (; j < d; ++j) Store(y + j, (Load<A_t>(x[j]) - mu) * rstd * w[j]);
    }
    if (p.layer) static_cast<A_t*>(p.mean)[r] = mu;
    static_cast<A_t*>(p.rstd)[r] = rstd;
  }
}

// Chunk c of the rows (c of p.chunks, contiguous ranges): dx per row, and the chunk's own partial
// sums of dw = sum g * xhat and db = sum g in row c of p.dw and p.db (chunks x d, summed by the caller).
// Two passes per row in vectors straight from x and dy: the first sums dw, db and the row's two dot
// products, the second recomputes xhat and g * w (cheaper than storing and reloading them) for dx.
template <typename T, typename A_t>
static void NormBackward(const Norm& p, int64_t c) {
  typedef typename Vec<A_t>::type V;
  const int64_t d = p.d, L = sizeof(V) / sizeof(A_t), dv = d / L * L;
  const int64_t r0 = p.rows * c / p.chunks, r1 = p.rows * (c + 1) / p.chunks;
  std::vector<A_t> buf(d);
  A_t *w = buf.data(), *dw = static_cast<A_t*>(p.dw) + c * d, *db = p.db ? static_cast<A_t*>(p.db) + c * d : nullptr;
  Widen(w, static_cast<const T*>(p.w), d);
  const A_t inv = A_t(1) / static_cast<A_t>(d);
  for (int64_t r = r0; r < r1; ++r) {
    const T *x = static_cast<const T*>(p.x) + r * d, *dy = static_cast<const T*>(p.dy) + r * d;
    T* dx = static_cast<T*>(p.dx) + r * d;
    const A_t mu = p.layer ? static_cast<const A_t*>(p.mean)[r] : A_t(0), rstd = static_cast<const A_t*>(p.rstd)[r];
    V sa{}, sm{};
    int64_t j = 0;
    for (; j < dv; j += L) {
      const V g = LoadAcc(dy + j), xh = (LoadAcc(x + j) - mu) * rstd, gw = g * LoadV<V>(w + j);
      StoreV(dw + j, LoadV<V>(dw + j) + g * xh);
      if (db) StoreV(db + j, LoadV<V>(db + j) + g);
      sa += gw * xh, sm += gw;
    }
    A_t a = Sum(sa), m = Sum(sm);
    for (; j < d; ++j) {
      const A_t g = Load<A_t>(dy[j]), xh = (Load<A_t>(x[j]) - mu) * rstd;
      dw[j] += g * xh;
      if (db) db[j] += g;
      a += g * w[j] * xh, m += g * w[j];
    }
    a *= inv, m = p.layer ? m * inv : A_t(0);
    for (j = 0; j < dv; j += L) {
      const V xh = (LoadAcc(x + j) - mu) * rstd, gw = LoadAcc(dy + j) * LoadV<V>(w + j);
      StoreAcc(dx + j, rstd * (gw - m - xh * a));
    }
    for (; j < d; ++j) {
      const A_t xh = (Load<A_t>(x[j]) - mu) * rstd, gw = Load<A_t>(dy[j]) * w[j];
      Store(dx + j, rstd * (gw - m - xh * a));
    }
  }
}

// sigmoid(x) into s from e = exp(-|x|), stable for either sign.
template <typename A_t>
static inline void Sigmoid(A_t* s, const A_t* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) s[j] = -std::abs(x[j]);
  ExpNonPositive(s, n);
  for (int64_t j = 0; j < n; ++j) s[j] = (x[j] >= 0 ? A_t(1) : s[j]) / (A_t(1) + s[j]);
}

// SwiGLU over [i0, i1): out = silu(a) * b (a the gate, b the up projection); backward: da, db from dy.
template <typename T, typename A_t>
static void SwigluForward(const Elementwise& p, int64_t i0, int64_t i1) {
  std::vector<A_t> buf(3 * kBlock);
  A_t *a = buf.data(), *b = a + kBlock, *s = b + kBlock;
  for (int64_t i = i0; i < i1; i += kBlock) {
    const int64_t n = std::min(kBlock, i1 - i);
    Widen(a, static_cast<const T*>(p.a) + i, n);
    Widen(b, static_cast<const T*>(p.b) + i, n);
    Sigmoid(s, a, n);
    for (int64_t j = 0; j < n; ++j) a[j] = a[j] * s[j] * b[j];
    Narrow(static_cast<T*>(p.out) + i, a, n);
  }
}
template <typename T, typename A_t>
static void SwigluBackward(const Elementwise& p, int64_t i0, int64_t i1) {
  std::vector<A_t> buf(4 * kBlock);
  A_t *a = buf.data(), *b = a + kBlock, *s = b + kBlock, *g = s + kBlock;
  for (int64_t i = i0; i < i1; i += kBlock) {
    const int64_t n = std::min(kBlock, i1 - i);
    Widen(a, static_cast<const T*>(p.a) + i, n);
    Widen(b, static_cast<const T*>(p.b) + i, n);
    Widen(g, static_cast<const T*>(p.dy) + i, n);
    Sigmoid(s, a, n);
    for (int64_t j = 0; j < n; ++j) {
      const A_t silu = a[j] * s[j];
      a[j] = g[j] * b[j] * s[j] * (A_t(1) + a[j] * (A_t(1) - s[j]));  // d silu / da = s (1 + a (1 - s))
      b[j] = g[j] * silu;
    }
    Narrow(static_cast<T*>(p.da) + i, a, n);
    Narrow(static_cast<T*>(p.db) + i, b, n);
  }
}

// GELU over [i0, i1), exact (erf) or p.tanh's approximation; backward writes da from dy.
constexpr double kSqrt2Pi = 0.79788456080286535588;   // sqrt(2 / pi)
constexpr double kInvSqrt2 = 0.70710678118654752440;  // 1 / sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794; // 1 / sqrt(2 pi)
// t = tanh(k (x + 0.044715 x^3)) from e = exp(-2 |z|); z kept in z.
template <typename A_t>
static inline void GeluTanh(A_t* t, A_t* z, const A_t* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    z[j] = A_t(kSqrt2Pi) * (x[j] + A_t(0.044715) * x[j] * x[j] * x[j]);
    t[j] = A_t(-2) * std::abs(z[j]);
  }
  ExpNonPositive(t, n);
  for (int64_t j = 0; j < n; ++j) {
    const A_t m = (A_t(1) - t[j]) / (A_t(1) + t[j]);
    t[j] = z[j] < 0 ? -m : m;
  }
}
// p = 1 + erf(x / sqrt 2) through std::erf: float64's path (float's is GeluErf* below).
template <typename A_t>
static inline void OnePlusErf(A_t* p, const A_t* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) p[j] = 1 + std::erf(x[j] * A_t(kInvSqrt2));
}
// The exact GELU in float, 8 lanes at a time straight from the input and into the output (no widened
// copies): forward 0.5 x (1 + erf(x / sqrt 2)), backward dy (0.5 (1 + erf) + x phi(x)). Both from
// one exp: erfc(|x| / sqrt 2) = u h(u) exp(-x^2 / 2), u = 1 / (1 + 0.4 |x| / sqrt 2), where h is a
// degree-8 polynomial fitted here to erfc(a) exp(a^2) / u (relative error 1.3e-7 for all a >= 0), and
// exp(-x^2 / 2) is also the Gaussian of the derivative. 1 + erf is 2 - erfc for x >= 0 and erfc itself
// below, so there is no cancellation in the negative tail: relative error below 7e-7 for |x| <= 3
// (test/kernels_pointwise.test.ts), growing beyond as the rounding of x^2 in exp's argument does (as
// in any float erf), ~4e-6 at |x| = 10.
static inline VF GaussV(VF x) {  // exp(-x^2 / 2), x^2 capped at 174: exp(-87) ~ 1.6e-38 stands for 0
  const VF s = x * x;
  return ExpInRangeV(-0.5f * (s < 174.f ? s : VF{} + 174.f));
}
static inline VF OnePlusErfV(VF x, VF gauss) {  // gauss = GaussV(x)
  const VF u = 1.f / (1.f + (VF)((VI)x & 0x7fffffff) * 0.28284271247461901f);
  VF h = u * 5.026770973e-02f - 1.829238506e-01f;
  h = h * u + 1.691221040e-01f;
  h = h * u - 5.639140679e-03f;
  h = h * u + 1.414467881e-01f;
  h = h * u + 1.685377977e-01f;
  h = h * u + 2.078432934e-01f;
  h = h * u + 2.256695609e-01f;
  h = h * u + 2.256758626e-01f;
  const VF erfc = u * h * gauss;
  return x >= 0 ? 2.f - erfc : erfc;
}
// fn(x, dy) -> the output, over [i0, i1) of p.a (and p.dy), written to out; the tail through a padded vector.
template <typename T, typename Fn>
static inline void Map8(const Elementwise& p, T* out, int64_t i0, int64_t i1, const Fn& fn) {
  const T *x = static_cast<const T*>(p.a), *g = static_cast<const T*>(p.dy);
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) StoreAcc(out + i, fn(LoadAcc(x + i), g ? LoadAcc(g + i) : VF{}));
  if (i == i1) return;
  T xs[8] = {}, gs[8] = {}, ys[8];
  std::memcpy(xs, x + i, (i1 - i) * sizeof(T));
  if (g) std::memcpy(gs, g + i, (i1 - i) * sizeof(T));
  StoreAcc(ys, fn(LoadAcc(xs), LoadAcc(gs)));
  std::memcpy(out + i, ys, (i1 - i) * sizeof(T));
}
template <typename T>
static void GeluErfForward(const Elementwise& p, int64_t i0, int64_t i1) {
  Map8(p, static_cast<T*>(p.out), i0, i1, [](VF x, VF) { return 0.5f * x * OnePlusErfV(x, GaussV(x)); });
}
template <typename T>
static void GeluErfBackward(const Elementwise& p, int64_t i0, int64_t i1) {
  Map8(p, static_cast<T*>(p.da), i0, i1, [](VF x, VF g) {
    const VF gauss = GaussV(x);
    return g * (0.5f * OnePlusErfV(x, gauss) + x * gauss * float(kInvSqrt2Pi));
  });
}
template <typename T, typename A_t>
static void GeluForward(const Elementwise& p, int64_t i0, int64_t i1) {
  if constexpr (sizeof(A_t) == 4)
    if (!p.tanh) return GeluErfForward<T>(p, i0, i1);
  std::vector<A_t> buf(3 * kBlock);
  A_t *x = buf.data(), *t = x + kBlock, *z = t + kBlock;
  for (int64_t i = i0; i < i1; i += kBlock) {
    const int64_t n = std::min(kBlock, i1 - i);
    Widen(x, static_cast<const T*>(p.a) + i, n);
    if (p.tanh) {
      GeluTanh(t, z, x, n);
      for (int64_t j = 0; j < n; ++j) x[j] = A_t(0.5) * x[j] * (A_t(1) + t[j]);
    } else {
      OnePlusErf(t, x, n);
      for (int64_t j = 0; j < n; ++j) x[j] = A_t(0.5) * x[j] * t[j];
    }
    Narrow(static_cast<T*>(p.out) + i, x, n);
  }
}
template <typename T, typename A_t>
static void GeluBackward(const Elementwise& p, int64_t i0, int64_t i1) {
  if constexpr (sizeof(A_t) == 4)
    if (!p.tanh) return GeluErfBackward<T>(p, i0, i1);
  std::vector<A_t> buf(4 * kBlock);
  A_t *x = buf.data(), *t = x + kBlock, *z = t + kBlock, *g = z + kBlock;
  for (int64_t i = i0; i < i1; i += kBlock) {
    const int64_t n = std::min(kBlock, i1 - i);
    Widen(x, static_cast<const T*>(p.a) + i, n);
    Widen(g, static_cast<const T*>(p.dy) + i, n);
    if (p.tanh) {
      GeluTanh(t, z, x, n);
      for (int64_t j = 0; j < n; ++j) {
        const A_t dz = A_t(kSqrt2Pi) * (A_t(1) + A_t(3 * 0.044715) * x[j] * x[j]);
        g[j] *= A_t(0.5) * (A_t(1) + t[j]) + A_t(0.5) * x[j] * (A_t(1) - t[j] * t[j]) * dz;
      }
    } else {
      for (int64_t j = 0; j < n; ++j) t[j] = A_t(-0.5) * x[j] * x[j];
      ExpNonPositive(t, n);
      OnePlusErf(z, x, n);
      for (int64_t j = 0; j < n; ++j) g[j] *= A_t(0.5) * z[j] + x[j] * t[j] * A_t(kInvSqrt2Pi);
    }
    Narrow(static_cast<T*>(p.da) + i, g, n);
  }
}

// Rotary over token rows [r0, r1) of (B, T, H, D): out = x * cos + swapHalves(x) * sinSigned
// (p.inverse: out = x * cos + swapHalves(x * sinSigned), the rotation by -theta that backward applies
// to the gradient). The tables are (T, D), or (B, T, D) with p.perBatch, in the accumulation type.
template <typename T, typename A_t>
static void Rotate(const Rotation& p, int64_t r0, int64_t r1) {
  const int64_t D = p.D, h2 = D / 2;
  std::vector<A_t> buf(2 * D);
  A_t *x = buf.data(), *o = x + D;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t row = p.perBatch ? r : r % p.T;
    const A_t *c = static_cast<const A_t*>(p.cos) + row * D, *s = static_cast<const A_t*>(p.sin) + row * D;
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t at = (r * p.H + h) * D;
      Widen(x, static_cast<const T*>(p.x) + at, D);
      if (p.inverse) {
        for (int64_t j = 0; j < h2; ++j) o[j] = x[j] * c[j] + x[j + h2] * s[j + h2];
        for (int64_t j = h2; j < D; ++j) o[j] = x[j] * c[j] + x[j - h2] * s[j - h2];
      } else {
        for (int64_t j = 0; j < h2; ++j) o[j] = x[j] * c[j] + x[j + h2] * s[j];
        for (int64_t j = h2; j < D; ++j) o[j] = x[j] * c[j] + x[j - h2] * s[j];
      }
      Narrow(static_cast<T*>(p.out) + at, o, D);
    }
  }
}

#define FLOTILLA_POINTWISE_ENTRIES(T, A_t, SUFFIX)                                                               \
  static void NormForward##SUFFIX(const Norm& p, int64_t r0, int64_t r1) { NormForward<T, A_t>(p, r0, r1); }      \
  static void NormBackward##SUFFIX(const Norm& p, int64_t c) { NormBackward<T, A_t>(p, c); }                     \
  static void SwigluForward##SUFFIX(const Elementwise& p, int64_t i0, int64_t i1) { SwigluForward<T, A_t>(p, i0, i1); } \
  static void SwigluBackward##SUFFIX(const Elementwise& p, int64_t i0, int64_t i1) { SwigluBackward<T, A_t>(p, i0, i1); } \
  static void GeluForward##SUFFIX(const Elementwise& p, int64_t i0, int64_t i1) { GeluForward<T, A_t>(p, i0, i1); } \
  static void GeluBackward##SUFFIX(const Elementwise& p, int64_t i0, int64_t i1) { GeluBackward<T, A_t>(p, i0, i1); } \
  static void Rotate##SUFFIX(const Rotation& p, int64_t r0, int64_t r1) { Rotate<T, A_t>(p, r0, r1); }
FLOTILLA_POINTWISE_ENTRIES(float, float, F32)
FLOTILLA_POINTWISE_ENTRIES(double, double, F64)
FLOTILLA_POINTWISE_ENTRIES(Bf16, float, BF16)
