// c10d binding: stores for rendezvous (FileStore, PrefixStore, and SocketStore, the client of
// flotilla's own store; libtorch 1.13's TCPStore is not used: it listens on every interface and
// admits anyone), ProcessGroupGloo for collectives, and the async Work handle. All c10d use lives in
// this file so a libtorch 2.x / NCCL build is a local change.
// Which collective to build from which primitive (e.g. reduce-scatter from all-to-all) is decided
// in TypeScript (src/distributed/collectives.ts).
#include "common.h"

#include <ATen/ATen.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>

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
                                     InstanceMethod("isCompleted", &WorkHandle::IsCompleted),
                                     InstanceMethod("release", &WorkHandle::Release)});
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

  // release(): drops the Work now. It holds the group's Gloo context (threads, sockets), which would
  // otherwise live until this handle is garbage-collected, even after the group was destroyed.
  Napi::Value Release(const Napi::CallbackInfo& info) {
    work.reset();
    return info.Env().Undefined();
  }

  WorkPtr& W() {
    if (!work) throw std::runtime_error(what + ": the work handle was released");
    return work;
  }

  // wait(timeoutMs?): blocks this thread until the collective finishes; throws its error.
  Napi::Value Wait(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    auto& work = W();
    bool ok = info.Length() > 0 && info[0].IsNumber() ? work->wait(Ms(info[0], 0)) : work->wait();
    return Napi::Boolean::New(env, ok);
    FLOTILLA_CATCH(env, what)
  }

  Napi::Value IsCompleted(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    return Napi::Boolean::New(env, W()->isCompleted());
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
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  W();
  FLOTILLA_CATCH(env, what)
  auto* w = new WaitWorker(env, work, what);
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
                                     InstanceMethod("wait", &StoreHandle::Wait), InstanceMethod("release", &StoreHandle::Release)});
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
    auto* h = StoreHandle::Unwrap(v.As<Napi::Object>());
    h->S();
    return h->store;
  }
  c10d::Store* S() const {
    if (!store) throw std::runtime_error("the store was released");
    return store.get();
  }
  // release(): drops this handle's reference now (the connection closes once no group uses it).
  Napi::Value Release(const Napi::CallbackInfo& info) {
    store.reset();
    return info.Env().Undefined();
  }
  explicit StoreHandle(const Napi::CallbackInfo& info) : Napi::ObjectWrap<StoreHandle>(info) {}

  Napi::Value Set(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    std::string key = info[0].As<Napi::String>();
    Napi::Buffer<uint8_t> b = info[1].As<Napi::Buffer<uint8_t>>();
    S()->set(key, std::vector<uint8_t>(b.Data(), b.Data() + b.Length()));
    return env.Undefined();
    FLOTILLA_CATCH(env, "store.set")
  }
  Napi::Value Get(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    std::vector<uint8_t> v = S()->get(info[0].As<Napi::String>());
    return Napi::Buffer<uint8_t>::Copy(env, v.data(), v.size());
    FLOTILLA_CATCH(env, "store.get")
  }
  Napi::Value Add(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    int64_t r = S()->add(info[0].As<Napi::String>(), info[1].As<Napi::Number>().Int64Value());
    return Napi::Number::New(env, static_cast<double>(r));
    FLOTILLA_CATCH(env, "store.add")
  }
  Napi::Value Check(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    std::vector<std::string> keys;
    Napi::Array arr = info[0].As<Napi::Array>();
    for (uint32_t i = 0; i < arr.Length(); ++i) keys.push_back(arr.Get(i).As<Napi::String>());
    return Napi::Boolean::New(env, S()->check(keys));
    FLOTILLA_CATCH(env, "store.check")
  }
  Napi::Value Wait(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    std::vector<std::string> keys;
    Napi::Array arr = info[0].As<Napi::Array>();
    for (uint32_t i = 0; i < arr.Length(); ++i) keys.push_back(arr.Get(i).As<Napi::String>());
    if (info.Length() > 1 && info[1].IsNumber()) S()->wait(keys, Ms(info[1], 0));
    else S()->wait(keys);
    return env.Undefined();
    FLOTILLA_CATCH(env, "store.wait")
  }
};
Napi::FunctionReference* StoreHandle::constructor = nullptr;

