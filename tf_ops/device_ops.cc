// Small read-only ops that report what only the runtime knows.
//
//   SnDeviceBytesLimit()   the byte limit of the device allocator of the
//                          device the op runs on (-1: none known)
//   SnTensorMemoryType(x)  the memory type of x's buffer, as TensorFlow's
//                          copies see it (Tensor::GetMemoryType)
//
// Python has no equivalent: tf.config.experimental.get_memory_info gives
// current and peak bytes only, and device_lib.list_local_devices() builds a
// second set of devices to report a memory_limit.

#include <cstdint>
#include <string>

#include "swap_common.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace sntf {
namespace {

REGISTER_OP("SnDeviceBytesLimit")
    .Output("limit: int64")
    // Stateful: never constant-folded on another device than the one asked.
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
The byte limit of the allocator of the device this op is placed on
(Allocator::GetStats()->bytes_limit), or -1 when it reports none.
)doc");

REGISTER_OP("SnTensorMemoryType")
    .Input("x: T")
    .Output("memory_type: string")
    .Attr(SNTF_SWAP_TYPES)
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
The memory type of x's buffer: "unknown", "device", "host_pageable" or
"host_pinned". A diagnostic: TensorFlow stages copies from and to pageable
host buffers through pinned ones.
)doc");

class SnDeviceBytesLimitOp : public tensorflow::OpKernel {
 public:
  explicit SnDeviceBytesLimitOp(tensorflow::OpKernelConstruction* ctx)
      : OpKernel(ctx) {}

  void Compute(tensorflow::OpKernelContext* ctx) override {
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    out->scalar<int64_t>()() = BytesLimit(ctx);
  }

 private:
  static int64_t BytesLimit(tensorflow::OpKernelContext* ctx) {
    tensorflow::Allocator* allocator =
        ctx->device()->GetAllocator(tensorflow::AllocatorAttributes());
    if (allocator == nullptr) return -1;
    const auto stats = allocator->GetStats();
    if (!stats.has_value() || !stats->bytes_limit.has_value()) return -1;
    return *stats->bytes_limit;
  }
};

const char* MemoryTypeName(tensorflow::AllocatorMemoryType type) {
  switch (type) {
    case tensorflow::AllocatorMemoryType::kDevice:
      return "device";
    case tensorflow::AllocatorMemoryType::kHostPageable:
      return "host_pageable";
    case tensorflow::AllocatorMemoryType::kHostPinned:
      return "host_pinned";
    default:
      return "unknown";
  }
}

class SnTensorMemoryTypeOp : public tensorflow::OpKernel {
 public:
  explicit SnTensorMemoryTypeOp(tensorflow::OpKernelConstruction* ctx)
      : OpKernel(ctx) {}

  void Compute(tensorflow::OpKernelContext* ctx) override {
    const tensorflow::Tensor& x = ctx->input(0);
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    // A tensor without a buffer (zero elements) has no memory to speak of.
    const tensorflow::AllocatorMemoryType type =
        x.IsInitialized() && x.TotalBytes() > 0
            ? x.GetMemoryType()
            : tensorflow::AllocatorMemoryType::kUnknown;
    out->scalar<tensorflow::tstring>()() = MemoryTypeName(type);
  }
};

using tensorflow::DEVICE_CPU;
using tensorflow::DEVICE_GPU;

REGISTER_KERNEL_BUILDER(Name("SnDeviceBytesLimit").Device(DEVICE_CPU),
                        SnDeviceBytesLimitOp);
REGISTER_KERNEL_BUILDER(
    Name("SnDeviceBytesLimit").Device(DEVICE_GPU).HostMemory("limit"),
    SnDeviceBytesLimitOp);
REGISTER_KERNEL_BUILDER(Name("SnTensorMemoryType").Device(DEVICE_CPU),
                        SnTensorMemoryTypeOp);

}  // namespace
}  // namespace sntf
