// The fused attention kernel's per-task work ([Note: fused attention] in attention.cc). Plain C++ on
// raw pointers, included twice by attention.cc: once for the baseline x86-64 and once under
// `#pragma GCC target("avx2,fma")`, so the same loops compile to both and the CPU picks at run time.
// Deliberately no include guard and no includes: the includer provides <cmath>, <cstdint>,
// <cstring>, <algorithm>, <limits> and the Problem/Bf16 types, and wraps this file in a namespace.

#include "kernel_math.h"

// Row-major C (M x N) += A (M x K) . B (K x N). M a multiple of 4, N of two vectors (the caller
// pads): a 4 x 2-vector tile of C stays in registers across the whole K loop, each step one
// broadcast of A per row and two loads of B.
template <typename A_t>
static inline void Gemm(int M, int N, int K, const A_t* A, int lda, const A_t* B, int ldb, A_t* C, int ldc) {
  typedef typename Vec<A_t>::type V;
  constexpr int L = sizeof(V) / sizeof(A_t);
  for (int i = 0; i < M; i += 4) {
    const A_t *a0 = A + i * lda, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
    for (int j = 0; j < N; j += 2 * L) {
      A_t* c = C + i * ldc + j;
      V c00 = LoadV<V>(c), c01 = LoadV<V>(c + L), c10 = LoadV<V>(c + ldc), c11 = LoadV<V>(c + ldc + L);
      V c20 = LoadV<V>(c + 2 * ldc), c21 = LoadV<V>(c + 2 * ldc + L), c30 = LoadV<V>(c + 3 * ldc), c31 = LoadV<V>(c + 3 * ldc + L);
      const A_t* b = B + j;
      for (int k = 0; k < K; ++k, b += ldb) {
        const V b0 = LoadV<V>(b), b1 = LoadV<V>(b + L);
        c00 += a0[k] * b0, c01 += a0[k] * b1;
        c10 += a1[k] * b0, c11 += a1[k] * b1;
        c20 += a2[k] * b0, c21 += a2[k] * b1;
        c30 += a3[k] * b0, c31 += a3[k] * b1;
      }
      StoreV(c, c00), StoreV(c + L, c01), StoreV(c + ldc, c10), StoreV(c + ldc + L, c11);
      StoreV(c + 2 * ldc, c20), StoreV(c + 2 * ldc + L, c21), StoreV(c + 3 * ldc, c30), StoreV(c + 3 * ldc + L, c31);
    }
  }
}


// x[j] = exp(x[j] - shift), returning the sum (n a multiple of 8).
static inline float ExpShiftSum(float* x, int n, float shift) {
  VF sum = VF{};
  for (int j = 0; j < n; j += 8) {
    const VF y = ExpV(LoadV<VF>(x + j) - shift);
    StoreV(x + j, y);
    sum += y;
  }
  return Sum(sum);
}
static inline double ExpShiftSum(double* x, int n, double shift) {
  double sum = 0;
  for (int j = 0; j < n; ++j) sum += (x[j] = std::exp(x[j] - shift));
  return sum;
}
// x[j] = exp(x[j] - shift[j]) (n a multiple of 8).
static inline void ExpShifts(float* x, int n, const float* shift) {
  for (int j = 0; j < n; j += 8) StoreV(x + j, ExpV(LoadV<VF>(x + j) - LoadV<VF>(shift + j)));
}
static inline void ExpShifts(double* x, int n, const double* shift) {
  for (int j = 0; j < n; ++j) x[j] = std::exp(x[j] - shift[j]);
}
// The largest of n (a multiple of 8) values.
static inline float Max(const float* x, int n) {
  VF m = LoadV<VF>(x);
  for (int j = 8; j < n; j += 8) {
    const VF v = LoadV<VF>(x + j);
    m = v > m ? v : m;
  }
  float r = m[0];
  for (int l = 1; l < 8; ++l) r = std::max(r, m[l]);
  return r;
}
static inline double Max(const double* x, int n) {
  double r = x[0];
  for (int j = 1; j < n; ++j) r = std::max(r, x[j]);
  return r;
}


// rows x D of src (row stride D) into dst (row stride ld) times mul, rows beyond n and columns beyond D zero.
template <typename T, typename A_t>
static inline void LoadRows(A_t* dst, int rows, int ld, const T* src, int n, int D, A_t mul) {
  for (int r = 0; r < rows; ++r) {
    A_t* d = dst + r * ld;
    if (r < n) {
      const T* s = src + static_cast<int64_t>(r) * D;
      for (int c = 0; c < D; ++c) d[c] = Load<A_t>(s[c]) * mul;
      for (int c = D; c < ld; ++c) d[c] = 0;
    } else {
      for (int c = 0; c < ld; ++c) d[c] = 0;
    }
  }
}

