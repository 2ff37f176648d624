// The optimizer updates of native/optim.cc, included there twice (for any x86-64, and with AVX2 and
// FMA), as attention_kernel.h is. Each loop reads every array once and writes each it updates once;
// its body has no branch, so it vectorises. T: the parameter's and state's type (float or double),
// also the arithmetic's; G: the gradient's (T, or bfloat16 bits under float T). The gradient is
// multiplied by gradScale as it is read (clipping's factor, [Note: folded clip]; 1 is exact).

static inline float Load(const float* a, int64_t i) { return a[i]; }
static inline double Load(const double* a, int64_t i) { return a[i]; }
static inline float Load(const uint16_t* a, int64_t i) {
  // bfloat16 is the high half of a float32.
  const uint32_t bits = static_cast<uint32_t>(a[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T, typename G>
static void AdamWRange(const AdamWArgs& a, T* __restrict p, const G* __restrict g, T* __restrict m, T* __restrict v,
                       int64_t begin, int64_t end) {
  const T decay = static_cast<T>(a.decay), b1 = static_cast<T>(a.beta1), b2 = static_cast<T>(a.beta2);
  const T c1 = static_cast<T>(1 - a.beta1), c2 = static_cast<T>(1 - a.beta2);
  const T bc2sqrt = static_cast<T>(a.bc2sqrt), eps = static_cast<T>(a.eps), step = static_cast<T>(-a.stepSize);
  const T scale = static_cast<T>(a.gradScale);
  for (int64_t i = begin; i < end; ++i) {
    const T gi = static_cast<T>(Load(g, i)) * scale;
    const T mi = m[i] * b1 + c1 * gi;
    const T vi = v[i] * b2 + c2 * gi * gi;
    const T denom = std::sqrt(vi) / bc2sqrt + eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay + step * (mi / denom);
  }
}

template <typename T, typename G>
static void SgdRange(const SgdArgs& a, T* __restrict p, const G* __restrict g, T* __restrict buf, int64_t begin, int64_t end) {
  const T wd = static_cast<T>(a.weightDecay), lr = static_cast<T>(-a.lr), scale = static_cast<T>(a.gradScale);
  if (buf == nullptr) {
    for (int64_t i = begin; i < end; ++i) p[i] = p[i] + lr * (static_cast<T>(Load(g, i)) * scale + wd * p[i]);
    return;
  }
  const T mom = static_cast<T>(a.momentum), damp = static_cast<T>(1 - a.dampening);
  const bool first = a.first, nesterov = a.nesterov;  // loop-invariant: the compiler unswitches the loop on them
  for (int64_t i = begin; i < end; ++i) {
    const T d = static_cast<T>(Load(g, i)) * scale + wd * p[i];
    const T b = first ? d : buf[i] * mom + damp * d;  // the first step copies d (torch's first buffer)
    buf[i] = b;
    const T u = nesterov ? d + mom * b : b;
    p[i] = p[i] + lr * u;
  }
}

static void AdamWFloat(const AdamWArgs& a, float* p, const float* g, float* m, float* v, int64_t b, int64_t e) { AdamWRange(a, p, g, m, v, b, e); }
static void AdamWFloatBf16(const AdamWArgs& a, float* p, const uint16_t* g, float* m, float* v, int64_t b, int64_t e) { AdamWRange(a, p, g, m, v, b, e); }
static void AdamWDouble(const AdamWArgs& a, double* p, const double* g, double* m, double* v, int64_t b, int64_t e) { AdamWRange(a, p, g, m, v, b, e); }
static void SgdFloat(const SgdArgs& a, float* p, const float* g, float* buf, int64_t b, int64_t e) { SgdRange(a, p, g, buf, b, e); }
static void SgdFloatBf16(const SgdArgs& a, float* p, const uint16_t* g, float* buf, int64_t b, int64_t e) { SgdRange(a, p, g, buf, b, e); }
static void SgdDouble(const SgdArgs& a, double* p, const double* g, double* buf, int64_t b, int64_t e) { SgdRange(a, p, g, buf, b, e); }
