// BFC-style host memory pool; see host_pool.h for the contract.
#include "host_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>

namespace sntf {
namespace {

constexpr uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();

// Why an allocation failed; positive values are errno from mmap.
constexpr int kServed = 0;
constexpr int kOverLimit = -1;
constexpr int kTooLarge = -2;
constexpr int kNoBookkeepingMemory = -3;

// 0 signals that rounding would overflow 64 bits. A zero-byte request still
// gets a real chunk so every successful call yields a distinct pointer.
uint64_t RoundRequest(uint64_t bytes) {
  if (bytes == 0) return HostPool::kMinChunk;
  if (bytes > kMaxU64 - (HostPool::kAlignment - 1)) return 0;
  return (bytes + HostPool::kAlignment - 1) / HostPool::kAlignment *
         HostPool::kAlignment;
}

uint64_t RoundDown(uint64_t bytes) {
  return bytes / HostPool::kAlignment * HostPool::kAlignment;
}

uint64_t SaturatingDouble(uint64_t bytes) {
  return bytes > kMaxU64 / 2 ? kMaxU64 : bytes * 2;
}

// MAP_ANONYMOUS pages are committed on first touch, so an unused tail of a
// large region costs address space only, not RSS.
void* MapRegion(uint64_t bytes) {
  if (bytes > std::numeric_limits<size_t>::max()) {
    errno = ENOMEM;
    return nullptr;
  }
  void* base = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return base == MAP_FAILED ? nullptr : base;
}

void UnmapRegion(uintptr_t base, uint64_t bytes) {
  munmap(reinterpret_cast<void*>(base), static_cast<size_t>(bytes));
}

std::string FailurePrefix(int failure) {
  switch (failure) {
    case kOverLimit:
      return "sntf host pool exhausted: ";
    case kTooLarge:
      return "sntf host pool cannot serve a request this large: ";
    case kNoBookkeepingMemory:
      return "sntf host pool ran out of memory for its bookkeeping: ";
    default:
      return std::string("sntf host pool could not grow, mmap failed (") +
             std::strerror(failure) + "): ";
  }
}

}  // namespace

HostPool::HostPool(uint64_t limit_bytes, uint64_t initial_region_bytes,
                   uint64_t pin_limit_bytes)
    : limit_bytes_(limit_bytes),
      // Regions must be multiples of kAlignment so every chunk boundary is
      // aligned; a request that cannot round up rounds down instead.
      initial_region_bytes_(
          std::max(kMinChunk, RoundRequest(initial_region_bytes) != 0
                                  ? RoundRequest(initial_region_bytes)
                                  : RoundDown(initial_region_bytes))),
      pin_limit_bytes_(pin_limit_bytes) {}

HostPool::~HostPool() {
  for (const auto& region : regions_) {
    UnpinAndUnmap({region.first, region.second.size,
                   region.second.pinned ? region.second.pinned_by : nullptr});
  }
}

void HostPool::UnpinAndUnmap(const Released& region) {
  if (region.pinned_by != nullptr && region.pinned_by->unpin) {
    region.pinned_by->unpin(reinterpret_cast<void*>(region.base));
  }
  UnmapRegion(region.base, region.size);
}

bool HostPool::PinFitsLocked(uint64_t bytes) const {
  const uint64_t committed = stats_.pinned_bytes + pending_pin_bytes_;
  return committed <= pin_limit_bytes_ && bytes <= pin_limit_bytes_ - committed;
}

// Marks the regions the new hooks should pin (within the cap) as being
// pinned, so that Trim leaves them mapped while the hooks run unlocked.
std::vector<uintptr_t> HostPool::ClaimUnpinnedLocked(
    const std::shared_ptr<const PinHooks>& hooks) {
  std::vector<uintptr_t> claimed;
  if (hooks == nullptr || !hooks->pin) return claimed;
  for (auto& entry : regions_) {
    Region& region = entry.second;
    if (region.pinned || region.pinning) continue;
    if (!PinFitsLocked(region.size)) {
      ++stats_.pin_over_limit;
      continue;
    }
    claimed.push_back(entry.first);
    region.pinning = true;
    pending_pin_bytes_ += region.size;
  }
  return claimed;
}

void HostPool::SetPinHooks(PinHooks hooks) {
  std::shared_ptr<const PinHooks> shared;
  if (hooks.pin) shared = std::make_shared<const PinHooks>(std::move(hooks));
  std::vector<uintptr_t> claimed;
  std::vector<uint64_t> sizes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hooks_ = shared;
    claimed = ClaimUnpinnedLocked(shared);
    for (uintptr_t base : claimed) sizes.push_back(regions_.at(base).size);
  }
  // Registration commits and locks every page: never under the mutex, so
  // allocations from other regions go on meanwhile.
  std::vector<int> results;
  for (size_t i = 0; i < claimed.size(); ++i) {
    results.push_back(shared->pin(reinterpret_cast<void*>(claimed[i]), sizes[i]));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < claimed.size(); ++i) {
    Region& region = regions_.at(claimed[i]);
    region.pinning = false;
    pending_pin_bytes_ -= region.size;
    if (results[i] != 0) {
      ++stats_.pin_failures;
      continue;
    }
    region.pinned = true;
    region.pinned_by = shared;
    ++stats_.pinned_regions;
    stats_.pinned_bytes += region.size;
  }
}

