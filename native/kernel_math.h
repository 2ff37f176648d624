// Vector types, a vectorised exp and bfloat16 loads and stores shared by the addon's kernels
// (attention_kernel.h, pointwise_kernel.h). Like them, included inside a namespace once per target
// (baseline x86-64, AVX2+FMA): no include guard and no includes; the includer provides <cstdint>,
// <cstring> and a Bf16 type.

// 32-byte vectors (GCC's vector extensions): one AVX register, or two SSE registers on the baseline.
typedef float VF __attribute__((vector_size(32)));
typedef int32_t VI __attribute__((vector_size(32)));
typedef double VD __attribute__((vector_size(32)));
template <typename V, typename A_t>
static inline V LoadV(const A_t* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <typename V, typename A_t>
static inline void StoreV(A_t* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}
template <typename A_t> struct Vec;
template <> struct Vec<float> { typedef VF type; };
template <> struct Vec<double> { typedef VD type; };

// exp of 8 floats in [-87, 0] (no range check): Cody-Waite range reduction and a degree-6
// polynomial (relative error ~2 ulp). Branch-free, so it stays in vector registers.
static inline VF ExpInRangeV(VF c) {
  const VI e = __builtin_convertvector(c * 1.44269504088896341f - 0.5f, VI);  // c <= ~0: a rounding of c log2(e)
  const VF fe = __builtin_convertvector(e, VF);
  const VF r = (c - fe * 0.693359375f) + fe * 2.12194440e-4f;
  VF p = VF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * (VF)((e + 127) << 23);
}
// exp of 8 floats <= ~0; -inf and anything below -87 give exactly 0.
static inline VF ExpV(VF v) {
  const VF y = ExpInRangeV(v < -87.f ? VF{} - 87.f : v);
  return v < -87.f ? VF{} : y;
}
static inline float Sum(VF v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }
static inline double Sum(VD v) { return (v[0] + v[1]) + (v[2] + v[3]); }

template <typename A_t> static inline A_t Load(float v) { return v; }
template <typename A_t> static inline A_t Load(double v) { return static_cast<A_t>(v); }
template <typename A_t> static inline A_t Load(Bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline void Store(float* p, float v) { *p = v; }
static inline void Store(double* p, double v) { *p = v; }
static inline void Store(Bf16* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if (v != v) {
    p->x = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  p->x = static_cast<uint16_t>(u >> 16);
}
