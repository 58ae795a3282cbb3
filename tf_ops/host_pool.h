// BFC-style (best-fit with coalescing) host memory pool.
//
// Why a pool: host tensors are allocated and freed at a high rate; carving
// them out of a few large mmap'ed regions keeps allocation cheap, makes the
// memory footprint observable (GetStats) and lets us enforce a hard limit
// with an error message that says *why* an allocation failed instead of
// letting the process get OOM-killed.
//
// Plain C++17 + POSIX on purpose: no TensorFlow headers, so the pool can be
// unit-tested through a tiny C API (host_pool_capi.cc) without building TF ops.
#ifndef SNTF_TF_OPS_HOST_POOL_H_
#define SNTF_TF_OPS_HOST_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

namespace sntf {

// Page-locks host memory for fast, asynchronous device copies (on a GPU:
// cudaHostRegister / cudaHostUnregister). pin returns 0 on success.
struct PinHooks {
  int (*pin)(void* base, uint64_t bytes) = nullptr;
  void (*unpin)(void* base) = nullptr;
};

struct HostPoolStats {
  uint64_t bytes_in_use = 0;
  uint64_t peak_bytes_in_use = 0;
  uint64_t bytes_reserved = 0;  // mapped from the OS, across all regions
  uint64_t peak_bytes_reserved = 0;
  uint64_t limit_bytes = 0;
  uint64_t num_allocs = 0;  // successful allocations ever
  uint64_t num_frees = 0;
  uint64_t active_allocs = 0;
  uint64_t num_failed_allocs = 0;
  uint64_t largest_free_block = 0;
  uint64_t free_bytes = 0;  // bytes_reserved - bytes_in_use
  uint64_t num_regions = 0;
  uint64_t pinned_regions = 0;  // regions the pin hook accepted
  uint64_t pinned_bytes = 0;
  uint64_t pin_failures = 0;    // regions the pin hook refused (left pageable)
  // 1 - largest_free_block / free_bytes; 0 when free_bytes == 0.
  double fragmentation = 0.0;
};

class HostPool {
 public:
  static constexpr uint64_t kAlignment = 256;
  static constexpr uint64_t kMinChunk = 256;

  // limit_bytes caps the total bytes reserved from the OS (all regions).
  explicit HostPool(uint64_t limit_bytes,
                    uint64_t initial_region_bytes = uint64_t{64} << 20);
  // Unmaps every region: pointers still outstanding become invalid.
  ~HostPool();

  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // Returns a kAlignment-aligned block of at least `bytes` bytes (bytes == 0
  // yields a distinct kMinChunk block), or nullptr with *error (if non-null)
  // describing the request, the limit and the pool state. Never throws.
  void* Allocate(uint64_t bytes, std::string* error);
  // False (and no effect) for pointers not returned by Allocate or already
  // freed.
  bool Deallocate(void* ptr);
  // Rounded size of a live block; 0 if ptr is not the start of a live block.
  uint64_t AllocatedSize(const void* ptr) const;
  // A limit below the current reservation only blocks further growth.
  void SetLimit(uint64_t limit_bytes);
  // Unmaps every region that is entirely free; returns the bytes released.
  size_t Trim();
  HostPoolStats GetStats() const;
  // Peaks restart from the current values.
  void ResetPeak();
  // Pins every region, present and future, with `hooks`, and unpins each
  // before it is unmapped. A region the hook refuses stays pageable (and is
  // counted in pin_failures): allocations never fail for want of pinning.
  void SetPinHooks(PinHooks hooks);

 private:
  struct Chunk {
    uint64_t size;
    uintptr_t region;  // base address of the owning region
    bool in_use;
  };
  // Keyed by address, so neighbours in a region are adjacent map entries.
  using ChunkMap = std::map<uintptr_t, Chunk>;
  // (size, address): begin-most entry >= (n, 0) is the best fit, ties going
  // to the lowest address.
  using FreeIndex = std::set<std::pair<uint64_t, uintptr_t>>;

  // *failure / the int result: 0 when served, else a reason code (see .cc).
  void* AllocateLocked(uint64_t rounded, int* failure);
  ChunkMap::iterator FindBestFit(uint64_t rounded);
  int GrowLocked(uint64_t rounded);
  uint64_t NextRegionSize(uint64_t rounded) const;
  void TakeChunk(ChunkMap::iterator it, uint64_t rounded);
  void ReleaseChunk(ChunkMap::iterator it);
  ChunkMap::iterator FreeNeighbour(ChunkMap::iterator it, bool next);
  std::string FailureMessage(int failure, uint64_t bytes,
                             uint64_t rounded) const;
  uint64_t LargestFreeLocked() const;
  void NoteUsage();
  void PinLocked(uintptr_t base, uint64_t bytes);
  void UnmapLocked(uintptr_t base, uint64_t bytes);

  mutable std::mutex mu_;
  uint64_t limit_bytes_;
  uint64_t initial_region_bytes_;
  uint64_t last_region_bytes_ = 0;  // growth doubles from here
  std::map<uintptr_t, uint64_t> regions_;  // base -> size
  ChunkMap chunks_;
  FreeIndex free_;
  HostPoolStats stats_;  // counters only; derived fields filled by GetStats
  PinHooks hooks_;
  std::set<uintptr_t> pinned_;  // region bases the pin hook accepted
};

// Process-wide pool, created on first use and never destroyed so that
// tensors released during process exit still have a live pool. Its limit is
// the machine's physical memory unless SNTF_HOST_POOL_LIMIT (bytes) is set.
HostPool& GlobalHostPool();

}  // namespace sntf

#endif  // SNTF_TF_OPS_HOST_POOL_H_
