// Entry point of the flotilla addon: registers the tensor, autograd and comm bindings.
#include "common.h"

namespace flotilla {

Napi::Object InitAddon(Napi::Env env, Napi::Object exports) {
  main_thread = std::this_thread::get_id();
  InitTensor(env, exports);
  InitAutograd(env, exports);
  InitComm(env, exports);
  return exports;
}

}  // namespace flotilla

static Napi::Object Init(Napi::Env env, Napi::Object exports) { return flotilla::InitAddon(env, exports); }

NODE_API_MODULE(NODE_GYP_MODULE_NAME, Init)