// ---------------------------------------------------------------------------------------------
// SocketStore: the client side of flotilla's own rendezvous store. The server is TypeScript
// (src/distributed/store_server.ts), which decides who may connect and what sizes are absurd; this
// class only speaks the wire format and implements c10d::Store so that Gloo can rendezvous through it.
//
// [Note: store wire format] Every message is a frame: a u32 little-endian length N, then N bytes. A
// request is one op byte followed by fields, each a u32 little-endian length and its bytes; a reply is
// one status byte followed by fields. On connect the server sends a reply holding a nonce; the client
// answers with an AUTH request carrying the proof the caller computed from it, and only then may it
// read or write keys. Frames longer than the caller's limit are refused before anything is allocated.
// The op and status codes must match store_server.ts.
class SocketStore : public c10d::Store {
 public:
  enum Op : uint8_t { kAuth = 1, kSet = 2, kGet = 3, kAdd = 4, kCheck = 5, kWait = 6, kDelete = 7, kNumKeys = 8, kCompareSet = 9 };
  enum Status : uint8_t { kOk = 0, kMissing = 1, kTimedOut = 2, kRefused = 3 };
  using Fields = std::vector<std::vector<uint8_t>>;
  using Clock = std::chrono::steady_clock;

  SocketStore(std::string host, uint16_t port, std::chrono::milliseconds timeout, uint32_t maxFrame)
      : c10d::Store(timeout), host_(std::move(host)), port_(port), maxFrame_(maxFrame) {
    Connect(Clock::now() + timeout);
  }
  ~SocketStore() override { Close(); }

  // Reads the server's nonce, asks `prove` for the answer, and sends it; throws when refused.
  void Authenticate(const std::function<std::vector<uint8_t>(const std::vector<uint8_t>&)>& prove) {
    std::lock_guard<std::mutex> lock(mu_);
    auto deadline = Clock::now() + timeout_;
    Fields hello;
    uint8_t status = RecvReply(hello, deadline);
    if (status != kOk || hello.size() != 1) Fail("the server at " + Where() + " did not greet like a flotilla store");
    SendRequest(kAuth, {prove(hello[0])}, deadline);
    Fields reply;
    status = RecvReply(reply, deadline);
    if (status != kOk) Fail("the store at " + Where() + " refused this process: " + Text(reply));
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    Fields r;
    Expect(Call(kSet, {Bytes(key), value}, r), kOk, r, "set");
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    Fields r;
    Expect(Call(kCompareSet, {Bytes(key), expected, desired}, r), kOk, r, "compareSet");
    return r.at(0);
  }
  // get waits (server side) up to the store timeout for the key to appear.
  std::vector<uint8_t> get(const std::string& key) override {
    Fields r;
    uint8_t s = Call(kGet, {Bytes(key), Bytes(std::to_string(timeout_.count()))}, r, timeout_);
    if (s == kTimedOut) throw std::runtime_error("timed out after " + std::to_string(timeout_.count()) + " ms waiting for key '" + key + "'");
    Expect(s, kOk, r, "get");
    return r.at(0);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    Fields r;
    Expect(Call(kAdd, {Bytes(key), Bytes(std::to_string(delta))}, r), kOk, r, "add");
    return std::stoll(std::string(r.at(0).begin(), r.at(0).end()));
  }
  bool deleteKey(const std::string& key) override {
    Fields r;
    return Call(kDelete, {Bytes(key)}, r) == kOk;
  }
  bool check(const std::vector<std::string>& keys) override {
    Fields r, f;
    for (const auto& k : keys) f.push_back(Bytes(k));
    return Call(kCheck, f, r) == kOk;
  }
  int64_t getNumKeys() override {
    Fields r;
    Expect(Call(kNumKeys, {}, r), kOk, r, "getNumKeys");
    return std::stoll(std::string(r.at(0).begin(), r.at(0).end()));
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    Fields r, f{Bytes(std::to_string(timeout.count()))};
    for (const auto& k : keys) f.push_back(Bytes(k));
    uint8_t s = Call(kWait, f, r, timeout);
    if (s == kTimedOut) {
      std::string names;
      for (const auto& k : keys) names += (names.empty() ? "'" : ", '") + k + "'";
      throw std::runtime_error("timed out after " + std::to_string(timeout.count()) + " ms waiting for key(s) " + names);
    }
    Expect(s, kOk, r, "wait");
  }

 private:
  std::string host_;
  uint16_t port_;
  uint32_t maxFrame_;
  int fd_ = -1;
  std::mutex mu_;

