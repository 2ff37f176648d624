// Open MPI binding: a second addon (flotilla_mpi.node), built only where mpi.h exists, so the main
// addon never depends on libmpi. It takes raw buffers (address, element count, dtype name) that the
// TypeScript side reads from tensor handles of the main addon, which keeps these tensors alive until
// the Work completes; it links no libtorch.
//
// Execution model (as c10d's ProcessGroupMPI): every communicator has one worker thread that runs
// its operations in the order they were issued. Collectives are blocking MPI calls on that thread
// (Open MPI's blocking collectives move shared-memory data about twice as fast as the non-blocking
// ones); send/recv are started non-blocking and completed by the same thread, so a ring of sends
// cannot deadlock. Communicators run concurrently (MPI_THREAD_MULTIPLE).
//
// MPI has no timeout of its own: a Work knows when its operation started, and whoever waits on it
// (wait, waitAsync, isCompleted) fails it once it has run longer than the communicator's timeout.
// The communicator is then unusable (its thread is still inside the stuck call): later operations
// fail at once, and MPI_Finalize is skipped at exit. Which timeout, and what to do after one, is the
// caller's choice; this file only measures.
#include <napi.h>
#include <mpi.h>

#include <dlfcn.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace flotilla_mpi {

using Clock = std::chrono::steady_clock;

std::string MpiError(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, len);
}

void Check(int code, const char* what) {
  if (code != MPI_SUCCESS) throw std::runtime_error(std::string(what) + ": " + MpiError(code));
}

MPI_Datatype ParseDtype(const std::string& s) {
  if (s == "float32") return MPI_FLOAT;
  if (s == "float64") return MPI_DOUBLE;
  if (s == "int64") return MPI_INT64_T;
  if (s == "int32") return MPI_INT32_T;
  if (s == "int16") return MPI_INT16_T;
  if (s == "int8") return MPI_INT8_T;
  if (s == "uint8") return MPI_UINT8_T;
  throw std::invalid_argument("dtype '" + s + "' has no MPI reduction type (expected float32, float64, int64, int32, int16, int8 or uint8)");
}

MPI_Op ParseOp(const std::string& s) {
  if (s == "sum") return MPI_SUM;
  if (s == "product") return MPI_PROD;
  if (s == "min") return MPI_MIN;
  if (s == "max") return MPI_MAX;
  throw std::invalid_argument("unknown reduce op '" + s + "' (expected sum, product, min or max)");
}

void* Ptr(const Napi::Value& v) {
  bool lossless = true;
  uint64_t p = v.As<Napi::BigInt>().Uint64Value(&lossless);
  return reinterpret_cast<void*>(static_cast<uintptr_t>(p));
}

int Count(const Napi::Value& v, const char* what) {
  double d = v.As<Napi::Number>().DoubleValue();
  if (!(d >= 0) || d > 2147483647.0) throw std::invalid_argument(std::string(what) + " " + std::to_string(d) + " does not fit an MPI count");
  return static_cast<int>(d);
}

std::vector<int> Counts(const Napi::Value& v, const char* what) {
  std::vector<int> out;
  Napi::Array a = v.As<Napi::Array>();
  for (uint32_t i = 0; i < a.Length(); ++i) out.push_back(Count(a.Get(i), what));
  return out;
}

// Runs a binding body; a C++ exception becomes a JS error naming the call.
template <class F>
Napi::Value Guard(Napi::Env env, const char* what, F f) {
  try {
    return f();
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Napi::Error::New(env, std::string(what) + ": " + e.what());
  }
}

// ---------------------------------------------------------------------------------------------
// One operation's state, shared by the worker thread and the waiters.

struct Comm;

struct WorkState {
  std::mutex mu;
  std::condition_variable cv;
  bool started = false;
  bool done = false;
  std::string error;
  Clock::time_point startedAt;
  std::string what;
  std::shared_ptr<Comm> comm;
};

struct Op {
  std::shared_ptr<WorkState> work;
  bool pointToPoint = false;
  // Collectives: runs the blocking call. Point-to-point: starts it and sets *req.
  std::function<int(MPI_Request*)> run;
};