// The transpose: dst (D x cols, row stride cols) from n rows of src, columns beyond n zero.
template <typename T, typename A_t>
static inline void LoadTransposed(A_t* dst, int cols, const T* src, int n, int D, A_t mul) {
  for (int c = 0; c < D; ++c) {
    A_t* d = dst + c * cols;
    for (int r = 0; r < n; ++r) d[r] = Load<A_t>(src[static_cast<int64_t>(r) * D + c]) * mul;
    for (int r = n; r < cols; ++r) d[r] = 0;
  }
}

static inline bool Visible(const Problem& p, int64_t b, int64_t i, int64_t j) {
  const int64_t ip = i + p.offset;
  if (j > ip) return false;
  if (p.window > 0 && ip - j >= p.window) return false;
  return p.qdoc == nullptr || p.qdoc[b * p.Tq + i] == p.kdoc[b * p.Tk + j];
}

// Every (query, key) pair of the two blocks visible: no per-element mask needed.
static inline bool AllVisible(const Problem& p, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
  return p.qdoc == nullptr && k1 - 1 <= q0 + p.offset && (p.window == 0 || q1 - 1 + p.offset - k0 < p.window);
}

// The keys any query of [q0, q1) may see: [lo, hi).
static inline void KeyRange(const Problem& p, int64_t q0, int64_t q1, int64_t* lo, int64_t* hi) {
  *hi = std::min(p.Tk, q1 + p.offset);
  *lo = p.window > 0 ? std::max<int64_t>(0, q0 + p.offset - p.window + 1) : 0;
}

// The queries any key of [k0, k1) is seen by: [lo, hi).
static inline void QueryRange(const Problem& p, int64_t k0, int64_t k1, int64_t* lo, int64_t* hi) {
  *lo = std::max<int64_t>(0, k0 - p.offset);
  *hi = p.window > 0 ? std::min(p.Tq, k1 - 1 + p.window - p.offset) : p.Tq;
}

constexpr int kBlockQ = 64, kBlockK = 64;

static inline int PadD(int64_t D) { return static_cast<int>((D + 15) / 16 * 16); }

// Scratch sizes (elements of A_t) per task.
static inline size_t ForwardScratch(int Dp) { return size_t(kBlockQ) * Dp * 2 + size_t(Dp) * kBlockK + size_t(kBlockK) * Dp + size_t(kBlockQ) * kBlockK + 2 * kBlockQ; }
static inline size_t BackwardScratch(int Dp) { return size_t(6) * 64 * Dp + size_t(4) * Dp * 64 + size_t(3) * 64 * 64 + 4 * 64; }

