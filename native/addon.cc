// Entry point of the flotilla addon: registers the tensor, autograd and comm bindings.
#include "common.h"

#include <csignal>
#include <dlfcn.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#ifdef __linux__
#include <sys/prctl.h>
#endif

namespace flotilla {

// setParentDeathSignal(signo): the kernel sends signo to this process when its parent dies, so
// ranks never outlive a launcher that was killed. Returns false where the OS has no such switch.
static Napi::Value SetParentDeathSignal(const Napi::CallbackInfo& info) {
#ifdef __linux__
  int sig = info[0].As<Napi::Number>().Int32Value();
  return Napi::Boolean::New(info.Env(), prctl(PR_SET_PDEATHSIG, sig) == 0);
#else
  return Napi::Boolean::New(info.Env(), false);
#endif
}

// blasInfo(): which BLAS libtorch's CPU matmuls run in, and which kernels it chose for this CPU:
// { core, config } from OpenBLAS (found by symbol, as libtorch links it), or undefined for another
// BLAS.
static Napi::Value BlasInfo(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  using NameFn = char* (*)();
  auto core = reinterpret_cast<NameFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  auto config = reinterpret_cast<NameFn>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
  if (core == nullptr) return env.Undefined();
  Napi::Object o = Napi::Object::New(env);
  o.Set("core", std::string(core()));
  o.Set("config", config != nullptr ? std::string(config()) : std::string());
  return o;
}

// setMallocOptions(mmapThreshold, trimThreshold): glibc's mallopt for the two settings that decide
// whether freed tensor memory goes back to the OS. Returns false where the C library is not glibc or
// refuses a value. The values are chosen in TypeScript (src/tensor/allocator.ts).
static Napi::Value SetMallocOptions(const Napi::CallbackInfo& info) {
#ifdef __GLIBC__
  int mmap_threshold = info[0].As<Napi::Number>().Int32Value();
  int trim_threshold = info[1].As<Napi::Number>().Int32Value();
  bool ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1;
  ok = mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1 && ok;
  return Napi::Boolean::New(info.Env(), ok);
#else
  return Napi::Boolean::New(info.Env(), false);
#endif
}

// mallocTrim(): glibc's malloc_trim(0), which gives the free memory of every arena back to the OS.
// Returns false where there is nothing to give back or the C library is not glibc. When to call it
// is decided in TypeScript (src/tensor/allocator.ts).
static Napi::Value MallocTrim(const Napi::CallbackInfo& info) {
#ifdef __GLIBC__
  return Napi::Boolean::New(info.Env(), malloc_trim(0) == 1);
#else
  return Napi::Boolean::New(info.Env(), false);
#endif
}

Napi::Object InitAddon(Napi::Env env, Napi::Object exports) {
  main_thread = std::this_thread::get_id();
  InitTensor(env, exports);
  InitTensorCache(env, exports);
  InitAutograd(env, exports);
  InitComm(env, exports);
  InitAttention(env, exports);
  InitPointwise(env, exports);
  InitOptim(env, exports);
  exports.Set("setParentDeathSignal", Napi::Function::New(env, SetParentDeathSignal));
  exports.Set("blasInfo", Napi::Function::New(env, BlasInfo));
  exports.Set("setMallocOptions", Napi::Function::New(env, SetMallocOptions));
  exports.Set("mallocTrim", Napi::Function::New(env, MallocTrim));
  return exports;
}

}  // namespace flotilla

static Napi::Object Init(Napi::Env env, Napi::Object exports) { return flotilla::InitAddon(env, exports); }

NODE_API_MODULE(NODE_GYP_MODULE_NAME, Init)
