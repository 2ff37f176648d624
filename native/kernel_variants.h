// Compiles the kernel header named by KERNEL_HEADER twice: namespace base for any x86-64, namespace
// avx2 with AVX2 and FMA, and gives HasAvx2() to pick one at run time (no -march flag: the addon runs
// on whatever x86-64 loads it). The vector helpers are static and inlined, so their 32-byte
// arguments never cross an ABI boundary (hence -Wpsabi off).
#ifndef KERNEL_HEADER
#error "define KERNEL_HEADER before including kernel_variants.h"
#endif

#pragma GCC diagnostic ignored "-Wpsabi"
namespace base {
#include KERNEL_HEADER
}  // namespace base
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include KERNEL_HEADER
}  // namespace avx2
#pragma GCC pop_options

static bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