struct Pending {
  std::shared_ptr<WorkState> work;
  MPI_Request req;
};

struct Comm : std::enable_shared_from_this<Comm> {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  int64_t timeoutMs = 300000;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> queue;
  std::atomic<bool> poisoned{false};
  std::string poisonWhy;
  std::atomic<bool> stopping{false};
  std::atomic<bool> stopped{false};
  bool freed = false;  // MPI_Comm_free was called (the JS thread only reads and writes it)

  void Start() {
    auto self = shared_from_this();
    std::thread([self] { self->Loop(); }).detach();
  }

  void Enqueue(Op op) {
    {
      std::lock_guard<std::mutex> g(mu);
      queue.push_back(std::move(op));
    }
    cv.notify_one();
  }

  static void Finish(const std::shared_ptr<WorkState>& w, std::string error) {
    {
      std::lock_guard<std::mutex> g(w->mu);
      w->done = true;
      w->error = std::move(error);
    }
    w->cv.notify_all();
  }

  static void MarkStarted(const std::shared_ptr<WorkState>& w) {
    std::lock_guard<std::mutex> g(w->mu);
    w->started = true;
    w->startedAt = Clock::now();
  }

  // Completes finished sends/receives; returns true when any finished.
  bool TestPending(std::vector<Pending>& pending) {
    bool any = false;
    for (size_t i = 0; i < pending.size();) {
      int flag = 0;
      int rc = MPI_Test(&pending[i].req, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS || flag) {
        Finish(pending[i].work, rc == MPI_SUCCESS ? "" : MpiError(rc));
        pending.erase(pending.begin() + static_cast<long>(i));
        any = true;
      } else {
        ++i;
      }
    }
    return any;
  }

  void Loop() {
    std::vector<Pending> pending;
    int idle = 0;
    for (;;) {
      Op op;
      bool have = false;
      {
        std::unique_lock<std::mutex> lk(mu);
        if (pending.empty()) cv.wait(lk, [&] { return !queue.empty() || stopping.load(); });
        if (!queue.empty()) {
          op = std::move(queue.front());
          queue.pop_front();
          have = true;
        } else if (stopping.load() && pending.empty()) {
          break;
        }
      }
      if (have) {
        idle = 0;
        MarkStarted(op.work);
        if (poisoned.load()) {
          Finish(op.work, "the communicator is unusable: " + poisonWhy);
          continue;
        }
        if (op.pointToPoint) {
          MPI_Request req = MPI_REQUEST_NULL;
          int rc = op.run(&req);
          if (rc != MPI_SUCCESS) Finish(op.work, MpiError(rc));
          else pending.push_back({op.work, req});
        } else {
          std::string err;
          try {
            int rc = op.run(nullptr);
            if (rc != MPI_SUCCESS) err = MpiError(rc);
          } catch (const std::exception& e) {
            err = e.what();
          }
          Finish(op.work, err);
        }
        if (!pending.empty()) TestPending(pending);
        continue;
      }
      // Only sends/receives in flight: poll them, backing off to short sleeps so a rank that waits
      // for a slow peer does not take a core from the computing threads.
      if (TestPending(pending)) {
        idle = 0;
      } else if (++idle > 64) {
        struct timespec ts = {0, idle > 1024 ? 200000 : 20000};
        nanosleep(&ts, nullptr);
      } else {
        std::this_thread::yield();
      }
    }
    stopped.store(true);
  }
};

// ---------------------------------------------------------------------------------------------
// Process-wide state

std::mutex g_mu;
bool g_initialized = false;
bool g_finalized = false;
int g_threadLevel = 0;
std::vector<std::weak_ptr<Comm>> g_comms;

// Work: a JS handle to one operation.
class WorkHandle : public Napi::ObjectWrap<WorkHandle> {
 public:
  static Napi::FunctionReference* constructor;
  std::shared_ptr<WorkState> work;

