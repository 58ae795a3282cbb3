// The allocator model's step (sntf/analysis/bfc.py: simulate) in C++.
//
// The planner analyzes each plan it tries, and replaying a step's
// allocations and frees on a model of TensorFlow's BFC allocator is a large
// share of that analysis. This is the same model, rule for rule, as
// BfcModel in bfc.py: 256-byte granules, 21 bins of free chunks ordered by
// (size, address), best fit, a chunk split when at least twice the request
// (or when more than 128 MiB would be wasted), neighbours coalesced on free,
// regions doubling from the first (under a limit, what is left).
// bfc.simulate calls it where it is built and falls back to BfcModel
// otherwise; tests compare the two.
//
// No TensorFlow: plain data in, plain data out.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kMinAllocationBits = 8;
constexpr int64_t kMinAllocation = int64_t{1} << kMinAllocationBits;
constexpr int kNumBins = 21;
constexpr int64_t kMaxInternalFragmentation = int64_t{128} << 20;

int64_t RoundedBytes(int64_t n) {
  const int64_t r = (n + kMinAllocation - 1) / kMinAllocation * kMinAllocation;
  return std::max(kMinAllocation, r);
}

int BinForSize(int64_t n) {
  const uint64_t v = static_cast<uint64_t>(std::max<int64_t>(n, 1)) >> kMinAllocationBits;
  if (v == 0) return 0;
  const int log2 = 63 - __builtin_clzll(v);
  return std::min(kNumBins - 1, log2);
}

struct OutOfMemory {
  int64_t size, reserved, limit;
};

struct Chunk {
  int64_t size = 0;
  bool in_use = false;
  int64_t prev = -1;  // address of the previous chunk in the region, or -1
  int64_t next = -1;
};

class Model {
 public:
  Model(int64_t initial_region_bytes, int64_t limit)
      : limit_(limit), region_bytes_(RoundedBytes(initial_region_bytes)) {}

  int64_t in_use() const { return in_use_; }
  int64_t next_region_bytes() const { return region_bytes_; }

  int64_t Allocate(int64_t nbytes) {
    const int64_t size = RoundedBytes(nbytes);
    int64_t addr = Find(size);
    if (addr < 0) {
      Extend(size);
      addr = Find(size);
    }
    Chunk& c = chunks_[addr];
    BinRemove(addr, c.size);
    if (c.size >= 2 * size || c.size - size >= kMaxInternalFragmentation) {
      const int64_t rest_addr = addr + size;
      Chunk rest;
      rest.size = c.size - size;
      rest.prev = addr;
      rest.next = c.next;
      if (c.next >= 0) chunks_[c.next].prev = rest_addr;
      c.next = rest_addr;
      c.size = size;
      BinInsert(rest_addr, rest.size);
      chunks_.emplace(rest_addr, rest);
    }
    Chunk& used = chunks_[addr];
    used.in_use = true;
    in_use_ += used.size;
    return addr;
  }

  void Free(int64_t addr) {
    Chunk* c = &chunks_[addr];
    c->in_use = false;
    in_use_ -= c->size;
    if (c->next >= 0) {
      const int64_t right_addr = c->next;
      Chunk& right = chunks_[right_addr];
      if (!right.in_use) {
        BinRemove(right_addr, right.size);
        Absorb(addr, right_addr);
        c = &chunks_[addr];
      }
    }
    if (c->prev >= 0) {
      const int64_t left_addr = c->prev;
      Chunk& left = chunks_[left_addr];
      if (!left.in_use) {
        BinRemove(left_addr, left.size);
        Absorb(left_addr, addr);
        addr = left_addr;
      }
    }
    BinInsert(addr, chunks_[addr].size);
  }

 private:
  int64_t Find(int64_t size) const {
    for (int b = BinForSize(size); b < kNumBins; ++b) {
      auto it = bins_[b].lower_bound({size, -1});
      if (it != bins_[b].end()) return it->second;
    }
    return -1;
  }

  void Extend(int64_t size) {
    int64_t available = -1;
    if (limit_ >= 0) {
      available = (limit_ - reserved_) / kMinAllocation * kMinAllocation;
      if (size > available) throw OutOfMemory{size, reserved_, limit_};
    }
    bool grew = false;
    while (size > region_bytes_) {
      region_bytes_ *= 2;
      grew = true;
    }
    const int64_t region_size =
        available < 0 ? region_bytes_ : std::min(region_bytes_, available);
    const int64_t addr = next_addr_;
    next_addr_ += region_size + kMinAllocation;  // regions never touch
    Chunk c;
    c.size = region_size;
    chunks_.emplace(addr, c);
    BinInsert(addr, region_size);
    reserved_ += region_size;
    if (!grew) region_bytes_ *= 2;
  }

