// c10d binding: TCPStore/PrefixStore for rendezvous, ProcessGroupGloo for collectives, and the
// async Work handle. All c10d use lives in this file so a libtorch 2.x / NCCL build is a local change.
// Which collective to build from which primitive (e.g. reduce-scatter from all-to-all) is decided
// in TypeScript (src/distributed/collectives.ts).
#include "common.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace flotilla {

using WorkPtr = decltype(std::declval<c10d::ProcessGroup&>().barrier());

static std::chrono::milliseconds Ms(const Napi::Value& v, int64_t fallback) {
  if (v.IsNumber()) return std::chrono::milliseconds(v.As<Napi::Number>().Int64Value());
  return std::chrono::milliseconds(fallback);
}

static std::vector<at::Tensor> TensorList(const Napi::Value& v) {
  std::vector<at::Tensor> out;
  Napi::Array arr = v.As<Napi::Array>();
  for (uint32_t i = 0; i < arr.Length(); ++i) out.push_back(TensorHandle::Get(arr.Get(i)));
  return out;
}

static std::vector<std::vector<at::Tensor>> TensorLists(const Napi::Value& v) {
  std::vector<std::vector<at::Tensor>> out;
  Napi::Array arr = v.As<Napi::Array>();
  for (uint32_t i = 0; i < arr.Length(); ++i) out.push_back(TensorList(arr.Get(i)));
  return out;
}

static std::vector<int64_t> IntList(const Napi::Value& v) {
  std::vector<int64_t> out;
  if (!v.IsArray()) return out;
  Napi::Array arr = v.As<Napi::Array>();
  for (uint32_t i = 0; i < arr.Length(); ++i) out.push_back(arr.Get(i).As<Napi::Number>().Int64Value());
  return out;
}

static c10d::ReduceOp ParseReduceOp(const std::string& s) {
  if (s == "sum") return c10d::ReduceOp(c10d::ReduceOp::SUM);
  if (s == "product") return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
  if (s == "min") return c10d::ReduceOp(c10d::ReduceOp::MIN);
  if (s == "max") return c10d::ReduceOp(c10d::ReduceOp::MAX);
  throw std::invalid_argument("unknown reduce op '" + s + "' (expected sum, product, min or max)");
}

// ---------------------------------------------------------------------------------------------
// Work: a handle to one in-flight collective.

class WorkHandle : public Napi::ObjectWrap<WorkHandle> {
 public:
  static Napi::FunctionReference* constructor;
  WorkPtr work;
  std::string what;

  static void Init(Napi::Env env, Napi::Object exports) {
    Napi::Function fn = DefineClass(env, "WorkHandle",
                                    {InstanceMethod("wait", &WorkHandle::Wait),
                                     InstanceMethod("waitAsync", &WorkHandle::WaitAsync),
                                     InstanceMethod("isCompleted", &WorkHandle::IsCompleted)});
    constructor = new Napi::FunctionReference(Napi::Persistent(fn));
    exports.Set("WorkHandle", fn);
  }
  static Napi::Object New(Napi::Env env, WorkPtr w, std::string what) {
    Napi::Object o = constructor->New({});
    WorkHandle* h = WorkHandle::Unwrap(o);
    h->work = std::move(w);
    h->what = std::move(what);
    return o;
  }
  explicit WorkHandle(const Napi::CallbackInfo& info) : Napi::ObjectWrap<WorkHandle>(info) {}

  // wait(timeoutMs?): blocks this thread until the collective finishes; throws its error.
  Napi::Value Wait(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    bool ok = info.Length() > 0 && info[0].IsNumber() ? work->wait(Ms(info[0], 0)) : work->wait();
    return Napi::Boolean::New(env, ok);
    FLOTILLA_CATCH(env, what)
  }

  Napi::Value IsCompleted(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    return Napi::Boolean::New(env, work->isCompleted());
    FLOTILLA_CATCH(env, what)
  }

  // waitAsync(): a Promise that settles when the collective finishes, waiting on a pool thread.
  Napi::Value WaitAsync(const Napi::CallbackInfo& info);
};
Napi::FunctionReference* WorkHandle::constructor = nullptr;