  static void Init(Napi::Env env, Napi::Object exports) {
    Napi::Function fn = DefineClass(env, "MpiWorkHandle",
                                    {InstanceMethod("wait", &WorkHandle::Wait),
                                     InstanceMethod("waitAsync", &WorkHandle::WaitAsync),
                                     InstanceMethod("isCompleted", &WorkHandle::IsCompleted)});
    constructor = new Napi::FunctionReference(Napi::Persistent(fn));
    exports.Set("MpiWorkHandle", fn);
  }
  static Napi::Object New(std::shared_ptr<WorkState> w) {
    Napi::Object o = constructor->New({});
    WorkHandle::Unwrap(o)->work = std::move(w);
    return o;
  }
  explicit WorkHandle(const Napi::CallbackInfo& info) : Napi::ObjectWrap<WorkHandle>(info) {}

  // Waits until done, the communicator's timeout has passed since the operation started, or
  // limitMs (< 0: no limit) has passed. Returns "" when done without error, else the error.
  static std::string Block(const std::shared_ptr<WorkState>& w, int64_t limitMs, bool* finished) {
    auto until = limitMs < 0 ? Clock::time_point::max() : Clock::now() + std::chrono::milliseconds(limitMs);
    std::unique_lock<std::mutex> lk(w->mu);
    for (;;) {
      if (w->done) {
        *finished = true;
        return w->error;
      }
      if (!w->started && w->comm->poisoned.load()) {
        w->done = true;
        w->error = "the communicator is unusable: " + w->comm->poisonWhy;
        *finished = true;
        return w->error;
      }
      auto now = Clock::now();
      if (w->started && now - w->startedAt > std::chrono::milliseconds(w->comm->timeoutMs)) {
        std::string why = "Timed out after " + std::to_string(w->comm->timeoutMs) + " ms in " + w->what +
                          " (a peer never joined or stopped)";
        if (!w->comm->poisoned.exchange(true)) w->comm->poisonWhy = "an earlier " + w->what + " timed out";
        w->done = true;
        w->error = why;
        *finished = true;
        return why;
      }
      if (now >= until) {
        *finished = false;
        return "";
      }
      auto next = now + std::chrono::milliseconds(100);
      if (w->started) next = std::min(next, w->startedAt + std::chrono::milliseconds(w->comm->timeoutMs) + std::chrono::milliseconds(1));
      w->cv.wait_until(lk, std::min(next, until));
    }
  }

  // wait(limitMs?): true when done; throws the operation's error.
  Napi::Value Wait(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    int64_t limit = info.Length() > 0 && info[0].IsNumber() ? info[0].As<Napi::Number>().Int64Value() : -1;
    bool finished = false;
    std::string err = Block(work, limit, &finished);
    if (!err.empty()) throw Napi::Error::New(env, err);
    if (!finished && limit > 0) throw Napi::Error::New(env, "Timed out after waiting " + std::to_string(limit) + " ms for " + work->what);
    return Napi::Boolean::New(env, finished);
  }

  Napi::Value IsCompleted(const Napi::CallbackInfo& info) {
    bool finished = false;
    Block(work, 0, &finished);
    return Napi::Boolean::New(info.Env(), finished);
  }

  Napi::Value WaitAsync(const Napi::CallbackInfo& info);
};
Napi::FunctionReference* WorkHandle::constructor = nullptr;

class WaitWorker : public Napi::AsyncWorker {
 public:
  WaitWorker(Napi::Env env, std::shared_ptr<WorkState> w)
      : Napi::AsyncWorker(env), work_(std::move(w)), deferred_(Napi::Promise::Deferred::New(env)) {}
  Napi::Promise Promise() { return deferred_.Promise(); }
  void Execute() override {
    bool finished = false;
    std::string err = WorkHandle::Block(work_, -1, &finished);
    if (!err.empty()) SetError(err);
  }
  void OnOK() override { deferred_.Resolve(Env().Undefined()); }
  void OnError(const Napi::Error& e) override { deferred_.Reject(e.Value()); }

 private:
  std::shared_ptr<WorkState> work_;
  Napi::Promise::Deferred deferred_;
};

Napi::Value WorkHandle::WaitAsync(const Napi::CallbackInfo& info) {
  auto* w = new WaitWorker(info.Env(), work);
  Napi::Promise p = w->Promise();
  w->Queue();
  return p;
}