void* HostPool::Fail(int failure, uint64_t bytes, uint64_t rounded,
                     std::string* error) {
  ++stats_.num_failed_allocs;
  if (error != nullptr) {
    try {
      *error = FailureMessage(failure, bytes, rounded);
    } catch (...) {  // no memory even for the message; the nullptr says enough
    }
  }
  return nullptr;
}

void* HostPool::Allocate(uint64_t bytes, std::string* error, bool* pinned) {
  bool block_pinned = false;
  if (pinned == nullptr) pinned = &block_pinned;
  *pinned = false;
  const uint64_t rounded = RoundRequest(bytes);
  Growth growth;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (rounded == 0) return Fail(kTooLarge, bytes, rounded, error);
    void* ptr = nullptr;
    try {
      ptr = TakeFitLocked(rounded, pinned);
    } catch (...) {  // std::bad_alloc from map/set nodes; state is unchanged
      return Fail(kNoBookkeepingMemory, bytes, rounded, error);
    }
    if (ptr != nullptr) return ptr;
    const int failure = PlanGrowthLocked(rounded, &growth);
    if (failure != kServed) return Fail(failure, bytes, rounded, error);
  }
  // mmap and page-locking a region are the slow steps: outside the mutex.
  MapAndPin(&growth);
  std::lock_guard<std::mutex> lock(mu_);
  int failure = kServed;
  void* ptr = FinishGrowthLocked(&growth, &failure, pinned);
  if (ptr == nullptr) return Fail(failure, bytes, rounded, error);
  return ptr;
}

void* HostPool::TakeFitLocked(uint64_t rounded, bool* pinned) {
  auto it = FindBestFit(rounded);
  if (it == chunks_.end()) return nullptr;
  TakeChunk(it, rounded);
  *pinned = regions_.at(it->second.region).pinned;
  ++stats_.num_allocs;
  ++stats_.active_allocs;
  stats_.bytes_in_use += rounded;
  NoteUsage();
  return reinterpret_cast<void*>(it->first);
}

// Reserves the next region's bytes (and, within the cap, its pinning)
// against the limits, so that concurrent growers never overshoot them.
int HostPool::PlanGrowthLocked(uint64_t rounded, Growth* growth) {
  const uint64_t size = NextRegionSize(rounded);
  if (size < rounded) return kOverLimit;
  growth->rounded = rounded;
  growth->size = size;
  growth->reserved = size;
  pending_bytes_ += size;
  last_region_bytes_ = std::max(last_region_bytes_, size);
  if (hooks_ != nullptr) {
    if (PinFitsLocked(size)) {
      growth->pin_with = hooks_;
      pending_pin_bytes_ += size;
    } else {
      ++stats_.pin_over_limit;
    }
  }
  return kServed;
}

