// The tensor cache's bookkeeping, free of TensorFlow and of copying.
//
// One DeviceTensorCache per device decides, under that device's lock, which
// tensors stay on the device, which cached ones are evicted, and records the
// outcome of copies that the caller issues and completes outside the lock
// (tensor_cache.cc with TensorFlow tensors and copiers; the sanitizer
// harness in benchmarks/ with plain shared buffers and its own threads).
//
// `T` is a reference-counted tensor handle; `Traits` says how many bytes it
// holds (`Bytes`) and whether the handle passed is the only reference to
// its buffer (`SoleOwner`).
//
// A ticket names one entry: the device's index in the registry in its top
// bits and a process-wide serial below, so a ticket read on another device
// is recognised as such and never hands out that device's tensor.
#ifndef SNTF_TF_OPS_CACHE_CORE_H_
#define SNTF_TF_OPS_CACHE_CORE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace sntf {

constexpr int kTicketSerialBits = 48;
constexpr int kMaxCacheDevices = 1 << 14;

inline int TicketDevice(int64_t ticket) {
  return static_cast<int>(static_cast<uint64_t>(ticket) >> kTicketSerialBits);
}

enum class EntryState {
  kOnDevice,  // kept: the cache holds the device tensor
  kEvicting,  // being copied to the host; the device tensor is still valid
  kParking,   // its own copy to the host is in flight (ticket not out yet)
  kOnHost,    // the host copy is the tensor
};

// What a lookup found.
enum class TakeResult { kDevice, kHost, kMissing, kNotReady, kOtherDevice };

template <typename T, typename Traits>
class DeviceTensorCache {
 public:
  // A cached tensor chosen for eviction: copy `device` to the host, then
  // call FinishEviction(ticket, ...). `freed` device bytes were counted as
  // released by the decision.
  struct Victim {
    int64_t ticket;
    T device;
    int64_t freed;
  };
  struct Decision {
    int64_t ticket = 0;
    bool keep = false;  // x stays on the device: no copy
    std::vector<Victim> victims;
  };

  DeviceTensorCache(std::string device, int index, std::atomic<int64_t>* serial)
      : device_(std::move(device)), index_(index), serial_(serial) {}

  const std::string& device() const { return device_; }
  int index() const { return index_; }

  // Registers x (already counted in `live`, the device allocator's bytes in
  // use; negative: no statistics, so x goes to the host). x stays while
  // live bytes fit `budget` and the cached bytes plus x fit `headroom`
  // (negative: no cap). Least recently used cached tensors are evicted
  // first: for the headroom any of them, for the budget only those the
  // cache alone still holds, since evicting a tensor others hold frees no
  // device memory. Evictions already in flight count as freed.
  Decision Put(const T& x, int64_t live, int64_t budget, int64_t headroom,
               int uses) {
    const int64_t bytes = static_cast<int64_t>(Traits::Bytes(x));
    Decision decision;
    std::lock_guard<std::mutex> lock(mu_);
    decision.ticket = NewTicket();
    Entry entry;
    entry.bytes = bytes;
    entry.uses_left = uses;
    entry.state = EntryState::kParking;
    if (live >= 0) {
      const int64_t cap =
          headroom < 0 ? std::numeric_limits<int64_t>::max() : headroom;
      int64_t projected = live - pending_free_;
      ChooseVictimsLocked(bytes, budget, cap, &projected, &decision.victims);
      decision.keep = projected <= budget && FitsLocked(cached_bytes_, bytes, cap);
    }
    if (decision.keep) {
      entry.device = x;
      entry.state = EntryState::kOnDevice;
      cached_bytes_ += bytes;
      entry.lru = lru_.insert(lru_.end(), decision.ticket);
    }
    entries_.emplace(decision.ticket, std::move(entry));
    return decision;
  }