// ---------------------------------------------------------------------------------------------
// Communicator handle

class CommHandle : public Napi::ObjectWrap<CommHandle> {
 public:
  static Napi::FunctionReference* constructor;
  std::shared_ptr<Comm> comm;

  static void Init(Napi::Env env, Napi::Object exports) {
    Napi::Function fn = DefineClass(
        env, "MpiCommHandle",
        {InstanceMethod("rank", &CommHandle::Rank), InstanceMethod("size", &CommHandle::Size),
         InstanceMethod("allreduce", &CommHandle::Allreduce), InstanceMethod("broadcast", &CommHandle::Broadcast),
         InstanceMethod("allgather", &CommHandle::Allgather), InstanceMethod("allgatherList", &CommHandle::AllgatherList),
         InstanceMethod("reduceScatter", &CommHandle::ReduceScatter), InstanceMethod("alltoall", &CommHandle::Alltoall),
         InstanceMethod("send", &CommHandle::Send), InstanceMethod("recv", &CommHandle::Recv),
         InstanceMethod("barrier", &CommHandle::Barrier), InstanceMethod("split", &CommHandle::Split),
         InstanceMethod("free", &CommHandle::Free)});
    constructor = new Napi::FunctionReference(Napi::Persistent(fn));
    exports.Set("MpiCommHandle", fn);
  }
  static Napi::Object New(std::shared_ptr<Comm> c) {
    Napi::Object o = constructor->New({});
    CommHandle::Unwrap(o)->comm = std::move(c);
    return o;
  }
  explicit CommHandle(const Napi::CallbackInfo& info) : Napi::ObjectWrap<CommHandle>(info) {}

