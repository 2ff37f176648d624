// Shared pieces of the flotilla addon: the tensor handle class, error conversion and registration.
// The addon is a binding only; every decision (buckets, sharding, schedules) lives in TypeScript.
#pragma once

#include <napi.h>
// Only what the shared declarations need (the Tensor class and c10::Error): <torch/torch.h>, the
// whole C++ frontend, took about 16 of the 20 seconds each file needed to compile. Files that call
// ops include <ATen/ATen.h>, and autograd.cc the autograd headers, themselves.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace flotilla {

// [Note: handle table] A tensor crosses into JS as a BigInt handle: slot index in the low 32 bits,
// the slot's generation in the high bits. The table owns the at::Tensor; release() frees it at once
// and bumps the generation, so a stale handle is an error, never another tensor. There is no
// per-handle native object and no N-API finalizer: Node runs wrap finalizers only between
// event-loop turns, and in a synchronous training loop those leftovers pinned freed tensor memory
// and fragmented the heap. The JS side keeps a FinalizationRegistry as the GC backstop.
class TensorHandle {
 public:
  static Napi::Value Wrap(Napi::Env env, const at::Tensor& t);
  static bool IsHandle(const Napi::Value& v);
  static at::Tensor& Get(const Napi::Value& v);
  /** Frees the slot; false when the handle was already released. */
  static bool Release(Napi::Env env, const Napi::Value& v);
  static int64_t Live();
  /** Reports the tensor's storage bytes to V8 (once per handle; views are not counted). */
  static bool ReportExternal(Napi::Env env, const Napi::Value& v);
};

// Several tensors returned to JS as one array of handles; an undefined tensor becomes undefined.
Napi::Array WrapTensors(Napi::Env env, const std::vector<at::Tensor>& ts);

// The thread that loaded the addon: hooks may only call into JS from it.
extern std::thread::id main_thread;

// Debug flag: FLOTILLA_BACKTRACE=1 keeps C++ backtraces in error messages.
bool WantBacktrace();

std::string DescribeTensor(const at::Tensor& t);
std::string ShortMessage(const c10::Error& e);

void InitTensor(Napi::Env env, Napi::Object exports);
void InitTensorCache(Napi::Env env, Napi::Object exports);
void InitAutograd(Napi::Env env, Napi::Object exports);
void InitComm(Napi::Env env, Napi::Object exports);
void InitAttention(Napi::Env env, Napi::Object exports);
void InitPointwise(Napi::Env env, Napi::Object exports);
void InitOptim(Napi::Env env, Napi::Object exports);

}  // namespace flotilla

// Wraps a binding body: no C++ exception crosses into JS. `what` names the operation.
#define FLOTILLA_TRY try {
#define FLOTILLA_CATCH(env, opname)                                                        \
  }                                                                                      \
  catch (const Napi::Error&) {                                                           \
    throw;                                                                               \
  }                                                                                      \
  catch (const c10::Error& e) {                                                          \
    throw Napi::Error::New(env, std::string(opname) + ": " + ::flotilla::ShortMessage(e)); \
  }                                                                                      \
  catch (const std::exception& e) {                                                      \
    throw Napi::Error::New(env, std::string(opname) + ": " + e.what());                    \
  }                                                                                      \
  catch (...) {                                                                          \
    throw Napi::Error::New(env, std::string(opname) + ": unknown native error");           \
  }