  std::string Where() const { return host_ + ":" + std::to_string(port_); }
  static std::vector<uint8_t> Bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
  static std::string Text(const Fields& f) { return f.empty() ? std::string("no reason given") : std::string(f[0].begin(), f[0].end()); }

  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  [[noreturn]] void Fail(const std::string& why) {
    Close();
    throw std::runtime_error(why);
  }
  void Expect(uint8_t got, uint8_t want, const Fields& r, const char* op) {
    if (got != want) throw std::runtime_error(std::string("store ") + op + " failed: " + Text(r));
  }

  // One request and its reply. `wait` is how long the server may hold the request (0: forever).
  uint8_t Call(uint8_t op, const Fields& fields, Fields& reply, std::chrono::milliseconds wait = std::chrono::milliseconds(0)) {
    std::lock_guard<std::mutex> lock(mu_);
    if (fd_ < 0) throw std::runtime_error("the connection to the store at " + Where() + " is closed");
    bool forever = (op == kWait || op == kGet) && wait.count() == 0;
    auto deadline = forever ? Clock::time_point::max() : Clock::now() + timeout_ + wait;
    SendRequest(op, fields, deadline);
    return RecvReply(reply, deadline);
  }

  int Remaining(Clock::time_point deadline) {
    if (deadline == Clock::time_point::max()) return -1;
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return ms < 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 1 << 30));
  }

  void WaitFor(short events, Clock::time_point deadline) {
    for (;;) {
      pollfd p{fd_, events, 0};
      int rc = ::poll(&p, 1, Remaining(deadline));
      if (rc > 0) return;
      if (rc == 0) Fail("the store at " + Where() + " did not answer in time");
      if (errno != EINTR) Fail(std::string("poll: ") + std::strerror(errno));
    }
  }

  void SendAll(const uint8_t* p, size_t n, Clock::time_point deadline) {
    while (n > 0) {
      ssize_t w = ::send(fd_, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        p += w;
        n -= static_cast<size_t>(w);
      } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        WaitFor(POLLOUT, deadline);
      } else if (w < 0 && errno == EINTR) {
        continue;
      } else {
        Fail("lost the connection to the store at " + Where() + std::string(": ") + std::strerror(errno));
      }
    }
  }
  void RecvAll(uint8_t* p, size_t n, Clock::time_point deadline) {
    while (n > 0) {
      ssize_t r = ::recv(fd_, p, n, MSG_DONTWAIT);
      if (r > 0) {
        p += r;
        n -= static_cast<size_t>(r);
      } else if (r == 0) {
        Fail("the store at " + Where() + " closed the connection");
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        WaitFor(POLLIN, deadline);
      } else if (errno != EINTR) {
        Fail("lost the connection to the store at " + Where() + std::string(": ") + std::strerror(errno));
      }
    }
  }
  static void PutU32(std::vector<uint8_t>& out, uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  static uint32_t GetU32(const uint8_t* p) {
    return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
  }

  void SendRequest(uint8_t op, const Fields& fields, Clock::time_point deadline) {
    size_t n = 1;
    for (const auto& f : fields) n += 4 + f.size();
    if (n > maxFrame_) throw std::runtime_error("store request of " + std::to_string(n) + " bytes is above the limit of " + std::to_string(maxFrame_));
    std::vector<uint8_t> out;
    out.reserve(4 + n);
    PutU32(out, static_cast<uint32_t>(n));
    out.push_back(op);
    for (const auto& f : fields) {
      PutU32(out, static_cast<uint32_t>(f.size()));
      out.insert(out.end(), f.begin(), f.end());
    }
    SendAll(out.data(), out.size(), deadline);
  }

  uint8_t RecvReply(Fields& fields, Clock::time_point deadline) {
    uint8_t head[4];
    RecvAll(head, 4, deadline);
    uint32_t n = GetU32(head);
    if (n < 1 || n > maxFrame_) Fail("the store at " + Where() + " sent a reply of " + std::to_string(n) + " bytes (limit " + std::to_string(maxFrame_) + ")");
    std::vector<uint8_t> body(n);
    RecvAll(body.data(), n, deadline);
    fields.clear();
    size_t at = 1;
    while (at < n) {
      if (n - at < 4) Fail("malformed reply from the store at " + Where());
      uint32_t len = GetU32(body.data() + at);
      at += 4;
      if (len > n - at) Fail("malformed reply from the store at " + Where());
      fields.emplace_back(body.begin() + at, body.begin() + at + len);
      at += len;
    }
    return body[0];
  }

  // Resolves the host once (an unknown name fails at once), then retries refused connections until
  // the deadline: rank 0 may start its server after the others start connecting.
  void Connect(Clock::time_point deadline) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    int rc = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res);
    if (rc != 0) throw std::runtime_error("cannot resolve host '" + host_ + "': " + ::gai_strerror(rc));
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, ::freeaddrinfo);
    std::string last = "no address";
    for (;;) {
      for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) {
          last = std::strerror(errno);
          continue;
        }
        int c = ::connect(fd, a->ai_addr, a->ai_addrlen);
        if (c < 0 && errno == EINPROGRESS) {
          pollfd p{fd, POLLOUT, 0};
          int left = Remaining(deadline);
          if (::poll(&p, 1, std::min(left < 0 ? 5000 : left, 5000)) == 1) {
            int err = 0;
            socklen_t len = sizeof(err);
            ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
            c = err == 0 ? 0 : -1;
            errno = err;
          } else {
            c = -1;
            errno = ETIMEDOUT;
          }
        }
        if (c == 0) {
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          fd_ = fd;
          return;
        }
        last = std::strerror(errno);
        ::close(fd);
      }
      if (Clock::now() >= deadline) {
        throw std::runtime_error("no store answered at " + Where() + " (" + last + ")");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
};