class WaitWorker : public Napi::AsyncWorker {
 public:
  WaitWorker(Napi::Env env, WorkPtr w, std::string what)
      : Napi::AsyncWorker(env), work_(std::move(w)), what_(std::move(what)), deferred_(Napi::Promise::Deferred::New(env)) {}
  Napi::Promise Promise() { return deferred_.Promise(); }
  void Execute() override {
    try {
      work_->wait();
    } catch (const c10::Error& e) {
      SetError(what_ + ": " + ShortMessage(e));
    } catch (const std::exception& e) {
      SetError(what_ + ": " + e.what());
    }
  }
  void OnOK() override { deferred_.Resolve(Env().Undefined()); }
  void OnError(const Napi::Error& e) override { deferred_.Reject(e.Value()); }

 private:
  WorkPtr work_;
  std::string what_;
  Napi::Promise::Deferred deferred_;
};

Napi::Value WorkHandle::WaitAsync(const Napi::CallbackInfo& info) {
  auto* w = new WaitWorker(info.Env(), work, what);
  Napi::Promise p = w->Promise();
  w->Queue();
  return p;
}

// ---------------------------------------------------------------------------------------------
// Store

class StoreHandle : public Napi::ObjectWrap<StoreHandle> {
 public:
  static Napi::FunctionReference* constructor;
  c10::intrusive_ptr<c10d::Store> store;

  static void Init(Napi::Env env, Napi::Object exports) {
    Napi::Function fn = DefineClass(env, "StoreHandle",
                                    {InstanceMethod("set", &StoreHandle::Set), InstanceMethod("get", &StoreHandle::Get),
                                     InstanceMethod("add", &StoreHandle::Add), InstanceMethod("check", &StoreHandle::Check),
                                     InstanceMethod("wait", &StoreHandle::Wait)});
    constructor = new Napi::FunctionReference(Napi::Persistent(fn));
    exports.Set("StoreHandle", fn);
  }
  static Napi::Object New(Napi::Env env, c10::intrusive_ptr<c10d::Store> s) {
    Napi::Object o = constructor->New({});
    StoreHandle::Unwrap(o)->store = std::move(s);
    return o;
  }
  static c10::intrusive_ptr<c10d::Store> From(const Napi::Value& v) {
    if (!v.IsObject() || !v.As<Napi::Object>().InstanceOf(constructor->Value())) throw std::invalid_argument("expected a Store");
    return StoreHandle::Unwrap(v.As<Napi::Object>())->store;
  }
  explicit StoreHandle(const Napi::CallbackInfo& info) : Napi::ObjectWrap<StoreHandle>(info) {}

  Napi::Value Set(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    std::string key = info[0].As<Napi::String>();
    Napi::Buffer<uint8_t> b = info[1].As<Napi::Buffer<uint8_t>>();
    store->set(key, std::vector<uint8_t>(b.Data(), b.Data() + b.Length()));
    return env.Undefined();
    FLOTILLA_CATCH(env, "store.set")
  }
  Napi::Value Get(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    std::vector<uint8_t> v = store->get(info[0].As<Napi::String>());
    return Napi::Buffer<uint8_t>::Copy(env, v.data(), v.size());
    FLOTILLA_CATCH(env, "store.get")
  }
  Napi::Value Add(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    int64_t r = store->add(info[0].As<Napi::String>(), info[1].As<Napi::Number>().Int64Value());
    return Napi::Number::New(env, static_cast<double>(r));
    FLOTILLA_CATCH(env, "store.add")
  }
  Napi::Value Check(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    std::vector<std::string> keys;
    Napi::Array arr = info[0].As<Napi::Array>();
    for (uint32_t i = 0; i < arr.Length(); ++i) keys.push_back(arr.Get(i).As<Napi::String>());
    return Napi::Boolean::New(env, store->check(keys));
    FLOTILLA_CATCH(env, "store.check")
  }
  Napi::Value Wait(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    std::vector<std::string> keys;
    Napi::Array arr = info[0].As<Napi::Array>();
    for (uint32_t i = 0; i < arr.Length(); ++i) keys.push_back(arr.Get(i).As<Napi::String>());
    if (info.Length() > 1 && info[1].IsNumber()) store->wait(keys, Ms(info[1], 0));
    else store->wait(keys);
    return env.Undefined();
    FLOTILLA_CATCH(env, "store.wait")
  }
};
Napi::FunctionReference* StoreHandle::constructor = nullptr;

