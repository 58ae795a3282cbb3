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
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace sntf {

// Page-locks host memory for fast, asynchronous device copies (on a GPU:
// StreamExecutor::HostMemoryRegister / HostMemoryUnregister, or the CUDA
// runtime's cudaHostRegister / cudaHostUnregister). pin returns 0 on success.
// The pool never calls them while holding its mutex: registering commits and
// locks every page of a region, which takes long for large regions.
struct PinHooks {
  std::function<int(void* base, uint64_t bytes)> pin;
  std::function<void(void* base)> unpin;
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
  uint64_t pin_limit_bytes = 0;  // cap on pinned_bytes
  uint64_t pin_over_limit = 0;   // regions left pageable because of the cap
  // 1 - largest_free_block / free_bytes; 0 when free_bytes == 0.
  double fragmentation = 0.0;
};

class HostPool {
 public:
  static constexpr uint64_t kAlignment = 256;
  static constexpr uint64_t kMinChunk = 256;

  // limit_bytes caps the total bytes reserved from the OS (all regions);
  // pin_limit_bytes caps the bytes of regions the pin hook may lock.
  explicit HostPool(uint64_t limit_bytes,
                    uint64_t initial_region_bytes = uint64_t{64} << 20,
                    uint64_t pin_limit_bytes = DefaultPinLimit());
  // Unmaps every region: pointers still outstanding become invalid.
  ~HostPool();

  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // Returns a kAlignment-aligned block of at least `bytes` bytes (bytes == 0
  // yields a distinct kMinChunk block), or nullptr with *error (if non-null)
  // describing the request, the limit and the pool state. *pinned (if
  // non-null) tells whether the block lies in a page-locked region; a region
  // is never unpinned while a block of it is live, so the answer stays true
  // for the block's lifetime. Never throws.
  void* Allocate(uint64_t bytes, std::string* error, bool* pinned = nullptr);
  // False (and no effect) for pointers not returned by Allocate or already
  // freed.
  bool Deallocate(void* ptr);
  // Rounded size of a live block; 0 if ptr is not the start of a live block.
  uint64_t AllocatedSize(const void* ptr) const;
  // Whether the live block at ptr lies in a page-locked region.
  bool BlockPinned(const void* ptr) const;
  // A limit below the current reservation only blocks further growth.
  void SetLimit(uint64_t limit_bytes);
  // Regions are pinned only while the pinned bytes stay within this cap;
  // lowering it unpins nothing, it only keeps further regions pageable.
  void SetPinLimit(uint64_t pin_limit_bytes);
  // Unmaps every region that is entirely free; returns the bytes released.
  size_t Trim();
  HostPoolStats GetStats() const;
  // Peaks restart from the current values.
  void ResetPeak();
  // Pins every region, present and future, with `hooks` while the pinned
  // bytes stay within the pin limit, and unpins each region, with the hooks
  // that pinned it, before it is unmapped. A region the hook refuses stays
  // pageable (counted in pin_failures), so does one beyond the cap (counted
  // in pin_over_limit): allocations never fail for want of pinning. Empty
  // hooks stop pinning new regions. The hooks run outside the pool's mutex.
  void SetPinHooks(PinHooks hooks);

  // Default pin cap: min(64 GiB, physical memory / 4). 64 GiB is the default
  // of TensorFlow's own pinned host allocator (TF_GPU_HOST_MEM_LIMIT_IN_MB in
  // GPUProcessState::GetGpuHostAllocator); a quarter of RAM keeps sntf's
  // locked pages, added to TensorFlow's own, well clear of the machine's
  // memory on hosts where 64 GiB is most of it.
  static uint64_t DefaultPinLimit();

 private:
  struct Chunk {
    uint64_t size;
    uintptr_t region;  // base address of the owning region
    bool in_use;
  };
  struct Region {
    uint64_t size = 0;
    bool pinned = false;
    bool pinning = false;  // a hook runs on it outside the lock: keep mapped
    std::shared_ptr<const PinHooks> pinned_by;  // unpins it
  };
  // A region being mapped (and maybe pinned) outside the lock. Its bytes are
  // reserved against the limits while that happens.
  struct Growth {
    uint64_t rounded = 0;
    uint64_t size = 0;      // what is mapped (may shrink to `rounded`)
    uint64_t reserved = 0;  // what the plan reserved against the limits
    std::shared_ptr<const PinHooks> pin_with;  // null: stays pageable
    uintptr_t base = 0;
    bool pinned = false;
    int error = 0;  // errno of a failed mmap
  };
  // A region taken out of the pool, to unpin and unmap outside the lock.
  struct Released {
    uintptr_t base;
    uint64_t size;
    std::shared_ptr<const PinHooks> pinned_by;
  };
  // Keyed by address, so neighbours in a region are adjacent map entries.
  using ChunkMap = std::map<uintptr_t, Chunk>;
  // (size, address): begin-most entry >= (n, 0) is the best fit, ties going
  // to the lowest address.
  using FreeIndex = std::set<std::pair<uint64_t, uintptr_t>>;

  // Each returns a block or nullptr with *failure set (0: served, else a
  // reason code, see .cc). The lock is held by the caller.
  void* TakeFitLocked(uint64_t rounded, bool* pinned);
  int PlanGrowthLocked(uint64_t rounded, Growth* growth);
  void* FinishGrowthLocked(Growth* growth, int* failure, bool* pinned);
  void ReleaseReservationLocked(const Growth& growth);
  // Outside the lock.
  static void MapAndPin(Growth* growth);
  static void UnpinAndUnmap(const Released& region);

  ChunkMap::iterator FindBestFit(uint64_t rounded);
  uint64_t NextRegionSize(uint64_t rounded) const;
  bool PinFitsLocked(uint64_t bytes) const;
  void TakeChunk(ChunkMap::iterator it, uint64_t rounded);
  void ReleaseChunk(ChunkMap::iterator it);
  ChunkMap::iterator FreeNeighbour(ChunkMap::iterator it, bool next);
  std::string FailureMessage(int failure, uint64_t bytes,
                             uint64_t rounded) const;
  void* Fail(int failure, uint64_t bytes, uint64_t rounded,
             std::string* error);
  uint64_t LargestFreeLocked() const;
  void NoteUsage();
  std::vector<uintptr_t> ClaimUnpinnedLocked(
      const std::shared_ptr<const PinHooks>& hooks);

  mutable std::mutex mu_;
  uint64_t limit_bytes_;
  uint64_t initial_region_bytes_;
  uint64_t pin_limit_bytes_;
  uint64_t last_region_bytes_ = 0;  // growth doubles from here
  uint64_t pending_bytes_ = 0;      // regions being mapped outside the lock
  uint64_t pending_pin_bytes_ = 0;  // regions being pinned outside the lock
  std::map<uintptr_t, Region> regions_;  // by base address
  ChunkMap chunks_;
  FreeIndex free_;
  HostPoolStats stats_;  // counters only; derived fields filled by GetStats
  std::shared_ptr<const PinHooks> hooks_;  // null: no pinning
};

// Process-wide pool, created on first use and never destroyed so that
// tensors released during process exit still have a live pool. Its limit is
// the machine's physical memory unless SNTF_HOST_POOL_LIMIT (bytes) is set;
// its pin cap is HostPool::DefaultPinLimit() unless SNTF_HOST_PIN_LIMIT
// (bytes) is set.
HostPool& GlobalHostPool();

}  // namespace sntf

#endif  // SNTF_TF_OPS_HOST_POOL_H_