  // Registers a tensor that already lives in host memory: no copy, no
  // device bytes.
  int64_t PutHost(const T& host, int uses) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t ticket = NewTicket();
    Entry entry;
    entry.bytes = static_cast<int64_t>(Traits::Bytes(host));
    entry.uses_left = uses;
    entry.state = EntryState::kOnHost;
    entry.host = host;
    entries_.emplace(ticket, std::move(entry));
    return ticket;
  }

  // Records the end of an eviction copy. On failure the tensor is cached
  // again, as the most recently used.
  void FinishEviction(int64_t ticket, bool ok, const T& host, int64_t freed) {
    T released;  // destroyed after the lock is released
    std::lock_guard<std::mutex> lock(mu_);
    pending_free_ -= freed;
    auto it = entries_.find(ticket);
    if (it == entries_.end() || it->second.state != EntryState::kEvicting) {
      return;  // dropped meanwhile: its ticket died, or the cache was cleared
    }
    Entry& entry = it->second;
    if (ok) {
      released = std::move(entry.device);
      entry.device = T();
      entry.host = host;
      entry.state = EntryState::kOnHost;
      return;
    }
    entry.state = EntryState::kOnDevice;
    cached_bytes_ += entry.bytes;
    entry.lru = lru_.insert(lru_.end(), ticket);
  }

  // Records the end of x's own copy to the host (its ticket is not out
  // yet). A failed one leaves the entry for the ticket's release to drop.
  void FinishParking(int64_t ticket, bool ok, const T& host) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(ticket);
    if (!ok || it == entries_.end() ||
        it->second.state != EntryState::kParking) {
      return;
    }
    it->second.host = host;
    it->second.state = EntryState::kOnHost;
  }

  // One read of a ticket: the device tensor while it is still there (a
  // hit), else the host copy. The entry goes after its last use.
  TakeResult Take(int64_t ticket, T* tensor) {
    Entry dropped;  // destroyed after the lock is released
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(ticket);
    if (it == entries_.end()) return TakeResult::kMissing;
    Entry& entry = it->second;
    TakeResult result = TakeResult::kHost;
    switch (entry.state) {
      case EntryState::kParking:
        return TakeResult::kNotReady;
      case EntryState::kOnDevice:
        // Recently used: the last to be evicted.
        lru_.splice(lru_.end(), lru_, entry.lru);
        *tensor = entry.device;
        result = TakeResult::kDevice;
        break;
      case EntryState::kEvicting:
        *tensor = entry.device;
        result = TakeResult::kDevice;
        break;
      case EntryState::kOnHost:
        *tensor = entry.host;
        break;
    }
    if (--entry.uses_left <= 0) dropped = DropLocked(it);
    return result;
  }

  // The ticket's last holder is gone (its step ended, finished or failed):
  // the entry goes, whatever reads were still planned.
  bool Release(int64_t ticket) {
    Entry dropped;  // destroyed after the lock is released
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(ticket);
    if (it == entries_.end()) return false;
    dropped = DropLocked(it);
    return true;
  }

  // Drops every entry; returns how many there were.
  int64_t Clear() {
    std::unordered_map<int64_t, Entry> dropped;  // destroyed after unlocking
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t n = static_cast<int64_t>(entries_.size());
    dropped.swap(entries_);
    lru_.clear();
    cached_bytes_ = 0;
    return n;
  }

  // Live entries, and bytes of the entries whose device tensor is held.
  void Gauges(int64_t* entries, int64_t* device_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    *entries = static_cast<int64_t>(entries_.size());
    *device_bytes = 0;
    for (const auto& kv : entries_) {
      const EntryState state = kv.second.state;
      if (state == EntryState::kOnDevice || state == EntryState::kEvicting) {
        *device_bytes += kv.second.bytes;
      }
    }
  }

 private:
  struct Entry {
    T device;  // while kOnDevice / kEvicting
    T host;    // while kOnHost
    EntryState state = EntryState::kParking;
    int uses_left = 1;
    int64_t bytes = 0;
    std::list<int64_t>::iterator lru;  // valid while kOnDevice
  };

  static bool FitsLocked(int64_t cached, int64_t bytes, int64_t cap) {
    return cached <= cap && bytes <= cap - cached;
  }

  int64_t NewTicket() {
    const int64_t serial =
        serial_->fetch_add(1) & ((int64_t{1} << kTicketSerialBits) - 1);
    return (static_cast<int64_t>(index_) << kTicketSerialBits) | serial;
  }

  void ChooseVictimsLocked(int64_t bytes, int64_t budget, int64_t cap,
                           int64_t* projected, std::vector<Victim>* victims) {
    for (auto it = lru_.begin(); it != lru_.end();) {
      const bool over_cap = !FitsLocked(cached_bytes_, bytes, cap);
      if (!over_cap && *projected <= budget) break;
      Entry& victim = entries_.at(*it);
      const bool sole = Traits::SoleOwner(victim.device);
      if (!over_cap && !sole) {
        ++it;  // evicting it frees nothing until its other holders go
        continue;
      }
      const int64_t freed = sole ? victim.bytes : 0;
      *projected -= freed;
      pending_free_ += freed;
      cached_bytes_ -= victim.bytes;
      victim.state = EntryState::kEvicting;
      victims->push_back({*it, victim.device, freed});
      it = lru_.erase(it);
    }
  }

  Entry DropLocked(typename std::unordered_map<int64_t, Entry>::iterator it) {
    Entry entry = std::move(it->second);
    if (entry.state == EntryState::kOnDevice) {
      lru_.erase(entry.lru);
      cached_bytes_ -= entry.bytes;
    }
    entries_.erase(it);
    return entry;
  }

  const std::string device_;
  const int index_;
  std::atomic<int64_t>* const serial_;
  std::mutex mu_;
  std::unordered_map<int64_t, Entry> entries_;
  std::list<int64_t> lru_;     // tickets of kOnDevice entries, oldest first
  int64_t cached_bytes_ = 0;   // bytes of kOnDevice entries
  int64_t pending_free_ = 0;   // device bytes that evictions in flight free
};

