// [Note: tensor cache] A caching allocator for CPU tensor storage, the mechanism PyTorch's GPU
// allocator uses, on mapped pages. A training step allocates the same sizes in every step (each block's
// activations, their gradients), so a freed block is kept, by its size class, and handed to the next
// request of that class (or of a class up to half its size, cut to it): no page faults and no zeroing
// in steady state, and no heap fragmentation, since every block is a mapping of its own. Blocks below
// `minBytes` go to libtorch's own CPU allocation (malloc). Kept blocks go back to the OS, oldest first,
// beyond `capBytes` of cache; and trimTensorCache() unmaps every block that has stayed unused since the
// call before, so memory whose shapes a run no longer uses (construction, an evaluation batch) is
// returned at the next call. Whether the cache is on, the two numbers and when to trim are decided in
// TypeScript (src/tensor/allocator.ts).
#include <sys/mman.h>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>

#include "common.h"

namespace flotilla {
namespace {

constexpr size_t kPage = 4096;

// Size class of a request: whole pages, then at most 8 classes per doubling above 1 MiB (a block is
// at most 1/8 larger than asked; the tail pages are never touched by that tensor, so never resident
// on its account).
size_t ClassOf(size_t n) {
  size_t c = (n + kPage - 1) / kPage * kPage;
  if (c <= (size_t{1} << 20)) return c;
  size_t top = size_t{1} << (63 - __builtin_clzll(c));
  size_t granule = top / 8;
  return (c + granule - 1) / granule * granule;
}

struct Cache {
  std::mutex mu;
  size_t min_bytes = 0;
  size_t cap_bytes = 0;  // 0: off
  // Blocks handed out (address -> class size), and kept ones: `lru` in free order (newest first),
  // `by_class` the same blocks per class (oldest first), so a request takes its class's newest
  // block (warmest in cache) and eviction takes the overall oldest. `gen` counts trims: a kept
  // block remembers the one it was freed in.
  struct Kept {
    void* addr;
    size_t cls;
    uint64_t gen;
  };
  std::unordered_map<void*, size_t> live;
  std::list<Kept> lru;
  std::map<size_t, std::deque<std::list<Kept>::iterator>> by_class;
  uint64_t gen = 0;
  size_t live_bytes = 0, cached_bytes = 0;
  uint64_t hits = 0, misses = 0, evictions = 0;

