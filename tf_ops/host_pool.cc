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

HostPool::HostPool(uint64_t limit_bytes, uint64_t initial_region_bytes)
    : limit_bytes_(limit_bytes),
      // Regions must be multiples of kAlignment so every chunk boundary is
      // aligned; a request that cannot round up rounds down instead.
      initial_region_bytes_(
          std::max(kMinChunk, RoundRequest(initial_region_bytes) != 0
                                  ? RoundRequest(initial_region_bytes)
                                  : RoundDown(initial_region_bytes))) {}

HostPool::~HostPool() {
  for (const auto& region : regions_) UnmapLocked(region.first, region.second);
}

void HostPool::PinLocked(uintptr_t base, uint64_t bytes) {
  if (hooks_.pin == nullptr || pinned_.count(base) != 0) return;
  if (hooks_.pin(reinterpret_cast<void*>(base), bytes) == 0) {
    pinned_.insert(base);
    stats_.pinned_regions += 1;
    stats_.pinned_bytes += bytes;
  } else {
    stats_.pin_failures += 1;
  }
}

void HostPool::UnmapLocked(uintptr_t base, uint64_t bytes) {
  if (pinned_.erase(base) != 0) {
    if (hooks_.unpin != nullptr) hooks_.unpin(reinterpret_cast<void*>(base));
    stats_.pinned_regions -= 1;
    stats_.pinned_bytes -= bytes;
  }
  UnmapRegion(base, bytes);
}

void HostPool::SetPinHooks(PinHooks hooks) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_ = hooks;
  for (const auto& region : regions_) PinLocked(region.first, region.second);
}

void* HostPool::Allocate(uint64_t bytes, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t rounded = RoundRequest(bytes);
  int failure = rounded == 0 ? kTooLarge : kServed;
  void* ptr = nullptr;
  if (failure == kServed) {
    try {
      ptr = AllocateLocked(rounded, &failure);
    } catch (...) {  // std::bad_alloc from map/set nodes; state is unchanged
      failure = kNoBookkeepingMemory;
    }
  }
  if (ptr != nullptr) {
    ++stats_.num_allocs;
    ++stats_.active_allocs;
    stats_.bytes_in_use += rounded;
    NoteUsage();
    return ptr;
  }
  ++stats_.num_failed_allocs;
  if (error != nullptr) {
    try {
      *error = FailureMessage(failure, bytes, rounded);
    } catch (...) {  // no memory even for the message; the nullptr says enough
    }
  }
  return nullptr;
}

void* HostPool::AllocateLocked(uint64_t rounded, int* failure) {
  auto it = FindBestFit(rounded);
  if (it == chunks_.end()) {
    *failure = GrowLocked(rounded);
    if (*failure != kServed) return nullptr;
    it = FindBestFit(rounded);
  }
  TakeChunk(it, rounded);
  return reinterpret_cast<void*>(it->first);
}

HostPool::ChunkMap::iterator HostPool::FindBestFit(uint64_t rounded) {
  const auto fit = free_.lower_bound({rounded, 0});
  return fit == free_.end() ? chunks_.end() : chunks_.find(fit->second);
}

int HostPool::GrowLocked(uint64_t rounded) {
  uint64_t size = NextRegionSize(rounded);
  if (size < rounded) return kOverLimit;
  void* base = MapRegion(size);
  if (base == nullptr && size > rounded) {
    // The growth policy asked for more than the request needs; the request
    // itself may still fit in what the OS can give.
    size = rounded;
    base = MapRegion(size);
  }
  if (base == nullptr) return errno != 0 ? errno : ENOMEM;

  const uintptr_t addr = reinterpret_cast<uintptr_t>(base);
  try {
    regions_.emplace(addr, size);
    chunks_.emplace(addr, Chunk{size, addr, false});
    free_.emplace(size, addr);
  } catch (...) {
    free_.erase({size, addr});
    chunks_.erase(addr);
    regions_.erase(addr);
    UnmapRegion(addr, size);
    throw;
  }
  last_region_bytes_ = size;
  stats_.bytes_reserved += size;
  PinLocked(addr, size);
  NoteUsage();
  return kServed;
}

// Geometric growth keeps the number of regions (and mmap calls) logarithmic
// in the peak footprint; the limit always wins over the policy.
uint64_t HostPool::NextRegionSize(uint64_t rounded) const {
  const uint64_t reserved = stats_.bytes_reserved;
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

size_t HostPool::Trim() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t released = 0;
  for (auto region = regions_.begin(); region != regions_.end();) {
    // Coalescing guarantees a fully free region is exactly one free chunk.
    const auto chunk = chunks_.find(region->first);
    if (chunk->second.in_use || chunk->second.size != region->second) {
      ++region;
      continue;
    }
    free_.erase({chunk->second.size, chunk->first});
    chunks_.erase(chunk);
    UnmapLocked(region->first, region->second);
    stats_.bytes_reserved -= region->second;
    released += region->second;
    region = regions_.erase(region);
  }
  // A fully trimmed pool starts small again instead of doubling forever.
  if (regions_.empty()) last_region_bytes_ = 0;
  return released;
}

HostPoolStats HostPool::GetStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  HostPoolStats stats = stats_;
  stats.limit_bytes = limit_bytes_;
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

uint64_t GlobalPoolLimit() {
  const uint64_t fallback = PhysicalMemoryBytes();
  const char* env = std::getenv("SNTF_HOST_POOL_LIMIT");
  // An empty value is how shells spell "unset" for one command.
  if (env == nullptr || *env == '\0') return fallback;
  uint64_t limit = 0;
  if (ParseByteCount(env, &limit)) return limit;
  std::fprintf(stderr,
               "sntf: ignoring malformed SNTF_HOST_POOL_LIMIT=\"%s\" (expected "
               "a plain integer byte count); using the physical memory size, "
               "%llu bytes\n",
               env, static_cast<unsigned long long>(fallback));
  return fallback;
}

}  // namespace

HostPool& GlobalHostPool() {
  // Leaked on purpose: static destructors run before some tensors are freed
  // at exit, and those frees must still find a live pool.
  static HostPool* const pool = new HostPool(GlobalPoolLimit());
  return *pool;
}

}  // namespace sntf