void HostPool::MapAndPin(Growth* growth) {
  errno = 0;
  void* base = MapRegion(growth->size);
  if (base == nullptr && growth->size > growth->rounded) {
    // The growth policy asked for more than the request needs; the request
    // itself may still fit in what the OS can give.
    growth->size = growth->rounded;
    errno = 0;
    base = MapRegion(growth->size);
  }
  if (base == nullptr) {
    growth->error = errno != 0 ? errno : ENOMEM;
    return;
  }
  growth->base = reinterpret_cast<uintptr_t>(base);
  if (growth->pin_with != nullptr) {
    growth->pinned = growth->pin_with->pin(base, growth->size) == 0;
  }
}

void HostPool::ReleaseReservationLocked(const Growth& growth) {
  // MapAndPin may have shrunk growth.size since the plan: release what the
  // plan reserved.
  pending_bytes_ -= growth.reserved;
  if (growth.pin_with != nullptr) pending_pin_bytes_ -= growth.reserved;
}

void* HostPool::FinishGrowthLocked(Growth* growth, int* failure,
                                   bool* pinned) {
  if (growth->base == 0) {
    *failure = growth->error;
    ReleaseReservationLocked(*growth);
    return nullptr;
  }
  const uintptr_t addr = growth->base;
  try {
    Region region;
    region.size = growth->size;
    region.pinned = growth->pinned;
    if (growth->pinned) region.pinned_by = growth->pin_with;
    regions_.emplace(addr, region);
    chunks_.emplace(addr, Chunk{growth->size, addr, false});
    free_.emplace(growth->size, addr);
  } catch (...) {
    free_.erase({growth->size, addr});
    chunks_.erase(addr);
    regions_.erase(addr);
    ReleaseReservationLocked(*growth);
    UnpinAndUnmap({addr, growth->size,
                   growth->pinned ? growth->pin_with : nullptr});
    *failure = kNoBookkeepingMemory;
    return nullptr;
  }
  ReleaseReservationLocked(*growth);
  stats_.bytes_reserved += growth->size;
  if (growth->pin_with != nullptr) {
    if (growth->pinned) {
      ++stats_.pinned_regions;
      stats_.pinned_bytes += growth->size;
    } else {
      ++stats_.pin_failures;
    }
  }
  // The new region is one free chunk nobody else could take yet: the lock
  // has been held since it was indexed.
  void* ptr = nullptr;
  try {
    ptr = TakeFitLocked(growth->rounded, pinned);
  } catch (...) {  // std::bad_alloc splitting the chunk; the region stays
  }
  *failure = ptr == nullptr ? kNoBookkeepingMemory : kServed;
  return ptr;
}

HostPool::ChunkMap::iterator HostPool::FindBestFit(uint64_t rounded) {
  const auto fit = free_.lower_bound({rounded, 0});
  return fit == free_.end() ? chunks_.end() : chunks_.find(fit->second);
}

// Geometric growth keeps the number of regions (and mmap calls) logarithmic
// in the peak footprint; the limit always wins over the policy.
uint64_t HostPool::NextRegionSize(uint64_t rounded) const {
  const uint64_t reserved = stats_.bytes_reserved + pending_bytes_;
  const uint64_t headroom =
      RoundDown(limit_bytes_ > reserved ? limit_bytes_ - reserved : 0);
  const uint64_t wanted = std::max(
      {rounded, initial_region_bytes_, SaturatingDouble(last_region_bytes_)});
  return std::min(wanted, headroom);
}

void HostPool::TakeChunk(ChunkMap::iterator it, uint64_t rounded) {
  Chunk& chunk = it->second;
  const uint64_t remainder = chunk.size - rounded;
  if (remainder >= kMinChunk) {
    const uintptr_t rest = it->first + rounded;
    // The only allocating step goes first, so a throw leaves nothing changed.
    chunks_.emplace_hint(std::next(it), rest,
                         Chunk{remainder, chunk.region, false});
    // Reuse the taken chunk's index node for the remainder: no allocation.
    auto node = free_.extract({chunk.size, it->first});
    node.value() = {remainder, rest};
    free_.insert(std::move(node));
  } else {
    free_.erase({chunk.size, it->first});
  }
  chunk.size = rounded;
  chunk.in_use = true;
}

