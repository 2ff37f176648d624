// Shared pieces of the flotilla addon: the tensor handle class, error conversion and registration.
// The addon is a binding only; every decision (buckets, sharding, schedules) lives in TypeScript.
#pragma once

#include <napi.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace flotilla {

// A JS object that owns one at::Tensor. dispose() releases it early; the finalizer is a backstop.
class TensorHandle : public Napi::ObjectWrap<TensorHandle> {
 public:
  static Napi::FunctionReference* constructor;
  static std::atomic<int64_t> live;  // handles created and not yet released (leak checks in tests)

  static void Init(Napi::Env env, Napi::Object exports);
  static Napi::Object Wrap(Napi::Env env, const at::Tensor& t);
  static bool IsHandle(const Napi::Value& v);
  static at::Tensor& Get(const Napi::Value& v);

  explicit TensorHandle(const Napi::CallbackInfo& info);
  ~TensorHandle() override;

  at::Tensor tensor;

 private:
  void Release(Napi::Env env);
  Napi::Value Dispose(const Napi::CallbackInfo& info);
  Napi::Value IsDisposed(const Napi::CallbackInfo& info);
  int64_t reported_ = 0;  // bytes reported to V8 via AdjustExternalMemory
  bool released_ = false;
};

// The thread that loaded the addon: hooks may only call into JS from it.
extern std::thread::id main_thread;

// Debug flag: FLOTILLA_BACKTRACE=1 keeps C++ backtraces in error messages.
bool WantBacktrace();

std::string DescribeTensor(const at::Tensor& t);
std::string ShortMessage(const c10::Error& e);

void InitTensor(Napi::Env env, Napi::Object exports);
void InitAutograd(Napi::Env env, Napi::Object exports);
void InitComm(Napi::Env env, Napi::Object exports);

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