// Forward of one (batch, query head, query block): out rows and their log-sum-exp.
template <typename T, typename A_t>
static void ForwardTask(const Problem& p, int64_t task, A_t* scratch) {
  const int64_t nQB = (p.Tq + kBlockQ - 1) / kBlockQ, bh = task / nQB, b = bh / p.Hq, h = bh % p.Hq;
  const int64_t hk = h / (p.Hq / p.Hkv), q0 = task % nQB * kBlockQ, q1 = std::min(p.Tq, q0 + kBlockQ);
  const int D = static_cast<int>(p.D), Dp = PadD(p.D), nq = static_cast<int>(q1 - q0);
  const T* q = static_cast<const T*>(p.q) + (bh * p.Tq + q0) * p.D;
  const T* k = static_cast<const T*>(p.k) + (b * p.Hkv + hk) * p.Tk * p.D;
  const T* v = static_cast<const T*>(p.v) + (b * p.Hkv + hk) * p.Tk * p.D;
  A_t *Q = scratch, *O = Q + kBlockQ * Dp, *Kt = O + kBlockQ * Dp, *V = Kt + Dp * kBlockK, *S = V + kBlockK * Dp;
  A_t *m = S + kBlockQ * kBlockK, *l = m + kBlockQ;
  const A_t ninf = -std::numeric_limits<A_t>::infinity();
  LoadRows<T, A_t>(Q, kBlockQ, Dp, q, nq, D, static_cast<A_t>(p.scale));
  std::fill(O, O + kBlockQ * Dp, A_t(0));
  std::fill(m, m + kBlockQ, ninf);
  std::fill(l, l + kBlockQ, A_t(0));
  int64_t lo, hi;
  KeyRange(p, q0, q1, &lo, &hi);
  for (int64_t k0 = lo; k0 < hi; k0 += kBlockK) {
    const int64_t k1 = std::min(hi, k0 + kBlockK);
    const int nk = static_cast<int>(k1 - k0);
    LoadTransposed<T, A_t>(Kt, kBlockK, k + k0 * p.D, nk, D, 1);
    LoadRows<T, A_t>(V, kBlockK, Dp, v + k0 * p.D, nk, D, 1);
    std::fill(S, S + kBlockQ * kBlockK, A_t(0));
    Gemm<A_t>(kBlockQ, kBlockK, D, Q, Dp, Kt, kBlockK, S, kBlockK);
    const bool all = AllVisible(p, q0, q1, k0, k1);
    for (int i = 0; i < kBlockQ; ++i) {
      A_t* s = S + i * kBlockK;
      if (i >= nq) {
        std::fill(s, s + kBlockK, A_t(0));
        continue;
      }
      for (int j = nk; j < kBlockK; ++j) s[j] = ninf;
      if (!all)
        for (int j = 0; j < nk; ++j)
          if (!Visible(p, b, q0 + i, k0 + j)) s[j] = ninf;
      const A_t mnew = std::max(m[i], Max(s, kBlockK));
      if (mnew == ninf) {
        std::fill(s, s + kBlockK, A_t(0));
        continue;
      }
      const A_t alpha = m[i] == ninf ? A_t(0) : std::exp(m[i] - mnew);
      const A_t sum = ExpShiftSum(s, kBlockK, mnew);
      l[i] = l[i] * alpha + sum;
      m[i] = mnew;
      if (alpha != A_t(1))
        for (int c = 0; c < Dp; ++c) O[i * Dp + c] *= alpha;
    }
    Gemm<A_t>(kBlockQ, Dp, kBlockK, S, kBlockK, V, Dp, O, Dp);
  }
  T* out = static_cast<T*>(p.out) + (bh * p.Tq + q0) * p.D;
  A_t* lse = static_cast<A_t*>(p.lse) + bh * p.Tq + q0;
  for (int i = 0; i < nq; ++i) {
    const A_t inv = l[i] > 0 ? A_t(1) / l[i] : A_t(0);
    for (int c = 0; c < D; ++c) Store(out + int64_t(i) * D + c, O[i * Dp + c] * inv);
    lse[i] = l[i] > 0 ? m[i] + std::log(l[i]) : ninf;
  }
}

// P = exp(S - lse) in place over an (rows x cols) block, masked entries 0; lse and the mask are per
// query, which is the row (queryRows) or the column.
template <typename A_t>
static inline void Probabilities(const Problem& p, A_t* S, int rows, int cols, bool queryRows, int64_t b, int64_t q0, int nq,
                                 int64_t k0, int nk, const A_t* lse, bool all) {
  const A_t ninf = -std::numeric_limits<A_t>::infinity();
  // Per column (the transposed block): shift by each query's lse, 0 where it is -inf (all masked).
  A_t shifts[kBlockQ];
  if (!queryRows)
    for (int i = 0; i < cols; ++i) shifts[i] = i < nq && lse[i] != ninf ? lse[i] : A_t(0);
  for (int r = 0; r < rows; ++r) {
    A_t* s = S + r * cols;
    if (queryRows) {
      if (r >= nq || lse[r] == ninf) {
        std::fill(s, s + cols, A_t(0));
        continue;
      }
      for (int j = nk; j < cols; ++j) s[j] = ninf;
      if (!all)
        for (int j = 0; j < nk; ++j)
          if (!Visible(p, b, q0 + r, k0 + j)) s[j] = ninf;
      ExpShiftSum(s, cols, lse[r]);
    } else {
      if (r >= nk) {
        std::fill(s, s + cols, A_t(0));
        continue;
      }
      for (int i = 0; i < cols; ++i) {
        const bool ok = i < nq && lse[i] != ninf && (all || Visible(p, b, q0 + i, k0 + r));
        if (!ok) s[i] = ninf;
      }
      ExpShifts(s, cols, shifts);
    }
  }
}

