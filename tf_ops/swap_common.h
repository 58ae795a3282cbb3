// What the swap ops and the tensor cache share: the pool-backed host
// allocation, the plain byte copy and the statistics counters.

#ifndef SNTF_TF_OPS_SWAP_COMMON_H_
#define SNTF_TF_OPS_SWAP_COMMON_H_

#include <atomic>
#include <cstdint>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace sntf {

// Counters shown by sntf.stats(); relaxed atomics are enough for statistics.
struct SwapCounters {
  std::atomic<uint64_t> swap_out_ops{0};
  std::atomic<uint64_t> swap_in_ops{0};
  std::atomic<uint64_t> bytes_to_host{0};
  std::atomic<uint64_t> bytes_to_device{0};
  std::atomic<uint64_t> failed_ops{0};
  // Tensor cache (SnCacheOut / SnCacheIn).
  std::atomic<uint64_t> cache_hits{0};       // swap-ins served by the device copy
  std::atomic<uint64_t> cache_misses{0};     // swap-ins that copied from host
  std::atomic<uint64_t> cache_evictions{0};  // cached tensors moved to host
  std::atomic<uint64_t> cache_no_stats{0};   // decisions without allocator stats
  // Tensors the host pool could not hold, parked in ordinary host memory.
  std::atomic<uint64_t> pool_fallbacks{0};
};

SwapCounters& Counters();

// Allocates a pool-backed host tensor shaped like `like`.
tensorflow::Status AllocateParked(const tensorflow::Tensor& like,
                                  tensorflow::Tensor* parked);

// Allocates a pool-backed host tensor shaped like `like`; when the pool
// cannot hold it (its limit is below the tensor, or it is full), an ordinary
// host tensor from the op's device (page-locked where that is a GPU), so
// that the step goes on. That fallback is counted and logged once.
tensorflow::Status AllocateParkedOrHost(tensorflow::OpKernelContext* ctx,
                                        const tensorflow::Tensor& like,
                                        tensorflow::Tensor* parked);

// Counts and logs (once per process) a tensor the pool could not hold.
void NotePoolFallback(const tensorflow::Status& pool_error);

// Plain memory copy between two tensors of identical dtype and shape.
void CopyBytes(const tensorflow::Tensor& from, tensorflow::Tensor* to);

// Page-locks the host pool through the loaded CUDA runtime (once per
// process); called when a GPU kernel of the swap ops is built.
void EnableGpuPinning();

}  // namespace sntf

#endif  // SNTF_TF_OPS_SWAP_COMMON_H_
