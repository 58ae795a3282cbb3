// SnSwapOut / SnSwapIn: move a tensor between device memory and sntf's host
// tensor pool.
//
//   parked = SnSwapOut(x)   copies x into a host buffer taken from the pool
//   y      = SnSwapIn(parked)  copies it back into a fresh device tensor
//
// The host buffer is an ordinary TensorFlow Tensor whose Allocator is the
// pool, so TensorFlow's refcounts decide when it goes back to the pool: there
// is no side table to leak. On CPU the pool's bytes are not counted by the CPU
// device allocator, which is exactly how pinned host memory relates to a GPU.
//
// GPU kernels keep `parked` in host memory and copy with the device context
// (TensorFlow's device-to-host and host-to-device streams); they need no CUDA
// code to compile.

#include <atomic>
#include <cstring>
#include <string>

#include "host_pool.h"
#include "swap_common.h"
#include "tensorflow/core/common_runtime/device.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace sntf {

SwapCounters& Counters() {
  static SwapCounters* counters = new SwapCounters();  // never destroyed
  return *counters;
}

// Adapts the host pool to TensorFlow's Allocator interface.
class PoolAllocator : public tensorflow::Allocator {
 public:
  std::string Name() override { return "sntf_host_pool"; }

  void* AllocateRaw(size_t alignment, size_t num_bytes) override {
    std::string error;
    void* ptr = GlobalHostPool().Allocate(num_bytes, &error);
    if (ptr == nullptr) LastError() = error;
    // The pool aligns to 256 bytes, more than any TensorFlow request.
    return ptr;
  }

  void* AllocateRaw(size_t alignment, size_t num_bytes,
                    const tensorflow::AllocationAttributes&) override {
    return AllocateRaw(alignment, num_bytes);
  }

  void DeallocateRaw(void* ptr) override {
    if (ptr != nullptr) GlobalHostPool().Deallocate(ptr);
  }

  bool TracksAllocationSizes() const override { return true; }

  size_t RequestedSize(const void* ptr) const override {
    return GlobalHostPool().AllocatedSize(ptr);
  }

  size_t AllocatedSize(const void* ptr) const override {
    return GlobalHostPool().AllocatedSize(ptr);
  }

  // Why the last allocation on this thread failed.
  static std::string& LastError() {
    thread_local std::string error;
    return error;
  }
};

PoolAllocator* HostPoolAllocator() {
  static PoolAllocator* allocator = new PoolAllocator();  // never destroyed
  return allocator;
}

// Allocates a pool-backed host tensor shaped like `like`.
tensorflow::Status AllocateParked(const tensorflow::Tensor& like,
                                  tensorflow::Tensor* parked) {
  tensorflow::Tensor t(HostPoolAllocator(), like.dtype(), like.shape());
  if (!t.IsInitialized()) {
    return tensorflow::errors::ResourceExhausted(
        PoolAllocator::LastError(), " (tensor of shape ",
        like.shape().DebugString(), ", ", like.TotalBytes(), " bytes)");
  }
  *parked = std::move(t);
  return tensorflow::OkStatus();
}

void NotePoolFallback(const tensorflow::Status& pool_error) {
  Counters().pool_fallbacks.fetch_add(1);
  static std::atomic<bool> logged{false};
  if (!logged.exchange(true)) {
    LOG(WARNING) << "sntf: " << pool_error.message()
                 << "; the tensor stays in ordinary memory instead and "
                    "training goes on (raise sntf.enable(host_pool_limit=...) "
                    "or SNTF_HOST_POOL_LIMIT). Logged once; sntf.stats() "
                    "counts such tensors as pool_fallbacks.";
  }
}

tensorflow::Status AllocateParkedOrHost(tensorflow::OpKernelContext* ctx,
                                        const tensorflow::Tensor& like,
                                        tensorflow::Tensor* parked) {
  tensorflow::Status status = AllocateParked(like, parked);
  if (status.ok()) return status;
  NotePoolFallback(status);
  tensorflow::AllocatorAttributes host;
  host.set_on_host(true);
  host.set_gpu_compatible(true);
  return ctx->allocate_temp(like.dtype(), like.shape(), parked, host);
}

