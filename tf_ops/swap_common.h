// What the swap ops and the tensor cache share: pool-backed host tensors,
// the copiers that move bytes between a device and the host, memory-type
// checks and the statistics counters.

#ifndef SNTF_TF_OPS_SWAP_COMMON_H_
#define SNTF_TF_OPS_SWAP_COMMON_H_

#include <atomic>
#include <cstdint>
#include <functional>

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
  // Tensors already in host memory (e.g. int32 on a GPU): handed on, no copy.
  std::atomic<uint64_t> host_memory_passthrough{0};
};

SwapCounters& Counters();

// Allocates a host tensor shaped like `like` from sntf's pool. Its buffer
// reports kHostPinned when it lies in a page-locked region and
// kHostPageable otherwise, so that TensorFlow's host-to-device copy (a
// swap-in) stages a pageable source through a pinned buffer
// (GPUUtil::CopyCPUTensorToGPU asks NeedStaging, which reads
// Tensor::GetMemoryType()). Its device-to-host copy (a swap-out) does not
// stage: into a region past the pin cap it is a plain copy into pageable
// memory.
tensorflow::Status AllocateParked(const tensorflow::Tensor& like,
                                  tensorflow::Tensor* parked);

// A host tensor shaped like `like` from the op's device allocator for host
// memory (on a GPU: TensorFlow's pinned host allocator), for tensors the
// pool cannot hold.
tensorflow::Status AllocateHost(tensorflow::OpKernelContext* ctx,
                                const tensorflow::Tensor& like,
                                tensorflow::Tensor* host);

// AllocateParked, else (counted and logged once) AllocateHost, so that the
// step goes on.
tensorflow::Status AllocateParkedOrHost(tensorflow::OpKernelContext* ctx,
                                        const tensorflow::Tensor& like,
                                        tensorflow::Tensor* parked);

// Counts and logs (once per process) a tensor the pool could not hold.
void NotePoolFallback(const tensorflow::Status& pool_error);

// Plain memory copy between two tensors of identical dtype and shape.
void CopyBytes(const tensorflow::Tensor& from, tensorflow::Tensor* to);

// Whether the kernel's input / output `index` lives in host memory: a
// HostMemory argument of a GPU kernel (int32 on a GPU), where there is no
// device copy to move.
bool InputInHostMemory(tensorflow::OpKernelContext* ctx, int index);
bool OutputInHostMemory(tensorflow::OpKernelContext* ctx, int index);

// Moves the bytes of a tensor between the op's device and the host,
// asynchronously: `done` runs once the copy has finished, possibly on
// another thread, possibly before the call returns. Both tensors are passed
// by value, so the copier holds their buffers until the copy has finished.
class Copier {
 public:
  using Done = std::function<void(const tensorflow::Status&)>;
  virtual ~Copier() = default;
  // Device memory is ordinary host memory: a tensor the pool cannot hold
  // may simply stay where it is.
  virtual bool DeviceIsHost() const = 0;
  // Called at the start of each kernel run, with the kernel's context.
  virtual void Prepare(tensorflow::OpKernelContext* ctx) const {}
  virtual void ToHost(tensorflow::OpKernelContext* ctx,
                      tensorflow::Tensor device, tensorflow::Tensor host,
                      Done done) const = 0;
  virtual void ToDevice(tensorflow::OpKernelContext* ctx,
                        tensorflow::Tensor host, tensorflow::Tensor device,
                        Done done) const = 0;
};

// CPU: a memcpy on the calling thread.
class CpuCopier : public Copier {
 public:
  bool DeviceIsHost() const override { return true; }
  void ToHost(tensorflow::OpKernelContext* ctx, tensorflow::Tensor device,
              tensorflow::Tensor host, Done done) const override;
  void ToDevice(tensorflow::OpKernelContext* ctx, tensorflow::Tensor host,
                tensorflow::Tensor device, Done done) const override;
};

// GPU: the device context's CopyDeviceTensorToCPU / CopyCPUTensorToDevice
// (TensorFlow's device-to-host and host-to-device streams), as TensorFlow's
// _CopyFromGpuToHost / _CopyFromHostToGpu kernels do. Prepare page-locks the
// host pool through the device's StreamExecutor (gpu_pinning.cc).
class DeviceContextCopier : public Copier {
 public:
  bool DeviceIsHost() const override { return false; }
  void Prepare(tensorflow::OpKernelContext* ctx) const override;
  void ToHost(tensorflow::OpKernelContext* ctx, tensorflow::Tensor device,
              tensorflow::Tensor host, Done done) const override;
  void ToDevice(tensorflow::OpKernelContext* ctx, tensorflow::Tensor host,
                tensorflow::Tensor device, Done done) const override;
};