// dq of one (batch, query head, query block): recomputes P block by block from lse.
template <typename T, typename A_t>
static void GradQueryTask(const Problem& p, int64_t task, A_t* scratch) {
  const int64_t nQB = (p.Tq + kBlockQ - 1) / kBlockQ, bh = task / nQB, b = bh / p.Hq, h = bh % p.Hq;
  const int64_t hk = h / (p.Hq / p.Hkv), q0 = task % nQB * kBlockQ, q1 = std::min(p.Tq, q0 + kBlockQ);
  const int D = static_cast<int>(p.D), Dp = PadD(p.D), nq = static_cast<int>(q1 - q0);
  const int64_t rowOff = (bh * p.Tq + q0) * p.D, kvOff = (b * p.Hkv + hk) * p.Tk * p.D;
  const T* k = static_cast<const T*>(p.k) + kvOff;
  const T* v = static_cast<const T*>(p.v) + kvOff;
  A_t *Q = scratch, *dO = Q + kBlockQ * Dp, *dQ = dO + kBlockQ * Dp, *K = dQ + kBlockQ * Dp, *Kt = K + kBlockK * Dp;
  A_t *Vt = Kt + Dp * kBlockK, *S = Vt + Dp * kBlockK, *dP = S + kBlockQ * kBlockK, *lse = dP + kBlockQ * kBlockK, *Di = lse + kBlockQ;
  LoadRows<T, A_t>(Q, kBlockQ, Dp, static_cast<const T*>(p.q) + rowOff, nq, D, static_cast<A_t>(p.scale));
  LoadRows<T, A_t>(dO, kBlockQ, Dp, static_cast<const T*>(p.dout) + rowOff, nq, D, 1);
  std::fill(dQ, dQ + kBlockQ * Dp, A_t(0));
  for (int i = 0; i < nq; ++i) {
    lse[i] = static_cast<const A_t*>(p.lse)[bh * p.Tq + q0 + i];
    Di[i] = static_cast<const A_t*>(p.di)[bh * p.Tq + q0 + i];
  }
  int64_t lo, hi;
  KeyRange(p, q0, q1, &lo, &hi);
  for (int64_t k0 = lo; k0 < hi; k0 += kBlockK) {
    const int64_t k1 = std::min(hi, k0 + kBlockK);
    const int nk = static_cast<int>(k1 - k0);
    LoadRows<T, A_t>(K, kBlockK, Dp, k + k0 * p.D, nk, D, 1);
    LoadTransposed<T, A_t>(Kt, kBlockK, k + k0 * p.D, nk, D, 1);
    LoadTransposed<T, A_t>(Vt, kBlockK, v + k0 * p.D, nk, D, 1);
    std::fill(S, S + kBlockQ * kBlockK, A_t(0));
    Gemm<A_t>(kBlockQ, kBlockK, D, Q, Dp, Kt, kBlockK, S, kBlockK);
    Probabilities<A_t>(p, S, kBlockQ, kBlockK, true, b, q0, nq, k0, nk, lse, AllVisible(p, q0, q1, k0, k1));
    std::fill(dP, dP + kBlockQ * kBlockK, A_t(0));
    Gemm<A_t>(kBlockQ, kBlockK, D, dO, Dp, Vt, kBlockK, dP, kBlockK);
    for (int i = 0; i < nq; ++i)
      for (int j = 0; j < kBlockK; ++j) S[i * kBlockK + j] *= dP[i * kBlockK + j] - Di[i];  // dS
    Gemm<A_t>(kBlockQ, Dp, kBlockK, S, kBlockK, K, Dp, dQ, Dp);
  }
  T* dq = static_cast<T*>(p.dq) + rowOff;
  for (int i = 0; i < nq; ++i)
    for (int c = 0; c < D; ++c) Store(dq + int64_t(i) * D + c, dQ[i * Dp + c] * static_cast<A_t>(p.scale));
}