// Plain memory copy between two tensors of identical dtype and shape; size_t
// throughout so tensors above 4 GiB copy whole.
void CopyBytes(const tensorflow::Tensor& from, tensorflow::Tensor* to) {
  const size_t bytes = from.TotalBytes();
  if (bytes == 0) return;
  std::memcpy(const_cast<char*>(to->tensor_data().data()),
              from.tensor_data().data(), bytes);
}

using tensorflow::shape_inference::InferenceContext;

// Every dtype whose buffer is plain bytes: numeric, bool, complex and quantized
// floats. Strings, resources and variants own heap objects and cannot move.
#define SNTF_SWAP_TYPES                                                    \
  "T: {bfloat16, half, float, double, int8, int16, int32, int64, uint8, "  \
  "uint16, uint32, uint64, bool, complex64, complex128, qint8, quint8, "    \
  "qint16, quint16, qint32}"

REGISTER_OP("SnSwapOut")
    .Input("x: T")
    .Output("parked: T")
    .Attr(SNTF_SWAP_TYPES)
    // Stateful: Grappler must neither fold, deduplicate nor prune a swap.
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
Copies `x` into a host buffer from sntf's tensor pool. `parked` has the dtype
and shape of `x` and lives in host memory on every device.
)doc");

REGISTER_OP("SnSwapIn")
    .Input("parked: T")
    .Output("y: T")
    .Attr(SNTF_SWAP_TYPES)
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
Copies a tensor parked by SnSwapOut back into device memory.
)doc");

#undef SNTF_SWAP_TYPES

class SnSwapOutCpuOp : public tensorflow::OpKernel {
 public:
  explicit SnSwapOutCpuOp(tensorflow::OpKernelConstruction* ctx)
      : OpKernel(ctx) {}

  void Compute(tensorflow::OpKernelContext* ctx) override {
    const tensorflow::Tensor& x = ctx->input(0);
    tensorflow::Tensor parked;
    tensorflow::Status status = AllocateParked(x, &parked);
    if (!status.ok()) {
      // On a CPU device ordinary host memory is the device's own: a copy
      // would only add bytes, so the tensor itself is handed on.
      NotePoolFallback(status);
      ctx->set_output(0, x);
      return;
    }
    CopyBytes(x, &parked);
    Counters().swap_out_ops.fetch_add(1);
    Counters().bytes_to_host.fetch_add(x.TotalBytes());
    ctx->set_output(0, parked);
  }
};

class SnSwapInCpuOp : public tensorflow::OpKernel {
 public:
  explicit SnSwapInCpuOp(tensorflow::OpKernelConstruction* ctx)
      : OpKernel(ctx) {}

  void Compute(tensorflow::OpKernelContext* ctx) override {
    const tensorflow::Tensor& parked = ctx->input(0);
    tensorflow::Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, parked.shape(), &y));
    CopyBytes(parked, y);
    Counters().swap_in_ops.fetch_add(1);
    Counters().bytes_to_device.fetch_add(parked.TotalBytes());
  }
};

REGISTER_KERNEL_BUILDER(Name("SnSwapOut").Device(tensorflow::DEVICE_CPU),
                        SnSwapOutCpuOp);
REGISTER_KERNEL_BUILDER(Name("SnSwapIn").Device(tensorflow::DEVICE_CPU),
                        SnSwapInCpuOp);

// GPU: device-to-host copy on the device context's D2H stream.
class SnSwapOutGpuOp : public tensorflow::AsyncOpKernel {
 public:
  explicit SnSwapOutGpuOp(tensorflow::OpKernelConstruction* ctx)
      : AsyncOpKernel(ctx) {
    EnableGpuPinning();
  }

