// C API over sntf::HostPool so Python (ctypes) can drive and inspect pools
// without TensorFlow. Every entry point tolerates a null pool and catches
// everything: an exception unwinding into ctypes would abort the process.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "host_pool.h"

namespace {

sntf::HostPool* AsPool(void* pool) {
  return static_cast<sntf::HostPool*>(pool);
}

void CopyMessage(const std::string& message, char* out, uint64_t out_len) {
  if (out == nullptr || out_len == 0) return;
  const size_t n = static_cast<size_t>(
      std::min<uint64_t>(message.size(), out_len - 1));
  std::memcpy(out, message.data(), n);
  out[n] = '\0';
}

}  // namespace

// Explicit so the symbols stay visible to ctypes even if the op library is
// built with -fvisibility=hidden.
#define SNTF_POOL_API __attribute__((visibility("default")))

extern "C" {

// A pool with no pin cap (set one with sntf_pool_set_pin_limit); the global
// pool's cap is HostPool::DefaultPinLimit().
SNTF_POOL_API void* sntf_pool_new(uint64_t limit_bytes,
                                  uint64_t initial_region_bytes) {
  try {
    return new sntf::HostPool(limit_bytes, initial_region_bytes,
                              ~uint64_t{0});
  } catch (...) {
    return nullptr;
  }
}

SNTF_POOL_API void sntf_pool_delete(void* pool) {
  if (pool == nullptr) return;
  try {
    // The global pool must outlive every tensor; deleting it is never right.
    if (pool == &sntf::GlobalHostPool()) return;
  } catch (...) {
    return;
  }
  delete AsPool(pool);
}

SNTF_POOL_API void* sntf_pool_global(void) {
  try {
    return &sntf::GlobalHostPool();
  } catch (...) {
    return nullptr;
  }
}

SNTF_POOL_API void* sntf_pool_alloc(void* pool, uint64_t bytes, char* err,
                                    uint64_t err_len) {
  CopyMessage("", err, err_len);
  if (pool == nullptr) {
    CopyMessage("sntf host pool: null pool handle", err, err_len);
    return nullptr;
  }
  try {
    std::string message;
    void* ptr =
        AsPool(pool)->Allocate(bytes, err != nullptr ? &message : nullptr);
    if (ptr == nullptr) CopyMessage(message, err, err_len);
    return ptr;
  } catch (...) {
    return nullptr;
  }
}

SNTF_POOL_API int sntf_pool_free(void* pool, void* ptr) {
  if (pool == nullptr) return 0;
  try {
    return AsPool(pool)->Deallocate(ptr) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

SNTF_POOL_API uint64_t sntf_pool_allocated_size(void* pool, void* ptr) {
  if (pool == nullptr) return 0;
  try {
    return AsPool(pool)->AllocatedSize(ptr);
  } catch (...) {
    return 0;
  }
}

SNTF_POOL_API void sntf_pool_set_limit(void* pool, uint64_t limit_bytes) {
  if (pool == nullptr) return;
  try {
    AsPool(pool)->SetLimit(limit_bytes);
  } catch (...) {
  }
}

SNTF_POOL_API uint64_t sntf_pool_trim(void* pool) {
  if (pool == nullptr) return 0;
  try {
    return AsPool(pool)->Trim();
  } catch (...) {
    return 0;
  }
}

SNTF_POOL_API void sntf_pool_set_pin_limit(void* pool,
                                           uint64_t pin_limit_bytes) {
  if (pool == nullptr) return;
  try {
    AsPool(pool)->SetPinLimit(pin_limit_bytes);
  } catch (...) {
  }
}

// 1 when the live block at ptr lies in a page-locked region, else 0.
SNTF_POOL_API int sntf_pool_block_pinned(void* pool, void* ptr) {
  if (pool == nullptr) return 0;
  try {
    return AsPool(pool)->BlockPinned(ptr) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

SNTF_POOL_API void sntf_pool_reset_peak(void* pool) {
  if (pool == nullptr) return;
  try {
    AsPool(pool)->ResetPeak();
  } catch (...) {
  }
}

SNTF_POOL_API int sntf_pool_stats(void* pool, uint64_t* out, int n) {
  if (pool == nullptr || out == nullptr || n <= 0) return 0;
  try {
    const sntf::HostPoolStats s = AsPool(pool)->GetStats();
    // Order is part of the ABI: Python indexes these positionally.
    const uint64_t values[] = {
        s.bytes_in_use,       s.peak_bytes_in_use, s.bytes_reserved,
        s.peak_bytes_reserved, s.limit_bytes,      s.num_allocs,
        s.num_frees,          s.active_allocs,     s.num_failed_allocs,
        s.largest_free_block, s.free_bytes,        s.num_regions,
        s.pinned_regions,     s.pinned_bytes,      s.pin_failures,
        s.pin_limit_bytes,    s.pin_over_limit,
    };
    const int count = static_cast<int>(sizeof(values) / sizeof(values[0]));
    const int written = n < count ? n : count;
    for (int i = 0; i < written; ++i) out[i] = values[i];
    return written;
  } catch (...) {
    return 0;
  }
}

// Installs page-locking hooks (see sntf::PinHooks); a null pin stops
// pinning new regions (those pinned stay so until trimmed).
SNTF_POOL_API void sntf_pool_set_pin_hooks(void* pool,
                                           int (*pin)(void*, uint64_t),
                                           void (*unpin)(void*)) {
  if (pool == nullptr) return;
  try {
    sntf::PinHooks hooks;
    if (pin != nullptr) hooks.pin = pin;
    if (unpin != nullptr) hooks.unpin = unpin;
    AsPool(pool)->SetPinHooks(std::move(hooks));
  } catch (...) {
  }
}

SNTF_POOL_API double sntf_pool_fragmentation(void* pool) {
  if (pool == nullptr) return 0.0;
  try {
    return AsPool(pool)->GetStats().fragmentation;
  } catch (...) {
    return 0.0;
  }
}

}  // extern "C"
