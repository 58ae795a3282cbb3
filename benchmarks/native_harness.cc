// Standalone stress harness of sntf's native bookkeeping, without TensorFlow:
// the host pool (allocation, trimming, pinning with a cap and outside the
// pool's mutex, the CUDA-runtime lookup) and the tensor cache's per-device
// decisions (tf_ops/cache_core.h) with copies that complete on another
// thread, fail now and then, and tickets read on the wrong device.
//
// benchmarks/sanitize_native.sh builds it under AddressSanitizer and
// ThreadSanitizer and runs it; tests/test_native_harness.py runs a short
// plain build. Exits 0 and prints "harness: ok" when every check held.
//
//   native_harness [--quick]
//
// With SNTF_CUDART_LIBRARY naming a CUDA runtime (the stub in
// tf_ops/testing/, or a real libcudart on a GPU machine) the pool is also
// pinned through that runtime.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cache_core.h"
#include "cuda_runtime_pinning.h"
#include "host_pool.h"

#define HARNESS_CHECK(cond)                                               \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "harness: check failed at %s:%d: %s\n",        \
                   __FILE__, __LINE__, #cond);                            \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)

namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

struct Scale {
  int threads;
  int pool_ops;
  int cache_ops;
};

// ---------------------------------------------------------------- the pool

// Pin hooks that take their time (as page-locking does), check that no
// region is pinned twice or unpinned unpinned, and that the pinned bytes
// never exceed the cap.
class SlowPinRecorder {
 public:
  explicit SlowPinRecorder(uint64_t cap) : cap_(cap) {}

  sntf::PinHooks Hooks() {
    sntf::PinHooks hooks;
    hooks.pin = [this](void* base, uint64_t bytes) { return Pin(base, bytes); };
    hooks.unpin = [this](void* base) { Unpin(base); };
    return hooks;
  }

  void CheckAllUnpinned() {
    std::lock_guard<std::mutex> lock(mu_);
    HARNESS_CHECK(pinned_.empty());
    HARNESS_CHECK(pinned_bytes_ == 0);
  }

  uint64_t pins() const { return pins_.load(); }

 private:
  int Pin(void* base, uint64_t bytes) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    std::lock_guard<std::mutex> lock(mu_);
    HARNESS_CHECK(pinned_.count(base) == 0);
    pinned_.insert(base);
    sizes_.push_back({base, bytes});
    pinned_bytes_ += bytes;
    HARNESS_CHECK(pinned_bytes_ <= cap_);
    pins_.fetch_add(1);
    return 0;
  }

  void Unpin(void* base) {
    std::lock_guard<std::mutex> lock(mu_);
    HARNESS_CHECK(pinned_.erase(base) == 1);
    for (auto it = sizes_.begin(); it != sizes_.end(); ++it) {
      if (it->first == base) {
        pinned_bytes_ -= it->second;
        sizes_.erase(it);
        break;
      }
    }
  }

  const uint64_t cap_;
  std::mutex mu_;
  std::set<void*> pinned_;
  std::vector<std::pair<void*, uint64_t>> sizes_;
  uint64_t pinned_bytes_ = 0;
  std::atomic<uint64_t> pins_{0};
};

struct Block {
  unsigned char* p;
  uint64_t size;
  unsigned char tag;
};

void PoolWorker(sntf::HostPool* pool, int id, int ops) {
  std::mt19937_64 rng(1234 + id);
  std::vector<Block> live;
  for (int i = 0; i < ops; ++i) {
    if (!live.empty() && (rng() % 2 == 0 || live.size() > 32)) {
      const size_t k = rng() % live.size();
      Block b = live[k];
      live[k] = live.back();
      live.pop_back();
      HARNESS_CHECK(b.p[0] == b.tag && b.p[b.size - 1] == b.tag);
      HARNESS_CHECK(pool->Deallocate(b.p));
      continue;
    }
    // Mostly small blocks, sometimes one that needs a new region.
    const uint64_t n = rng() % 16 == 0 ? (1 + rng() % 6) * kMiB
                                       : 1 + rng() % (64 * 1024);
    bool pinned = false;
    auto* p = static_cast<unsigned char*>(pool->Allocate(n, nullptr, &pinned));
    if (p == nullptr) continue;  // over the limit: allowed, checked by stats
    const uint64_t size = pool->AllocatedSize(p);
    HARNESS_CHECK(size >= n);
    const auto tag = static_cast<unsigned char>(id * 31 + i % 31 + 1);
    std::memset(p, tag, size);
    live.push_back({p, size, tag});
  }
  for (const Block& b : live) HARNESS_CHECK(pool->Deallocate(b.p));
}