// createSocketStore(host, port, timeoutMs, maxFrameBytes, prove): connects to a flotilla store and
// proves membership with prove(nonce: Buffer) => Buffer (computed in TypeScript).
static Napi::Value CreateSocketStore(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string host = info[0].As<Napi::String>();
  uint32_t port = info[1].As<Napi::Number>().Uint32Value();
  FLOTILLA_TRY
  auto store = c10::make_intrusive<SocketStore>(host, static_cast<uint16_t>(port), Ms(info[2], 300000),
                                                info[3].As<Napi::Number>().Uint32Value());
  Napi::Function prove = info[4].As<Napi::Function>();
  store->Authenticate([&](const std::vector<uint8_t>& nonce) {
    Napi::Value r = prove.Call({Napi::Buffer<uint8_t>::Copy(env, nonce.data(), nonce.size())});
    if (!r.IsBuffer()) throw std::invalid_argument("the store proof must be a Buffer");
    auto b = r.As<Napi::Buffer<uint8_t>>();
    return std::vector<uint8_t>(b.Data(), b.Data() + b.Length());
  });
  return StoreHandle::New(env, store);
  FLOTILLA_CATCH(env, "store(" + host + ":" + std::to_string(port) + ")")
}

// createFileStore(path, worldSize, timeoutMs): c10d's FileStore (ranks of one host, no listener).
static Napi::Value CreateFileStore(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string path = info[0].As<Napi::String>();
  FLOTILLA_TRY
  auto store = c10::make_intrusive<c10d::FileStore>(path, info[1].As<Napi::Number>().Int32Value());
  store->setTimeout(Ms(info[2], 300000));
  return StoreHandle::New(env, store);
  FLOTILLA_CATCH(env, "FileStore(" + path + ")")
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
         InstanceMethod("backendName", &GroupHandle::BackendName), InstanceMethod("release", &GroupHandle::Release)});
    constructor = new Napi::FunctionReference(Napi::Persistent(fn));
    exports.Set("GroupHandle", fn);
  }
  explicit GroupHandle(const Napi::CallbackInfo& info) : Napi::ObjectWrap<GroupHandle>(info) {}

  // release(): destroys the process group now (its threads, sockets and listener), not at GC.
  Napi::Value Release(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    FLOTILLA_TRY
    pg.reset();
    return env.Undefined();
    FLOTILLA_CATCH(env, "release")
  }

#define GROUP_OP(name, body)                                                         \
  Napi::Value name(const Napi::CallbackInfo& info) {                                  \
    Napi::Env env = info.Env();                                                       \
    FLOTILLA_TRY if (!pg) throw std::runtime_error("the process group was destroyed"); \
    body FLOTILLA_CATCH(env, #name)                                                   \
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
  exports.Set("createPrefixStore", Napi::Function::New(env, CreatePrefixStore));
  exports.Set("createSocketStore", Napi::Function::New(env, CreateSocketStore));
  exports.Set("createFileStore", Napi::Function::New(env, CreateFileStore));
  exports.Set("createGlooGroup", Napi::Function::New(env, CreateGlooGroup));
}

}  // namespace flotilla
