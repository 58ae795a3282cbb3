// SnSwapOut / SnSwapIn: move a tensor between device memory and sntf's host
// tensor pool.
//
//   parked = SnSwapOut(x)   copies x into a host buffer taken from the pool
//   y      = SnSwapIn(parked)  copies it back into a fresh device tensor
//
// The host buffer is an ordinary TensorFlow Tensor whose buffer comes from
// the pool, so TensorFlow's refcounts decide when it goes back to the pool:
// there is no side table to leak. On CPU the pool's bytes are not counted by
// the CPU device allocator, which is exactly how pinned host memory relates
// to a GPU.
//
// Each kernel body is written once for asynchronous completion and is
// generic over its copier (swap_common.h). The GPU kernels are asynchronous
// and copy on the device context's device-to-host and host-to-device streams,
// as TensorFlow's _CopyFromGpuToHost kernel does
// (tensorflow/core/grappler/optimizers/gpu_swapping_kernels.cc); test-only
// CPU kernels (label "sntf_async_test") are asynchronous too, with a copier
// that completes on another thread after a delay; the default CPU kernels
// run the same body synchronously, their copier being a memcpy. Tensors
// that live in host memory on their device (int32 on a GPU, a HostMemory
// argument) are handed on without a copy.
#include <cstdint>

#include "swap_common.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace sntf {

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

template <typename CopierT>
class SwapOutBody {
 public:
  explicit SwapOutBody(tensorflow::OpKernelConstruction*) {}

  void Run(tensorflow::OpKernelContext* ctx, KernelDone done) {
    copier_.Prepare(ctx);
    const tensorflow::Tensor& x = ctx->input(0);
    if (InputInHostMemory(ctx, 0)) {
      // Already in host memory: there is nothing on the device to free.
      Counters().host_memory_passthrough.fetch_add(1);
      ctx->set_output(0, x);
      done();
      return;
    }
    tensorflow::Tensor parked;
    tensorflow::Status status = AllocateParked(x, &parked);
    if (!status.ok()) {
      NotePoolFallback(status);
      if (copier_.DeviceIsHost()) {
        // Ordinary host memory is the device's own: a copy would only add
        // bytes, so the tensor itself is handed on.
        ctx->set_output(0, x);
        done();
        return;
      }
      status = AllocateHost(ctx, x, &parked);
    }
    if (!status.ok()) Counters().failed_ops.fetch_add(1);
    OP_REQUIRES_OK_ASYNC(ctx, status, done);
    const uint64_t bytes = x.TotalBytes();
    copier_.ToHost(ctx, x, parked,
                   [ctx, parked, bytes, done](const tensorflow::Status& s) {
                     if (s.ok()) {
                       ctx->set_output(0, parked);
                       Counters().swap_out_ops.fetch_add(1);
                       Counters().bytes_to_host.fetch_add(bytes);
                     } else {
                       Counters().failed_ops.fetch_add(1);
                       ctx->SetStatus(s);
                     }
                     done();
                   });
  }

 private:
  CopierT copier_;
};

template <typename CopierT>
class SwapInBody {
 public:
  explicit SwapInBody(tensorflow::OpKernelConstruction*) {}

  void Run(tensorflow::OpKernelContext* ctx, KernelDone done) {
    copier_.Prepare(ctx);
    const tensorflow::Tensor& parked = ctx->input(0);
    if (OutputInHostMemory(ctx, 0)) {
      // The consumer reads host memory: no round trip through the device.
      Counters().host_memory_passthrough.fetch_add(1);
      ctx->set_output(0, parked);
      done();
      return;
    }
    tensorflow::Tensor* y = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, parked.shape(), &y),
                         done);
    const uint64_t bytes = parked.TotalBytes();
    copier_.ToDevice(ctx, parked, *y,
                     [ctx, bytes, done](const tensorflow::Status& s) {
                       if (s.ok()) {
                         Counters().swap_in_ops.fetch_add(1);
                         Counters().bytes_to_device.fetch_add(bytes);
                       } else {
                         Counters().failed_ops.fetch_add(1);
                         ctx->SetStatus(s);
                       }
                       done();
                     });
  }

 private:
  CopierT copier_;
};

using tensorflow::DEVICE_CPU;
using tensorflow::DEVICE_GPU;

template <typename CopierT>
using SnSwapOutOp = AsyncKernel<SwapOutBody<CopierT>>;
template <typename CopierT>
using SnSwapInOp = AsyncKernel<SwapInBody<CopierT>>;

REGISTER_KERNEL_BUILDER(Name("SnSwapOut").Device(DEVICE_CPU),
                        SyncKernel<SwapOutBody<CpuCopier>>);
REGISTER_KERNEL_BUILDER(Name("SnSwapIn").Device(DEVICE_CPU),
                        SyncKernel<SwapInBody<CpuCopier>>);

// GPU: `parked` in host memory; int32, which TensorFlow keeps in host memory
// on a GPU, entirely in host memory, so that it is handed on, not copied.
// The test-only CPU kernels (label kAsyncTestLabel, delayed copier) are
// registered the same way, so that tests run the GPU kernels' code paths.
#define SNTF_REGISTER_SWAP_KERNELS(builder, Copier)                        \
  REGISTER_KERNEL_BUILDER(builder("SnSwapOut")                             \
                              .TypeConstraint("T", SNTF_DEVICE_MEMORY_TYPES) \
                              .HostMemory("parked"),                       \
                          SnSwapOutOp<Copier>);                            \
  REGISTER_KERNEL_BUILDER(builder("SnSwapOut")                             \
                              .TypeConstraint<int32_t>("T")                \
                              .HostMemory("x")                             \
                              .HostMemory("parked"),                       \
                          SnSwapOutOp<Copier>);                            \
  REGISTER_KERNEL_BUILDER(builder("SnSwapIn")                              \
                              .TypeConstraint("T", SNTF_DEVICE_MEMORY_TYPES) \
                              .HostMemory("parked"),                       \
                          SnSwapInOp<Copier>);                             \
  REGISTER_KERNEL_BUILDER(builder("SnSwapIn")                              \
                              .TypeConstraint<int32_t>("T")                \
                              .HostMemory("parked")                        \
                              .HostMemory("y"),                            \
                          SnSwapInOp<Copier>)

#define SNTF_GPU_KERNEL(op) Name(op).Device(DEVICE_GPU)
#define SNTF_ASYNC_TEST_KERNEL(op) \
  Name(op).Device(DEVICE_CPU).Label(kAsyncTestLabel)

SNTF_REGISTER_SWAP_KERNELS(SNTF_GPU_KERNEL, DeviceContextCopier);
SNTF_REGISTER_SWAP_KERNELS(SNTF_ASYNC_TEST_KERNEL, DelayedTestCopier);

#undef SNTF_REGISTER_SWAP_KERNELS
#undef SNTF_GPU_KERNEL
#undef SNTF_ASYNC_TEST_KERNEL

}  // namespace sntf

extern "C" {

// Fills out[0..n) with: swap_out_ops, swap_in_ops, bytes_to_host,
// bytes_to_device, failed_ops, cache_hits, cache_misses, cache_evictions,
// cache_no_stats, pool_fallbacks, host_memory_passthrough. Returns how many
// values were written.
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
      c.host_memory_passthrough.load(),
  };
  const int total = sizeof(values) / sizeof(values[0]);
  const int count = n < total ? n : total;
  for (int i = 0; i < count; ++i) out[i] = values[i];
  return count;
}

}  // extern "C"