  Napi::Value Rank(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), comm->rank); }
  Napi::Value Size(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), comm->size); }

  Napi::Value Issue(Napi::Env env, const std::string& what, bool p2p, std::function<int(MPI_Request*)> run) {
    if (g_finalized) throw Napi::Error::New(env, what + ": MPI was finalized");
    if (comm->freed) throw Napi::Error::New(env, what + ": the communicator was freed");
    auto w = std::make_shared<WorkState>();
    w->what = what;
    w->comm = comm;
    if (comm->poisoned.load()) {
      w->started = true;
      w->done = true;
      w->error = "the communicator is unusable: " + comm->poisonWhy;
      return WorkHandle::New(w);
    }
    comm->Enqueue(Op{w, p2p, std::move(run)});
    return WorkHandle::New(w);
  }

  // allreduce(ptr, count, dtype, op): in place.
  Napi::Value Allreduce(const Napi::CallbackInfo& info) {
    return Guard(info.Env(), "Allreduce", [&]() -> Napi::Value {
      Napi::Env env = info.Env();
      void* p = Ptr(info[0]);
      int n = Count(info[1], "count");
      MPI_Datatype t = ParseDtype(info[2].As<Napi::String>());
      MPI_Op op = ParseOp(info[3].As<Napi::String>());
      MPI_Comm c = comm->comm;
      return Issue(env, "MPI_Allreduce", false, [=](MPI_Request*) { return MPI_Allreduce(MPI_IN_PLACE, p, n, t, op, c); });
    });
  }
  // broadcast(ptr, bytes, root)
  Napi::Value Broadcast(const Napi::CallbackInfo& info) {
    return Guard(info.Env(), "Broadcast", [&]() -> Napi::Value {
      void* p = Ptr(info[0]);
      int n = Count(info[1], "bytes");
      int root = info[2].As<Napi::Number>().Int32Value();
      MPI_Comm c = comm->comm;
      return Issue(info.Env(), "MPI_Bcast", false, [=](MPI_Request*) { return MPI_Bcast(p, n, MPI_BYTE, root, c); });
    });
  }
  // allgather(outPtr, inPtr, bytesPerRank): into one buffer of size × bytes.
  Napi::Value Allgather(const Napi::CallbackInfo& info) {
    return Guard(info.Env(), "Allgather", [&]() -> Napi::Value {
      void* out = Ptr(info[0]);
      void* in = Ptr(info[1]);
      int n = Count(info[2], "bytes");
      MPI_Comm c = comm->comm;
      return Issue(info.Env(), "MPI_Allgather", false,
                   [=](MPI_Request*) { return MPI_Allgather(in, n, MPI_BYTE, out, n, MPI_BYTE, c); });
    });
  }
  // allgatherList(outPtrs, inPtr, bytesPerRank): rank i's bytes land in outPtrs[i].
  Napi::Value AllgatherList(const Napi::CallbackInfo& info) {
    return Guard(info.Env(), "AllgatherList", [&]() -> Napi::Value {
      std::vector<void*> outs;
      Napi::Array a = info[0].As<Napi::Array>();
      for (uint32_t i = 0; i < a.Length(); ++i) outs.push_back(Ptr(a.Get(i)));
      void* in = Ptr(info[1]);
      int n = Count(info[2], "bytes");
      MPI_Comm c = comm->comm;
      return Issue(info.Env(), "MPI_Allgather", false, [=](MPI_Request*) {
        std::vector<char> tmp(static_cast<size_t>(n) * outs.size());
        int rc = MPI_Allgather(in, n, MPI_BYTE, tmp.data(), n, MPI_BYTE, c);
        if (rc == MPI_SUCCESS) {
          for (size_t i = 0; i < outs.size(); ++i) std::memcpy(outs[i], tmp.data() + i * static_cast<size_t>(n), static_cast<size_t>(n));
        }
        return rc;
      });
    });
  }
  // reduceScatter(outPtr, inPtr, countPerRank, dtype, op)
  Napi::Value ReduceScatter(const Napi::CallbackInfo& info) {
    return Guard(info.Env(), "ReduceScatter", [&]() -> Napi::Value {
      void* out = Ptr(info[0]);
      void* in = Ptr(info[1]);
      int n = Count(info[2], "count");
      MPI_Datatype t = ParseDtype(info[3].As<Napi::String>());
      MPI_Op op = ParseOp(info[4].As<Napi::String>());
      MPI_Comm c = comm->comm;
      return Issue(info.Env(), "MPI_Reduce_scatter_block", false,
                   [=](MPI_Request*) { return MPI_Reduce_scatter_block(in, out, n, t, op, c); });
    });
  }
  // alltoall(outPtr, inPtr, sendBytes[], recvBytes[]): part i of the input goes to rank i.
  Napi::Value Alltoall(const Napi::CallbackInfo& info) {
    return Guard(info.Env(), "Alltoall", [&]() -> Napi::Value {
      void* out = Ptr(info[0]);
      void* in = Ptr(info[1]);
      std::vector<int> sc = Counts(info[2], "send bytes");
      std::vector<int> rc = Counts(info[3], "receive bytes");
      if (sc.size() != static_cast<size_t>(comm->size) || rc.size() != static_cast<size_t>(comm->size)) {
        throw Napi::Error::New(info.Env(), "MPI_Alltoallv: need one send and one receive count per rank");
      }
      std::vector<int> sd(sc.size()), rd(rc.size());
      int64_t s = 0, r = 0;
      for (size_t i = 0; i < sc.size(); ++i) {
        sd[i] = static_cast<int>(s);
        rd[i] = static_cast<int>(r);
        s += sc[i];
        r += rc[i];
      }
      if (s > 2147483647LL || r > 2147483647LL) throw Napi::Error::New(info.Env(), "MPI_Alltoallv: more than 2 GiB per rank");
      MPI_Comm c = comm->comm;
      return Issue(info.Env(), "MPI_Alltoallv", false, [=](MPI_Request*) {
        return MPI_Alltoallv(in, sc.data(), sd.data(), MPI_BYTE, out, rc.data(), rd.data(), MPI_BYTE, c);
      });
    });
  }
  // send(ptr, bytes, dst, tag) / recv(ptr, bytes, src, tag): non-blocking underneath.
  Napi::Value Send(const Napi::CallbackInfo& info) {
    return PointToPoint(info, "Send", "MPI_Isend", [](void* p, int n, int peer, int tag, MPI_Comm c, MPI_Request* q) {
      return MPI_Isend(p, n, MPI_BYTE, peer, tag, c, q);
    });
  }
  Napi::Value Recv(const Napi::CallbackInfo& info) {
    return PointToPoint(info, "Recv", "MPI_Irecv", [](void* p, int n, int peer, int tag, MPI_Comm c, MPI_Request* q) {
      return MPI_Irecv(p, n, MPI_BYTE, peer, tag, c, q);
    });
  }
  template <typename Post>
  Napi::Value PointToPoint(const Napi::CallbackInfo& info, const char* what, const char* op, Post post) {
    return Guard(info.Env(), what, [&]() -> Napi::Value {
      void* p = Ptr(info[0]);
      int n = Count(info[1], "bytes");
      int peer = info[2].As<Napi::Number>().Int32Value();
      int tag = info[3].As<Napi::Number>().Int32Value();
      MPI_Comm c = comm->comm;
      return Issue(info.Env(), op, true, [=](MPI_Request* q) { return post(p, n, peer, tag, c, q); });
    });
  }
  Napi::Value Barrier(const Napi::CallbackInfo& info) {
    MPI_Comm c = comm->comm;
    return Issue(info.Env(), "MPI_Barrier", false, [=](MPI_Request*) { return MPI_Barrier(c); });
  }

  // split(color, key, timeoutMs): MPI_Comm_split over this communicator, run in its order. Every
  // member must call it; color < 0 means "not in any new communicator" (returns undefined).
  Napi::Value Split(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    int color = info[0].As<Napi::Number>().Int32Value();
    int key = info[1].As<Napi::Number>().Int32Value();
    int64_t timeoutMs = info[2].As<Napi::Number>().Int64Value();
    auto result = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
    MPI_Comm c = comm->comm;
    Napi::Object wo = Issue(env, "MPI_Comm_split", false, [=](MPI_Request*) {
                        return MPI_Comm_split(c, color < 0 ? MPI_UNDEFINED : color, key, result.get());
                      }).As<Napi::Object>();
    bool finished = false;
    std::string err = WorkHandle::Block(WorkHandle::Unwrap(wo)->work, -1, &finished);
    if (!err.empty()) throw Napi::Error::New(env, err);
    if (*result == MPI_COMM_NULL) return env.Undefined();
    return NewComm(env, *result, timeoutMs);
  }

  // free(limitMs): stops the communicator's worker thread (after the operations already issued) and
  // frees the communicator (MPI_Comm_free). Returns false and frees nothing when an operation timed
  // out on it (its thread is stuck inside MPI) or the thread has not stopped within limitMs; later
  // operations on a freed communicator throw.
  Napi::Value Free(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    int64_t limitMs = info.Length() > 0 && info[0].IsNumber() ? info[0].As<Napi::Number>().Int64Value() : 5000;
    if (comm->freed) return Napi::Boolean::New(env, true);
    if (g_finalized || comm->poisoned.load()) return Napi::Boolean::New(env, false);
    comm->stopping.store(true);
    comm->cv.notify_all();
    auto until = Clock::now() + std::chrono::milliseconds(limitMs);
    while (!comm->stopped.load()) {
      if (Clock::now() > until) return Napi::Boolean::New(env, false);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    comm->freed = true;
    int rc = MPI_Comm_free(&comm->comm);
    return Napi::Boolean::New(env, rc == MPI_SUCCESS);
  }

  static Napi::Value NewComm(Napi::Env env, MPI_Comm mc, int64_t timeoutMs) {
    auto c = std::make_shared<Comm>();
    c->comm = mc;
    c->timeoutMs = timeoutMs;
    MPI_Comm_set_errhandler(mc, MPI_ERRORS_RETURN);
    MPI_Comm_rank(mc, &c->rank);
    MPI_Comm_size(mc, &c->size);
    c->Start();
    {
      std::lock_guard<std::mutex> g(g_mu);
      g_comms.push_back(c);
    }
    return CommHandle::New(c);
  }
};
Napi::FunctionReference* CommHandle::constructor = nullptr;