// createTCPStore(host, port, worldSize, isServer, timeoutMs)
static Napi::Value CreateTCPStore(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string host = info[0].As<Napi::String>();
  FLOTILLA_TRY
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(info[1].As<Napi::Number>().Uint32Value());
  opts.numWorkers = static_cast<std::size_t>(info[2].As<Napi::Number>().Uint32Value());
  opts.isServer = info[3].As<Napi::Boolean>().Value();
  opts.waitWorkers = false;  // rendezvous completes at process-group creation, which the TS side times
  opts.timeout = Ms(info[4], 300000);
  auto store = c10::make_intrusive<c10d::TCPStore>(host, opts);
  return StoreHandle::New(env, store);
  FLOTILLA_CATCH(env, "TCPStore(" + host + ":" + std::to_string(info[1].As<Napi::Number>().Uint32Value()) + ")")
}

static Napi::Value CreatePrefixStore(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  auto base = StoreHandle::From(info[1]);
  auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(info[0].As<Napi::String>()), base);
  return StoreHandle::New(env, store);
  FLOTILLA_CATCH(env, "PrefixStore")
}

// ---------------------------------------------------------------------------------------------
// ProcessGroup (Gloo)

class GroupHandle : public Napi::ObjectWrap<GroupHandle> {
 public:
  static Napi::FunctionReference* constructor;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;