// Test-only, CPU: behaves like a device copier (DeviceIsHost is false) whose
// copies complete in issue order on one other thread after a configurable
// delay, and fail on request (sntf_test_copier_configure). Registered under
// the kernel label kAsyncTestLabel.
class DelayedTestCopier : public Copier {
 public:
  bool DeviceIsHost() const override { return false; }
  void ToHost(tensorflow::OpKernelContext* ctx, tensorflow::Tensor device,
              tensorflow::Tensor host, Done done) const override;
  void ToDevice(tensorflow::OpKernelContext* ctx, tensorflow::Tensor host,
                tensorflow::Tensor device, Done done) const override;
};

constexpr char kAsyncTestLabel[] = "sntf_async_test";

// A kernel body, `Body(OpKernelConstruction*)` with
// `void Run(OpKernelContext*, std::function<void()> done)`, written once for
// asynchronous completion and run by one of the two kernels below.
using KernelDone = std::function<void()>;

// As TensorFlow's asynchronous kernel: for copiers that complete later, on
// another thread (a device's streams, the delayed test copier).
template <typename Body>
class AsyncKernel : public tensorflow::AsyncOpKernel {
 public:
  explicit AsyncKernel(tensorflow::OpKernelConstruction* ctx)
      : AsyncOpKernel(ctx), body_(ctx) {}
  void ComputeAsync(tensorflow::OpKernelContext* ctx,
                    DoneCallback done) override {
    body_.Run(ctx, std::move(done));
  }

 private:
  Body body_;
};

// As a synchronous kernel, for the CPU copier, which completes inline. The
// executor runs a synchronous kernel's successors depth-first on the same
// thread, but queues an asynchronous kernel's successors on the inter-op
// pool; on CPU that reorders the schedule and raises the memory peak.
template <typename Body>
class SyncKernel : public tensorflow::OpKernel {
 public:
  explicit SyncKernel(tensorflow::OpKernelConstruction* ctx)
      : OpKernel(ctx), body_(ctx) {}
  void Compute(tensorflow::OpKernelContext* ctx) override {
    bool finished = false;
    body_.Run(ctx, [&finished] { finished = true; });
    OP_REQUIRES(ctx, finished,
                tensorflow::errors::Internal(
                    name(), ": the copier did not complete inline"));
  }

 private:
  Body body_;
};

// Page-locks the host pool through the StreamExecutor of ctx's device (once
// per process); see gpu_pinning.cc.
void EnsureDevicePinning(tensorflow::OpKernelContext* ctx);

// Every dtype whose buffer is plain bytes: numeric, bool, complex and
// quantized. Strings, resources and variants own heap objects and cannot move.
#define SNTF_SWAP_TYPES                                                    \
  "T: {bfloat16, half, float, double, int8, int16, int32, int64, uint8, "  \
  "uint16, uint32, uint64, bool, complex64, complex128, qint8, quint8, "    \
  "qint16, quint16, qint32}"

// The same types less int32, which TensorFlow keeps in host memory on GPUs:
// its GPU kernels are registered separately, with HostMemory arguments.
#define SNTF_DEVICE_MEMORY_TYPES                                            \
  {tensorflow::DT_BFLOAT16, tensorflow::DT_HALF,    tensorflow::DT_FLOAT,     \
   tensorflow::DT_DOUBLE,   tensorflow::DT_INT8,    tensorflow::DT_INT16,     \
   tensorflow::DT_INT64,    tensorflow::DT_UINT8,   tensorflow::DT_UINT16,    \
   tensorflow::DT_UINT32,   tensorflow::DT_UINT64,  tensorflow::DT_BOOL,      \
   tensorflow::DT_COMPLEX64, tensorflow::DT_COMPLEX128, tensorflow::DT_QINT8, \
   tensorflow::DT_QUINT8,   tensorflow::DT_QINT16,  tensorflow::DT_QUINT16,   \
   tensorflow::DT_QINT32}

}  // namespace sntf

#endif  // SNTF_TF_OPS_SWAP_COMMON_H_