// init(timeoutMs): MPI_Init_thread (once per process) and the world communicator (a duplicate of
// MPI_COMM_WORLD, with errors returned instead of aborting).
Napi::Value InitMpi(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int64_t timeoutMs = info[0].As<Napi::Number>().Int64Value();
  std::unique_lock<std::mutex> g(g_mu);
  if (g_finalized) throw Napi::Error::New(env, "MPI was finalized in this process and cannot start again");
  if (!g_initialized) {
    // Open MPI loads its components as plugins that expect libmpi's symbols to be global; Node
    // loads addons (and so libmpi) with local symbols. Promote libmpi before MPI_Init.
    Dl_info dl;
    if (dladdr(reinterpret_cast<void*>(&MPI_Init_thread), &dl) != 0 && dl.dli_fname != nullptr) {
      dlopen(dl.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    }
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) throw Napi::Error::New(env, "MPI_Init_thread: " + MpiError(rc));
    g_initialized = true;
    g_threadLevel = provided;
    if (provided < MPI_THREAD_MULTIPLE) {
      throw Napi::Error::New(env, "MPI_Init_thread: this Open MPI provides thread level " + std::to_string(provided) +
                                      ", flotilla needs MPI_THREAD_MULTIPLE (3)");
    }
  }
  g.unlock();
  MPI_Comm world = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &world);
  if (rc != MPI_SUCCESS) throw Napi::Error::New(env, "MPI_Comm_dup: " + MpiError(rc));
  return CommHandle::NewComm(env, world, timeoutMs);
}