  static void Init(Napi::Env env, Napi::Object exports) {
    Napi::Function fn = DefineClass(
        env, "GroupHandle",
        {InstanceMethod("allreduce", &GroupHandle::Allreduce), InstanceMethod("broadcast", &GroupHandle::Broadcast),
         InstanceMethod("allgather", &GroupHandle::Allgather), InstanceMethod("allgatherBase", &GroupHandle::AllgatherBase),
         InstanceMethod("reduceScatter", &GroupHandle::ReduceScatter),
         InstanceMethod("reduceScatterBase", &GroupHandle::ReduceScatterBase),
         InstanceMethod("alltoallBase", &GroupHandle::AlltoallBase), InstanceMethod("send", &GroupHandle::Send),
         InstanceMethod("recv", &GroupHandle::Recv), InstanceMethod("barrier", &GroupHandle::Barrier),
         InstanceMethod("backendName", &GroupHandle::BackendName)});
    constructor = new Napi::FunctionReference(Napi::Persistent(fn));
    exports.Set("GroupHandle", fn);
  }
  explicit GroupHandle(const Napi::CallbackInfo& info) : Napi::ObjectWrap<GroupHandle>(info) {}

#define GROUP_OP(name, body)                        \
  Napi::Value name(const Napi::CallbackInfo& info) { \
    Napi::Env env = info.Env();                      \
    FLOTILLA_TRY body FLOTILLA_CATCH(env, #name)     \
  }

  // allreduce(tensors, op)
  GROUP_OP(Allreduce, {
    auto ts = TensorList(info[0]);
    c10d::AllreduceOptions o;
    o.reduceOp = ParseReduceOp(info[1].As<Napi::String>());
    return WorkHandle::New(env, pg->allreduce(ts, o), "allreduce");
  })
  // broadcast(tensors, root)
  GROUP_OP(Broadcast, {
    auto ts = TensorList(info[0]);
    c10d::BroadcastOptions o;
    o.rootRank = info[1].As<Napi::Number>().Int64Value();
    return WorkHandle::New(env, pg->broadcast(ts, o), "broadcast");
  })
  // allgather(outputLists, inputs)
  GROUP_OP(Allgather, {
    auto outs = TensorLists(info[0]);
    auto ins = TensorList(info[1]);
    return WorkHandle::New(env, pg->allgather(outs, ins), "allgather");
  })
  // allgatherBase(out, in): into one flat tensor (not in Gloo 1.13: throws, TS falls back)
  GROUP_OP(AllgatherBase, {
    at::Tensor out = TensorHandle::Get(info[0]);
    at::Tensor in = TensorHandle::Get(info[1]);
    return WorkHandle::New(env, pg->_allgather_base(out, in), "allgatherBase");
  })
  // reduceScatter(outputs, inputLists, op)
  GROUP_OP(ReduceScatter, {
    auto outs = TensorList(info[0]);
    auto ins = TensorLists(info[1]);
    c10d::ReduceScatterOptions o;
    o.reduceOp = ParseReduceOp(info[2].As<Napi::String>());
    return WorkHandle::New(env, pg->reduce_scatter(outs, ins, o), "reduceScatter");
  })
  GROUP_OP(ReduceScatterBase, {
    at::Tensor out = TensorHandle::Get(info[0]);
    at::Tensor in = TensorHandle::Get(info[1]);
    c10d::ReduceScatterOptions o;
    o.reduceOp = ParseReduceOp(info[2].As<Napi::String>());
    return WorkHandle::New(env, pg->_reduce_scatter_base(out, in, o), "reduceScatterBase");
  })
  // alltoallBase(out, in, outSplits, inSplits): splits along dim 0, empty = equal
  GROUP_OP(AlltoallBase, {
    at::Tensor out = TensorHandle::Get(info[0]);
    at::Tensor in = TensorHandle::Get(info[1]);
    auto outSplits = IntList(info[2]);
    auto inSplits = IntList(info[3]);
    return WorkHandle::New(env, pg->alltoall_base(out, in, outSplits, inSplits), "alltoallBase");
  })
  // send(tensors, dst, tag) / recv(tensors, src, tag)
  GROUP_OP(Send, {
    auto ts = TensorList(info[0]);
    return WorkHandle::New(env, pg->send(ts, info[1].As<Napi::Number>().Int32Value(), info[2].As<Napi::Number>().Int32Value()), "send");
  })
  GROUP_OP(Recv, {
    auto ts = TensorList(info[0]);
    return WorkHandle::New(env, pg->recv(ts, info[1].As<Napi::Number>().Int32Value(), info[2].As<Napi::Number>().Int32Value()), "recv");
  })
  GROUP_OP(Barrier, {
    c10d::BarrierOptions o;
    return WorkHandle::New(env, pg->barrier(o), "barrier");
  })
  GROUP_OP(BackendName, { return Napi::String::New(env, pg->getBackendName()); })
#undef GROUP_OP
};
Napi::FunctionReference* GroupHandle::constructor = nullptr;

// createGlooGroup(store, rank, size, timeoutMs, {hostname?, iface?, threads?})
static Napi::Value CreateGlooGroup(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  auto store = StoreHandle::From(info[0]);
  int rank = info[1].As<Napi::Number>().Int32Value();
  int size = info[2].As<Napi::Number>().Int32Value();
  auto opts = c10d::ProcessGroupGloo::Options::create(Ms(info[3], 300000));
  Napi::Object cfg = info.Length() > 4 && info[4].IsObject() ? info[4].As<Napi::Object>() : Napi::Object::New(env);
  if (cfg.Has("iface") && cfg.Get("iface").IsString()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(cfg.Get("iface").As<Napi::String>()));
  } else if (cfg.Has("hostname") && cfg.Get("hostname").IsString()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(cfg.Get("hostname").As<Napi::String>()));
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  if (cfg.Has("threads") && cfg.Get("threads").IsNumber()) opts->threads = cfg.Get("threads").As<Napi::Number>().Int32Value();
  Napi::Object o = GroupHandle::constructor->New({});
  GroupHandle::Unwrap(o)->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  return o;
  FLOTILLA_CATCH(env, "ProcessGroupGloo")
}

void InitComm(Napi::Env env, Napi::Object exports) {
  WorkHandle::Init(env, exports);
  StoreHandle::Init(env, exports);
  GroupHandle::Init(env, exports);
  exports.Set("createTCPStore", Napi::Function::New(env, CreateTCPStore));
  exports.Set("createPrefixStore", Napi::Function::New(env, CreatePrefixStore));
  exports.Set("createGlooGroup", Napi::Function::New(env, CreateGlooGroup));
}

}  // namespace flotilla