  void Absorb(int64_t left_addr, int64_t right_addr) {
    Chunk& left = chunks_[left_addr];
    Chunk& right = chunks_[right_addr];
    left.size += right.size;
    left.next = right.next;
    if (right.next >= 0) chunks_[right.next].prev = left_addr;
    chunks_.erase(right_addr);
  }

  void BinInsert(int64_t addr, int64_t size) { bins_[BinForSize(size)].insert({size, addr}); }
  void BinRemove(int64_t addr, int64_t size) { bins_[BinForSize(size)].erase({size, addr}); }

  int64_t limit_;
  int64_t region_bytes_;
  int64_t next_addr_ = 0;
  int64_t in_use_ = 0;
  int64_t reserved_ = 0;
  std::unordered_map<int64_t, Chunk> chunks_;
  std::set<std::pair<int64_t, int64_t>> bins_[kNumBins];
};

// The step's events: per busy step (steps), its allocations
// (allocs[alloc_start[k]:alloc_start[k + 1]]) and its frees, by buffer id;
// per buffer, its bytes and the persistent buffer it is handed over to
// (-1: none); the buffers live at the step's end, in the order freed.
struct Events {
  std::vector<int64_t> sizes, steps, alloc_start, allocs, free_start, frees, handover, last;
  int64_t end;
};

// One step: per busy step, its allocations, then the figure, then its frees
// (a dying buffer handed over to a persistent one frees that one's chunk
// and takes its place); then what is live at the end is freed.
void RunStep(Model& sim, const Events& ev, std::vector<int64_t>& held,
             std::vector<int64_t>& series, int64_t& step) {
  const auto& sizes = ev.sizes;
  const auto& steps = ev.steps;
  const auto& alloc_start = ev.alloc_start;
  const auto& allocs = ev.allocs;
  const auto& free_start = ev.free_start;
  const auto& frees = ev.frees;
  const auto& handover = ev.handover;
  const int64_t end = ev.end;
  step = -1;
  std::vector<int64_t> where(sizes.size(), -1);
  series.clear();
  series.reserve(end);
  for (size_t k = 0; k < steps.size(); ++k) {
    step = steps[k];
    if (static_cast<int64_t>(series.size()) < step) series.resize(step, sim.in_use());
    for (int64_t j = alloc_start[k]; j < alloc_start[k + 1]; ++j)
      where[allocs[j]] = sim.Allocate(sizes[allocs[j]]);
    series.push_back(sim.in_use());
    for (int64_t j = free_start[k]; j < free_start[k + 1]; ++j) {
      const int64_t b = frees[j];
      const int64_t target = handover[b];
      if (target >= 0) {
        sim.Free(held[target]);
        held[target] = where[b];
      } else {
        sim.Free(where[b]);
      }
      where[b] = -1;
    }
  }
  if (static_cast<int64_t>(series.size()) < end) series.resize(end, sim.in_use());
  for (int64_t b : ev.last)
    if (where[b] >= 0) sim.Free(where[b]);
}

// Returns (series, None), or (None, (step, size, reserved, limit)) where the
// model runs out of memory (step -1: before the step).
py::tuple Simulate(int64_t first_region, int64_t limit, int64_t outside,
                   const std::vector<int64_t>& persistent, std::vector<int64_t> sizes,
                   std::vector<int64_t> steps, std::vector<int64_t> alloc_start,
                   std::vector<int64_t> allocs, std::vector<int64_t> free_start,
                   std::vector<int64_t> frees, std::vector<int64_t> handover,
                   std::vector<int64_t> last, int64_t end, bool twice) {
  const Events ev{std::move(sizes), std::move(steps), std::move(alloc_start),
                  std::move(allocs), std::move(free_start), std::move(frees),
                  std::move(handover), std::move(last), end};
  Model sim(first_region, limit);
  int64_t step = -1;
  std::vector<int64_t> first, second;
  try {
    for (int64_t rest = outside; rest > 0;) {
      const int64_t piece = std::min(rest, sim.next_region_bytes());
      sim.Allocate(piece);
      rest -= piece;
    }
    std::vector<int64_t> held;
    held.reserve(persistent.size());
    for (int64_t n : persistent) held.push_back(sim.Allocate(n));
    RunStep(sim, ev, held, first, step);
    if (twice) {
      RunStep(sim, ev, held, second, step);
      for (size_t k = 0; k < first.size(); ++k) first[k] = std::max(first[k], second[k]);
    }
  } catch (const OutOfMemory& e) {
    return py::make_tuple(py::none(), py::make_tuple(step, e.size, e.reserved, e.limit));
  }
  return py::make_tuple(first, py::none());
}

}  // namespace

PYBIND11_MODULE(_bfc_model, m) {
  m.doc() = "The BFC allocator model's step (sntf.analysis.bfc.simulate), native.";
  m.def("simulate", &Simulate, "Bytes in use at each step, or where it runs out.");
}