  void ComputeAsync(tensorflow::OpKernelContext* ctx,
                    DoneCallback done) override {
    const tensorflow::Tensor& x = ctx->input(0);
    tensorflow::Tensor parked;
    tensorflow::Status status = AllocateParkedOrHost(ctx, x, &parked);
    if (!status.ok()) Counters().failed_ops.fetch_add(1);
    OP_REQUIRES_OK_ASYNC(ctx, status, done);
    if (x.TotalBytes() == 0) {
      ctx->set_output(0, parked);
      done();
      return;
    }
    tensorflow::DeviceContext* device_context = ctx->op_device_context();
    OP_REQUIRES_ASYNC(ctx, device_context != nullptr,
                      tensorflow::errors::Internal(
                          "SnSwapOut: no device context on ", name()),
                      done);
    auto* device = static_cast<tensorflow::Device*>(ctx->device());
    const uint64_t bytes = x.TotalBytes();
    // `parked` is captured by value: its refcount keeps the pool buffer alive
    // until the asynchronous copy has finished.
    tensorflow::Tensor* destination = new tensorflow::Tensor(parked);
    device_context->CopyDeviceTensorToCPU(
        &x, name(), device, destination,
        [ctx, destination, bytes, done](const tensorflow::Status& s) {
          if (s.ok()) {
            ctx->set_output(0, *destination);
            Counters().swap_out_ops.fetch_add(1);
            Counters().bytes_to_host.fetch_add(bytes);
          } else {
            Counters().failed_ops.fetch_add(1);
            ctx->SetStatus(s);
          }
          delete destination;
          done();
        });
  }
};

// GPU: host-to-device copy on the device context's H2D stream.
class SnSwapInGpuOp : public tensorflow::AsyncOpKernel {
 public:
  explicit SnSwapInGpuOp(tensorflow::OpKernelConstruction* ctx)
      : AsyncOpKernel(ctx) {
    EnableGpuPinning();
  }

  void ComputeAsync(tensorflow::OpKernelContext* ctx,
                    DoneCallback done) override {
    const tensorflow::Tensor& parked = ctx->input(0);
    tensorflow::Tensor* y = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, parked.shape(), &y),
                         done);
    if (parked.TotalBytes() == 0) {
      done();
      return;
    }
    tensorflow::DeviceContext* device_context = ctx->op_device_context();
    OP_REQUIRES_ASYNC(ctx, device_context != nullptr,
                      tensorflow::errors::Internal(
                          "SnSwapIn: no device context on ", name()),
                      done);
    auto* device = static_cast<tensorflow::Device*>(ctx->device());
    const uint64_t bytes = parked.TotalBytes();
    // Keep the host buffer alive until the copy has been issued and finished.
    tensorflow::Tensor* source = new tensorflow::Tensor(parked);
    device_context->CopyCPUTensorToDevice(
        source, device, y,
        [ctx, source, bytes, done](const tensorflow::Status& s) {
          if (s.ok()) {
            Counters().swap_in_ops.fetch_add(1);
            Counters().bytes_to_device.fetch_add(bytes);
          } else {
            Counters().failed_ops.fetch_add(1);
            ctx->SetStatus(s);
          }
          delete source;
          done();
        },
        /*sync_dst_compute=*/true);
  }
};

REGISTER_KERNEL_BUILDER(Name("SnSwapOut")
                            .Device(tensorflow::DEVICE_GPU)
                            .HostMemory("parked"),
                        SnSwapOutGpuOp);
REGISTER_KERNEL_BUILDER(Name("SnSwapIn")
                            .Device(tensorflow::DEVICE_GPU)
                            .HostMemory("parked"),
                        SnSwapInGpuOp);

}  // namespace sntf

extern "C" {

// Fills out[0..n) with: swap_out_ops, swap_in_ops, bytes_to_host,
// bytes_to_device, failed_ops, cache_hits, cache_misses, cache_evictions,
// cache_no_stats, pool_fallbacks. Returns how many values were written.
__attribute__((visibility("default"))) int sntf_swap_stats(uint64_t* out,
                                                           int n) {
  if (out == nullptr || n <= 0) return 0;
  const sntf::SwapCounters& c = sntf::Counters();
  const uint64_t values[] = {
      c.swap_out_ops.load(),    c.swap_in_ops.load(),
      c.bytes_to_host.load(),   c.bytes_to_device.load(),
      c.failed_ops.load(),      c.cache_hits.load(),
      c.cache_misses.load(),    c.cache_evictions.load(),
      c.cache_no_stats.load(),  c.pool_fallbacks.load(),
  };
  const int total = sizeof(values) / sizeof(values[0]);
  const int count = n < total ? n : total;
  for (int i = 0; i < count; ++i) out[i] = values[i];
  return count;
}

}  // extern "C"