void RunPoolStress(const Scale& scale) {
  const uint64_t cap = 64 * kMiB;
  sntf::HostPool pool(512 * kMiB, kMiB, cap);
  SlowPinRecorder recorder(cap);
  std::atomic<bool> stop{false};
  std::thread trimmer([&] {
    while (!stop.load()) {
      pool.Trim();
      std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < scale.threads; ++t) {
    workers.emplace_back(PoolWorker, &pool, t, scale.pool_ops);
  }
  // Hooks arrive while the pool is busy: existing regions get pinned
  // outside the lock while workers allocate and the trimmer trims.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  pool.SetPinHooks(recorder.Hooks());
  for (auto& w : workers) w.join();
  stop = true;
  trimmer.join();
  const sntf::HostPoolStats before = pool.GetStats();
  HARNESS_CHECK(before.bytes_in_use == 0 && before.active_allocs == 0);
  HARNESS_CHECK(before.pinned_bytes <= cap);
  pool.Trim();
  const sntf::HostPoolStats after = pool.GetStats();
  HARNESS_CHECK(after.bytes_reserved == 0 && after.num_regions == 0);
  HARNESS_CHECK(after.pinned_bytes == 0 && after.pinned_regions == 0);
  recorder.CheckAllUnpinned();
  std::printf("harness: pool ok (%llu pins, %llu regions over the cap)\n",
              static_cast<unsigned long long>(recorder.pins()),
              static_cast<unsigned long long>(after.pin_over_limit));
}

void RunCudaRuntimePinning(const Scale& scale) {
  const char* library = std::getenv(sntf::kCudaRuntimeEnv);
  if (library == nullptr || *library == '\0') {
    std::printf("harness: CUDA runtime pinning skipped (%s unset)\n",
                sntf::kCudaRuntimeEnv);
    return;
  }
  sntf::PinHooks hooks;
  std::string error;
  HARNESS_CHECK(sntf::CudaRuntimePinHooks(&hooks, &error));
  sntf::HostPool pool(256 * kMiB, kMiB, 16 * kMiB);
  pool.SetPinHooks(std::move(hooks));
  std::vector<std::thread> workers;
  for (int t = 0; t < scale.threads; ++t) {
    workers.emplace_back(PoolWorker, &pool, 100 + t, scale.pool_ops / 4);
  }
  for (auto& w : workers) w.join();
  HARNESS_CHECK(pool.GetStats().pinned_bytes <= 16 * kMiB);
  pool.Trim();
  HARNESS_CHECK(pool.GetStats().pinned_bytes == 0);
  std::printf("harness: CUDA runtime pinning ok (%s)\n",
              sntf::CudaRuntimeLibrary().c_str());
}

// ------------------------------------------------------------ the cache

struct Blob {
  std::vector<unsigned char> bytes;
};
using Handle = std::shared_ptr<Blob>;

struct HandleTraits {
  static uint64_t Bytes(const Handle& h) { return h ? h->bytes.size() : 0; }
  static bool SoleOwner(const Handle& h) { return h.use_count() == 1; }
};

using Registry = sntf::CacheRegistry<Handle, HandleTraits>;
using Cache = Registry::Cache;

// A copy "stream": one thread running jobs in issue order, as a device's
// copy stream completes them.
class Stream {
 public:
  Stream() : thread_([this] { Serve(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    ready_.notify_all();
    thread_.join();
  }

  void Enqueue(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
  }

 private:
  void Serve() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [this] { return done_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  bool done_ = false;
  std::thread thread_;
};

// Waits for the copies one Put issued, like an async kernel's done.
class Latch {
 public:
  explicit Latch(int count) : count_(count) {}
  void CountDown() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--count_ == 0) zero_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    zero_.wait(lock, [this] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable zero_;
  int count_;
};

Handle MakeBlob(uint64_t bytes, unsigned char tag) {
  auto blob = std::make_shared<Blob>();
  blob->bytes.assign(bytes, tag);
  return blob;
}

Handle CopyOf(const Handle& from) {
  auto blob = std::make_shared<Blob>();
  blob->bytes = from->bytes;
  return blob;
}

// One SnCacheOut: decide, issue the copies on the stream, wait for them.
// Returns false when parking x failed (the op's error).
bool CacheOut(Cache* cache, Stream* stream, const Handle& x, int64_t live,
              int64_t budget, int64_t headroom, int uses, std::mt19937_64* rng,
              int64_t* ticket) {
  Cache::Decision decision = cache->Put(x, live, budget, headroom, uses);
  *ticket = decision.ticket;
  const int copies =
      static_cast<int>(decision.victims.size()) + (decision.keep ? 0 : 1);
  Latch latch(copies);
  std::atomic<bool> parked_ok{true};
  for (Cache::Victim& victim : decision.victims) {
    const bool fail = (*rng)() % 40 == 0;
    stream->Enqueue([cache, victim, fail, &latch]() mutable {
      Handle host = fail ? Handle() : CopyOf(victim.device);
      victim.device.reset();  // the copy lets go before "done"
      cache->FinishEviction(victim.ticket, !fail, host, victim.freed);
      latch.CountDown();
    });
  }
  if (!decision.keep) {
    const bool fail = (*rng)() % 40 == 0;
    const int64_t t = decision.ticket;
    stream->Enqueue([cache, x, t, fail, &latch, &parked_ok] {
      Handle host = fail ? Handle() : CopyOf(x);
      cache->FinishParking(t, !fail, host);
      if (fail) parked_ok = false;
      latch.CountDown();
    });
  }
  latch.Wait();
  return parked_ok.load();
}

void CacheWorker(Registry* registry, Cache* mine, Cache* other,
                 Stream* stream, int id, int ops) {
  std::mt19937_64 rng(99 + id);
  for (int i = 0; i < ops; ++i) {
    const auto tag = static_cast<unsigned char>(id * 17 + i % 17 + 1);
    const uint64_t bytes = 1 + rng() % 4096;
    Handle x = MakeBlob(bytes, tag);
    const int64_t budget = 64 * 1024;
    const int64_t live = static_cast<int64_t>(rng() % (2 * budget));
    const int64_t headroom =
        rng() % 3 == 0 ? -1 : static_cast<int64_t>(rng() % (32 * 1024));
    const int uses = 1 + static_cast<int>(rng() % 2);
    int64_t ticket = 0;
    const bool ok =
        CacheOut(mine, stream, x, live, budget, headroom, uses, &rng, &ticket);
    if (rng() % 2 == 0) x.reset();  // the caller's reference goes
    if (ok && rng() % 8 != 0) {
      Handle read;
      std::string owner;
      HARNESS_CHECK(registry->Take(other, ticket, &read, &owner) ==
                    sntf::TakeResult::kOtherDevice);
      HARNESS_CHECK(owner == mine->device());
      for (int u = 0; u < uses; ++u) {
        const sntf::TakeResult result =
            registry->Take(mine, ticket, &read, &owner);
        HARNESS_CHECK(result == sntf::TakeResult::kDevice ||
                      result == sntf::TakeResult::kHost);
        HARNESS_CHECK(read && read->bytes.size() == bytes);
        HARNESS_CHECK(read->bytes.front() == tag && read->bytes.back() == tag);
      }
      HARNESS_CHECK(registry->Take(mine, ticket, &read, &owner) ==
                    sntf::TakeResult::kMissing);
    }
    // The ticket's last holder goes: after its reads, or a failed step.
    registry->Release(ticket);
  }
}

void RunCacheStress(const Scale& scale) {
  Registry registry;
  Cache* dev0 = registry.ForDevice("/device:TEST:0");
  Cache* dev1 = registry.ForDevice("/device:TEST:1");
  HARNESS_CHECK(dev0 != nullptr && dev1 != nullptr && dev0 != dev1);
  HARNESS_CHECK(registry.ForDevice("/device:TEST:0") == dev0);
  {
    Stream stream0, stream1;
    std::vector<std::thread> workers;
    for (int t = 0; t < scale.threads; ++t) {
      const bool first = t % 2 == 0;
      workers.emplace_back(CacheWorker, &registry, first ? dev0 : dev1,
                           first ? dev1 : dev0, first ? &stream0 : &stream1, t,
                           scale.cache_ops);
    }
    for (auto& w : workers) w.join();
  }
  int64_t entries = -1, device_bytes = -1;
  registry.Gauges(&entries, &device_bytes);
  HARNESS_CHECK(entries == 0 && device_bytes == 0);
  std::printf("harness: cache ok\n");
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const Scale scale = quick ? Scale{4, 2000, 400} : Scale{4, 20000, 4000};
  RunPoolStress(scale);
  RunCudaRuntimePinning(scale);
  RunCacheStress(scale);
  std::printf("harness: ok\n");
  return 0;
}