// finalize(limitMs): stops the communicator threads and calls MPI_Finalize, unless a communicator
// is stuck in a timed-out call (then finalizing would hang: returns false and leaves MPI as it is).
Napi::Value Finalize(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int64_t limitMs = info.Length() > 0 && info[0].IsNumber() ? info[0].As<Napi::Number>().Int64Value() : 5000;
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_initialized || g_finalized) return Napi::Boolean::New(env, g_finalized);
  std::vector<std::shared_ptr<Comm>> comms;
  for (auto& w : g_comms) {
    if (auto c = w.lock()) comms.push_back(c);
  }
  for (auto& c : comms) {
    if (c->poisoned.load() && !c->freed) return Napi::Boolean::New(env, false);
  }
  for (auto& c : comms) {
    c->stopping.store(true);
    c->cv.notify_all();
  }
  auto until = Clock::now() + std::chrono::milliseconds(limitMs);
  for (auto& c : comms) {
    while (!c->stopped.load()) {
      if (Clock::now() > until) return Napi::Boolean::New(env, false);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  // MPI_Finalize waits for every rank to finalize; a peer that died never does. Bound the wait
  // (the process is exiting: a finalize still running then ends with it).
  g_finalized = true;
  auto finished = std::make_shared<std::atomic<bool>>(false);
  std::thread([finished] {
    MPI_Finalize();
    finished->store(true);
  }).detach();
  while (!finished->load()) {
    if (Clock::now() > until) return Napi::Boolean::New(env, false);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return Napi::Boolean::New(env, true);
}

Napi::Value Info(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Napi::Object o = Napi::Object::New(env);
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  std::string v(version, len);
  while (!v.empty() && (v.back() == '\n' || v.back() == '\0' || v.back() == ' ')) v.pop_back();
  o.Set("library", v);
  o.Set("initialized", g_initialized);
  o.Set("finalized", g_finalized);
  o.Set("threadLevel", g_threadLevel);
  return o;
}

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  WorkHandle::Init(env, exports);
  CommHandle::Init(env, exports);
  exports.Set("init", Napi::Function::New(env, InitMpi));
  exports.Set("finalize", Napi::Function::New(env, Finalize));
  exports.Set("info", Napi::Function::New(env, Info));
  return exports;
}

}  // namespace flotilla_mpi

static Napi::Object InitModule(Napi::Env env, Napi::Object exports) { return flotilla_mpi::Init(env, exports); }

NODE_API_MODULE(flotilla_mpi, InitModule)