  void EvictOldestLocked() {
    const Kept k = lru.back();
    auto& q = by_class[k.cls];
    q.pop_front();  // the class's oldest is the list's oldest
    if (q.empty()) by_class.erase(k.cls);
    lru.pop_back();
    munmap(k.addr, k.cls);
    cached_bytes -= k.cls;
    ++evictions;
  }
};

// Never destroyed: tensors may be freed by static destructors after this file's would have run.
Cache& TheCache() {
  static Cache* c = new Cache();
  return *c;
}

void Free(void* p) {
  if (p == nullptr) return;
  Cache& c = TheCache();
  {
    std::lock_guard<std::mutex> g(c.mu);
    auto it = c.live.find(p);
    if (it != c.live.end()) {
      size_t cls = it->second;
      c.live.erase(it);
      c.live_bytes -= cls;
      c.lru.push_front({p, cls, c.gen});
      c.by_class[cls].push_back(c.lru.begin());
      c.cached_bytes += cls;
      while (c.cached_bytes > c.cap_bytes && !c.lru.empty()) c.EvictOldestLocked();
      return;
    }
  }
  c10::free_cpu(p);
}

struct CachingCpuAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) const override {
    const c10::Device cpu(c10::DeviceType::CPU);
    Cache& c = TheCache();
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> g(c.mu);
      if (c.cap_bytes > 0 && n >= c.min_bytes && n > 0) {
        size_t cls = ClassOf(n);
        // The request's class, or else the smallest kept class up to twice its size: a block kept
        // idle while a fresh one is mapped would add to the resident size. A larger block is cut to
        // the request's class and its tail unmapped: its pages were touched by the tensor that had
        // it, and kept for a tensor that may live for the whole run (optimizer state made in the
        // first step from blocks the first backward freed) they were resident memory no tensor used.
        auto q = c.by_class.lower_bound(cls);
        if (q != c.by_class.end() && q->first <= 2 * cls) {
          const size_t kept = q->first;
          auto node = q->second.back();
          q->second.pop_back();
          if (q->second.empty()) c.by_class.erase(q);
          p = node->addr;
          c.lru.erase(node);
          c.cached_bytes -= kept;
          if (kept > cls) munmap(static_cast<char*>(p) + cls, kept - cls);
          ++c.hits;
        } else {
          p = mmap(nullptr, cls, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
          if (p == MAP_FAILED && !c.lru.empty()) {
            while (!c.lru.empty()) c.EvictOldestLocked();  // give the cache back and try once more
            p = mmap(nullptr, cls, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
          }
          // Still no mapping (e.g. the limit on mappings per process): malloc may have room, and
          // fails with libtorch's own message if not.
          if (p == MAP_FAILED) p = nullptr;
          else ++c.misses;
        }
        if (p != nullptr) {
          c.live.emplace(p, cls);
          c.live_bytes += cls;
        }
      }
    }
    if (p == nullptr) p = c10::alloc_cpu(n);
    return {p, p, &Free, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#endif
};

CachingCpuAllocator g_caching_allocator;

// setTensorCache(minBytes, capBytes): turns the cache on (installing it as libtorch's CPU allocator
// the first time) with these limits; capBytes 0 turns it off and unmaps what it holds. Tensors made
// before keep the allocator they were made with.
Napi::Value SetTensorCache(const Napi::CallbackInfo& info) {
  Cache& c = TheCache();
  size_t min_bytes = static_cast<size_t>(info[0].As<Napi::Number>().Int64Value());
  size_t cap_bytes = static_cast<size_t>(info[1].As<Napi::Number>().Int64Value());
  static bool installed = false;
  {
    std::lock_guard<std::mutex> g(c.mu);
    c.min_bytes = min_bytes;
    c.cap_bytes = cap_bytes;
    while (c.cached_bytes > c.cap_bytes && !c.lru.empty()) c.EvictOldestLocked();
  }
  if (cap_bytes > 0 && !installed) {
    c10::SetCPUAllocator(&g_caching_allocator, /*priority=*/1);
    installed = true;
  }
  return info.Env().Undefined();
}

// trimTensorCache(): unmaps the kept blocks that no request has taken since the call before (they
// were freed before it); returns the bytes given back.
Napi::Value TrimTensorCache(const Napi::CallbackInfo& info) {
  Cache& c = TheCache();
  std::lock_guard<std::mutex> g(c.mu);
  size_t before = c.cached_bytes;
  while (!c.lru.empty() && c.lru.back().gen < c.gen) c.EvictOldestLocked();
  ++c.gen;
  return Napi::Number::New(info.Env(), static_cast<double>(before - c.cached_bytes));
}

// emptyTensorCache(): unmaps every cached block; returns the bytes given back.
Napi::Value EmptyTensorCache(const Napi::CallbackInfo& info) {
  Cache& c = TheCache();
  std::lock_guard<std::mutex> g(c.mu);
  size_t before = c.cached_bytes;
  while (!c.lru.empty()) c.EvictOldestLocked();
  return Napi::Number::New(info.Env(), static_cast<double>(before));
}

// tensorCacheStats(): bytes in blocks handed out and in cached blocks, and the counts of requests
// served from the cache (hits), by a new mapping (misses), and of blocks unmapped from it.
Napi::Value TensorCacheStats(const Napi::CallbackInfo& info) {
  Cache& c = TheCache();
  std::lock_guard<std::mutex> g(c.mu);
  Napi::Object o = Napi::Object::New(info.Env());
  o.Set("on", c.cap_bytes > 0);
  o.Set("liveBytes", static_cast<double>(c.live_bytes));
  o.Set("cachedBytes", static_cast<double>(c.cached_bytes));
  o.Set("hits", static_cast<double>(c.hits));
  o.Set("misses", static_cast<double>(c.misses));
  o.Set("evictions", static_cast<double>(c.evictions));
  return o;
}

}  // namespace

void InitTensorCache(Napi::Env env, Napi::Object exports) {
  exports.Set("setTensorCache", Napi::Function::New(env, SetTensorCache));
  exports.Set("emptyTensorCache", Napi::Function::New(env, EmptyTensorCache));
  exports.Set("trimTensorCache", Napi::Function::New(env, TrimTensorCache));
  exports.Set("tensorCacheStats", Napi::Function::New(env, TensorCacheStats));
}

}  // namespace flotilla