bool HostPool::BlockPinned(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = chunks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == chunks_.end() || !it->second.in_use) return false;
  return regions_.at(it->second.region).pinned;
}

bool HostPool::Deallocate(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = chunks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == chunks_.end() || !it->second.in_use) return false;
  const uint64_t size = it->second.size;
  try {
    ReleaseChunk(it);
  } catch (...) {  // std::bad_alloc indexing the chunk; it stays allocated
    return false;
  }
  ++stats_.num_frees;
  --stats_.active_allocs;
  stats_.bytes_in_use -= size;
  return true;
}

void HostPool::ReleaseChunk(ChunkMap::iterator it) {
  const auto next = FreeNeighbour(it, /*next=*/true);
  const auto prev = FreeNeighbour(it, /*next=*/false);
  // A merged neighbour donates its index node, so freeing next to a free
  // chunk never allocates.
  FreeIndex::node_type node;
  if (next != chunks_.end()) {
    node = free_.extract({next->second.size, next->first});
  }
  if (prev != chunks_.end()) {
    auto prev_node = free_.extract({prev->second.size, prev->first});
    if (node.empty()) node = std::move(prev_node);
  }
  if (node.empty()) {
    free_.emplace(it->second.size, it->first);  // may throw: nothing changed
    it->second.in_use = false;
    return;
  }
  it->second.in_use = false;
  auto merged = it;
  if (next != chunks_.end()) {
    merged->second.size += next->second.size;
    chunks_.erase(next);
  }
  if (prev != chunks_.end()) {
    prev->second.size += merged->second.size;
    chunks_.erase(merged);
    merged = prev;
  }
  node.value() = {merged->second.size, merged->first};
  free_.insert(std::move(node));
}

// Regions are separate mmaps that may happen to be adjacent in the address
// space; merging across them would make Trim's munmap wrong, hence the
// region check.
HostPool::ChunkMap::iterator HostPool::FreeNeighbour(ChunkMap::iterator it,
                                                     bool next) {
  if (!next && it == chunks_.begin()) return chunks_.end();
  const auto n = next ? std::next(it) : std::prev(it);
  if (n == chunks_.end() || n->second.region != it->second.region ||
      n->second.in_use) {
    return chunks_.end();
  }
  return n;
}

uint64_t HostPool::AllocatedSize(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = chunks_.find(reinterpret_cast<uintptr_t>(ptr));
  return it != chunks_.end() && it->second.in_use ? it->second.size : 0;
}

void HostPool::SetLimit(uint64_t limit_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  limit_bytes_ = limit_bytes;
}

void HostPool::SetPinLimit(uint64_t pin_limit_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  pin_limit_bytes_ = pin_limit_bytes;
}

size_t HostPool::Trim() {
  std::vector<Released> released;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto region = regions_.begin(); region != regions_.end();) {
      // Coalescing guarantees a fully free region is exactly one free chunk.
      const auto chunk = chunks_.find(region->first);
      if (region->second.pinning || chunk->second.in_use ||
          chunk->second.size != region->second.size) {
        ++region;
        continue;
      }
      released.reserve(regions_.size());  // may throw: nothing changed yet
      free_.erase({chunk->second.size, chunk->first});
      chunks_.erase(chunk);
      const Region& r = region->second;
      if (r.pinned) {
        --stats_.pinned_regions;
        stats_.pinned_bytes -= r.size;
      }
      released.push_back(
          {region->first, r.size, r.pinned ? r.pinned_by : nullptr});
      stats_.bytes_reserved -= r.size;
      bytes += r.size;
      region = regions_.erase(region);
    }
    // A fully trimmed pool starts small again instead of doubling forever.
    if (regions_.empty() && pending_bytes_ == 0) last_region_bytes_ = 0;
  }
  // Unregistering and unmapping are system calls: outside the mutex. The
  // regions are out of every index, so nobody can allocate from them.
  for (const Released& region : released) UnpinAndUnmap(region);
  return bytes;
}