// dk and dv of one (batch, kv head, key block), summed over the group's query heads: no atomics.
template <typename T, typename A_t>
static void GradKeyValueTask(const Problem& p, int64_t task, A_t* scratch) {
  const int64_t nKB = (p.Tk + kBlockK - 1) / kBlockK, bhk = task / nKB, b = bhk / p.Hkv, hk = bhk % p.Hkv;
  const int64_t group = p.Hq / p.Hkv, k0 = task % nKB * kBlockK, k1 = std::min(p.Tk, k0 + kBlockK);
  const int D = static_cast<int>(p.D), Dp = PadD(p.D), nk = static_cast<int>(k1 - k0);
  const int64_t kvOff = (bhk * p.Tk + k0) * p.D;
  A_t *K = scratch, *V = K + kBlockK * Dp, *dK = V + kBlockK * Dp, *dV = dK + kBlockK * Dp, *Q = dV + kBlockK * Dp;
  A_t *dO = Q + kBlockQ * Dp, *Qt = dO + kBlockQ * Dp, *dOt = Qt + Dp * kBlockQ, *St = dOt + Dp * kBlockQ;
  A_t *dPt = St + kBlockK * kBlockQ, *lse = dPt + kBlockK * kBlockQ, *Di = lse + kBlockQ;
  LoadRows<T, A_t>(K, kBlockK, Dp, static_cast<const T*>(p.k) + kvOff, nk, D, 1);
  LoadRows<T, A_t>(V, kBlockK, Dp, static_cast<const T*>(p.v) + kvOff, nk, D, 1);
  std::fill(dK, dK + 2 * kBlockK * Dp, A_t(0));
  int64_t lo, hi;
  QueryRange(p, k0, k1, &lo, &hi);
  const A_t scale = static_cast<A_t>(p.scale);
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const int64_t bh = b * p.Hq + h;
    for (int64_t q0 = lo; q0 < hi; q0 += kBlockQ) {
      const int64_t q1 = std::min(hi, q0 + kBlockQ);
      const int nq = static_cast<int>(q1 - q0);
      const int64_t rowOff = (bh * p.Tq + q0) * p.D;
      LoadRows<T, A_t>(Q, kBlockQ, Dp, static_cast<const T*>(p.q) + rowOff, nq, D, 1);
      LoadRows<T, A_t>(dO, kBlockQ, Dp, static_cast<const T*>(p.dout) + rowOff, nq, D, 1);
      LoadTransposed<T, A_t>(Qt, kBlockQ, static_cast<const T*>(p.q) + rowOff, nq, D, scale);
      LoadTransposed<T, A_t>(dOt, kBlockQ, static_cast<const T*>(p.dout) + rowOff, nq, D, 1);
      for (int i = 0; i < nq; ++i) {
        lse[i] = static_cast<const A_t*>(p.lse)[bh * p.Tq + q0 + i];
        Di[i] = static_cast<const A_t*>(p.di)[bh * p.Tq + q0 + i];
      }
      std::fill(St, St + kBlockK * kBlockQ, A_t(0));
      Gemm<A_t>(kBlockK, kBlockQ, D, K, Dp, Qt, kBlockQ, St, kBlockQ);
      Probabilities<A_t>(p, St, kBlockK, kBlockQ, false, b, q0, nq, k0, nk, lse, AllVisible(p, q0, q1, k0, k1));
      Gemm<A_t>(kBlockK, Dp, kBlockQ, St, kBlockQ, dO, Dp, dV, Dp);
      std::fill(dPt, dPt + kBlockK * kBlockQ, A_t(0));
      Gemm<A_t>(kBlockK, kBlockQ, D, V, Dp, dOt, kBlockQ, dPt, kBlockQ);
      for (int j = 0; j < nk; ++j)
        for (int i = 0; i < kBlockQ; ++i) St[j * kBlockQ + i] *= dPt[j * kBlockQ + i] - (i < nq ? Di[i] : A_t(0));
      Gemm<A_t>(kBlockK, Dp, kBlockQ, St, kBlockQ, Q, Dp, dK, Dp);
    }
  }
  T* dk = static_cast<T*>(p.dk) + kvOff;
  T* dv = static_cast<T*>(p.dv) + kvOff;
  for (int j = 0; j < nk; ++j)
    for (int c = 0; c < D; ++c) {
      Store(dk + int64_t(j) * D + c, dK[j * Dp + c] * scale);
      Store(dv + int64_t(j) * D + c, dV[j * Dp + c]);
    }
}

// The entry points for each stored type, non-templates so that the includer's target pragma applies.
#define FLOTILLA_ATTENTION_ENTRIES(T, A_t, suffix)                                                                \
  void Forward##suffix(const Problem& p, int64_t t, A_t* s) { ForwardTask<T, A_t>(p, t, s); }                     \
  void GradQuery##suffix(const Problem& p, int64_t t, A_t* s) { GradQueryTask<T, A_t>(p, t, s); }                 \
  void GradKeyValue##suffix(const Problem& p, int64_t t, A_t* s) { GradKeyValueTask<T, A_t>(p, t, s); }
FLOTILLA_ATTENTION_ENTRIES(float, float, F32)
FLOTILLA_ATTENTION_ENTRIES(double, double, F64)
FLOTILLA_ATTENTION_ENTRIES(Bf16, float, BF16)
#undef FLOTILLA_ATTENTION_ENTRIES