// One DeviceTensorCache per device name, created on first use and owned by
// the registry (TensorFlow's registry is never destroyed: tickets may be
// released during process exit).
template <typename T, typename Traits>
class CacheRegistry {
 public:
  using Cache = DeviceTensorCache<T, Traits>;

  CacheRegistry() = default;
  CacheRegistry(const CacheRegistry&) = delete;
  CacheRegistry& operator=(const CacheRegistry&) = delete;
  ~CacheRegistry() {
    for (int i = 0; i < count_; ++i) delete caches_[i].load();
  }

  // The cache of `device`; nullptr once kMaxCacheDevices devices exist.
  Cache* ForDevice(const std::string& device) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int i = 0; i < count_; ++i) {
      Cache* cache = caches_[i].load();
      if (cache->device() == device) return cache;
    }
    if (count_ == kMaxCacheDevices) return nullptr;
    Cache* cache = new Cache(device, count_, &serial_);
    caches_[count_].store(cache);
    ++count_;
    return cache;
  }

  // The cache that issued `ticket`; nullptr for a ticket no cache issued.
  Cache* ForTicket(int64_t ticket) const {
    if (ticket < 0) return nullptr;
    const int index = TicketDevice(ticket);
    if (index >= kMaxCacheDevices) return nullptr;
    return caches_[index].load();
  }

  // Looks `ticket` up for a read on `cache`'s device. A ticket another
  // device issued is reported (kOtherDevice, *owner set), never read.
  TakeResult Take(Cache* cache, int64_t ticket, T* tensor,
                  std::string* owner) const {
    Cache* issuer = ForTicket(ticket);
    if (issuer == nullptr) return TakeResult::kMissing;
    if (issuer != cache) {
      *owner = issuer->device();
      return TakeResult::kOtherDevice;
    }
    return cache->Take(ticket, tensor);
  }

  bool Release(int64_t ticket) {
    Cache* cache = ForTicket(ticket);
    return cache != nullptr && cache->Release(ticket);
  }

  int64_t Clear() {
    int64_t n = 0;
    for (int i = 0; i < Count(); ++i) n += caches_[i].load()->Clear();
    return n;
  }

  void Gauges(int64_t* entries, int64_t* device_bytes) {
    *entries = 0;
    *device_bytes = 0;
    for (int i = 0; i < Count(); ++i) {
      int64_t e = 0, b = 0;
      caches_[i].load()->Gauges(&e, &b);
      *entries += e;
      *device_bytes += b;
    }
  }

 private:
  int Count() {
    std::lock_guard<std::mutex> lock(mu_);
    return count_;
  }

  std::mutex mu_;
  int count_ = 0;
  std::array<std::atomic<Cache*>, kMaxCacheDevices> caches_{};
  std::atomic<int64_t> serial_{1};
};

}  // namespace sntf

#endif  // SNTF_TF_OPS_CACHE_CORE_H_