HostPoolStats HostPool::GetStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  HostPoolStats stats = stats_;
  stats.limit_bytes = limit_bytes_;
  stats.pin_limit_bytes = pin_limit_bytes_;
  stats.largest_free_block = LargestFreeLocked();
  stats.free_bytes = stats.bytes_reserved - stats.bytes_in_use;
  stats.num_regions = regions_.size();
  stats.fragmentation =
      stats.free_bytes == 0
          ? 0.0
          : 1.0 - static_cast<double>(stats.largest_free_block) /
                      static_cast<double>(stats.free_bytes);
  return stats;
}

void HostPool::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes_in_use = stats_.bytes_in_use;
  stats_.peak_bytes_reserved = stats_.bytes_reserved;
}

uint64_t HostPool::LargestFreeLocked() const {
  return free_.empty() ? 0 : free_.rbegin()->first;
}

void HostPool::NoteUsage() {
  stats_.peak_bytes_in_use =
      std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  stats_.peak_bytes_reserved =
      std::max(stats_.peak_bytes_reserved, stats_.bytes_reserved);
}

std::string HostPool::FailureMessage(int failure, uint64_t bytes,
                                     uint64_t rounded) const {
  const std::string rounded_text =
      rounded == 0 ? "overflows 64 bits" : std::to_string(rounded);
  return FailurePrefix(failure) + "requested " + std::to_string(bytes) +
         " bytes (rounded " + rounded_text + "), pool limit " +
         std::to_string(limit_bytes_) + " bytes, reserved " +
         std::to_string(stats_.bytes_reserved) + ", in use " +
         std::to_string(stats_.bytes_in_use) + ", largest free block " +
         std::to_string(LargestFreeLocked());
}

namespace {

// Unknown physical memory means no meaningful cap, not a made-up one.
uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return kMaxU64;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
}

// Strict on purpose: strtoull would accept "-1" (wrapping to 2^64-1),
// "1e9" as 1 and "4GiB" as 4, all silently wrong limits.
bool ParseByteCount(const char* text, uint64_t* out) {
  if (*text == '\0') return false;
  uint64_t value = 0;
  for (const char* p = text; *p != '\0'; ++p) {
    if (*p < '0' || *p > '9') return false;
    const uint64_t digit = static_cast<uint64_t>(*p - '0');
    if (value > (kMaxU64 - digit) / 10) return false;
    value = value * 10 + digit;
  }
  *out = value;
  return true;
}

// A byte count from the environment variable `name`, or `fallback` (named
// `fallback_name` in the warning) when it is unset or malformed.
uint64_t ByteCountFromEnv(const char* name, uint64_t fallback,
                          const char* fallback_name) {
  const char* env = std::getenv(name);
  // An empty value is how shells spell "unset" for one command.
  if (env == nullptr || *env == '\0') return fallback;
  uint64_t value = 0;
  if (ParseByteCount(env, &value)) return value;
  std::fprintf(stderr,
               "sntf: ignoring malformed %s=\"%s\" (expected a plain integer "
               "byte count); using %s, %llu bytes\n",
               name, env, fallback_name,
               static_cast<unsigned long long>(fallback));
  return fallback;
}

}  // namespace

uint64_t HostPool::DefaultPinLimit() {
  constexpr uint64_t kTensorFlowDefault = uint64_t{64} << 30;
  const uint64_t physical = PhysicalMemoryBytes();
  const uint64_t quarter = physical == kMaxU64 ? kMaxU64 : physical / 4;
  return std::min(kTensorFlowDefault, quarter);
}

HostPool& GlobalHostPool() {
  // Leaked on purpose: static destructors run before some tensors are freed
  // at exit, and those frees must still find a live pool.
  static HostPool* const pool = new HostPool(
      ByteCountFromEnv("SNTF_HOST_POOL_LIMIT", PhysicalMemoryBytes(),
                       "the physical memory size"),
      uint64_t{64} << 20,
      ByteCountFromEnv("SNTF_HOST_PIN_LIMIT", HostPool::DefaultPinLimit(),
                       "the default pin limit"));
  return *pool;
}

}  // namespace sntf
