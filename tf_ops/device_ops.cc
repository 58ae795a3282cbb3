// Small read-only ops that report what only the runtime knows.
//
//   SnDeviceBytesLimit()   the byte limit of the device allocator of the
//                          device the op runs on (-1: none known)
//   SnTensorMemoryType(x)  the memory type of x's buffer, as TensorFlow's
//                          copies see it (Tensor::GetMemoryType)
//   SnReserveRegion(most)  has the device allocator take what is left of its
//                          limit as one region, then frees it (CPU only)
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

REGISTER_OP("SnReserveRegion")
    .Input("most: int64")
    .Output("reserved: int64")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
Has the allocator of the device this op is placed on take what is left of
its limit (bytes_limit less the bytes its regions hold, pool_bytes) as one
more region, by allocating that much once and freeing it.

A BFC allocator that grows (allow_growth, as TensorFlow's CPU BFC allocator
always does) adds regions of doubling size, the last one capped by what the
limit leaves, and a chunk never spans two regions: under a limit a request
can find no region large enough while most of the limit is free. Taken as
one region before a step runs, the rest of the limit holds any request that
fits it. The allocator never returns a region, so it keeps the region; on a
host the pages stay untouched until a tensor uses them. The allocator's
statistics are then cleared (Allocator::ClearStats): its peak restarts from
the bytes in use, not from the moment the region was allocated whole.

reserved: the bytes of the new region; 0 where the allocator reports no
limit or no pool statistics, where nothing is left, or where what is left
exceeds `most`; -1 where the allocation failed.
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

class SnReserveRegionOp : public tensorflow::OpKernel {
 public:
  explicit SnReserveRegionOp(tensorflow::OpKernelConstruction* ctx)
      : OpKernel(ctx) {}

  void Compute(tensorflow::OpKernelContext* ctx) override {
    const tensorflow::Tensor& most = ctx->input(0);
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(most.shape()),
                tensorflow::errors::InvalidArgument("most must be a scalar"));
    const int64_t reserved = Reserve(ctx, most.scalar<int64_t>()());
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    out->scalar<int64_t>()() = reserved;
  }

 private:
  // The BFC allocator's smallest unit: a region is a whole number of them.
  static constexpr int64_t kUnit = 256;

  static int64_t Reserve(tensorflow::OpKernelContext* ctx, int64_t most) {
    tensorflow::Allocator* allocator =
        ctx->device()->GetAllocator(tensorflow::AllocatorAttributes());
    if (allocator == nullptr) return 0;
    const auto stats = allocator->GetStats();
    if (!stats.has_value() || !stats->bytes_limit.has_value() ||
        !stats->pool_bytes.has_value()) {
      return 0;
    }
    const int64_t rest = (*stats->bytes_limit - *stats->pool_bytes) / kUnit * kUnit;
    if (rest <= 0 || rest > most) return 0;
    // No retry: a request the allocator cannot serve fails at once instead
    // of waiting for memory to be freed.
    tensorflow::AllocationAttributes attributes;
    attributes.retry_on_failure = false;
    void* region = allocator->AllocateRaw(tensorflow::Allocator::kAllocatorAlignment,
                                          static_cast<size_t>(rest), attributes);
    if (region == nullptr) return -1;
    allocator->DeallocateRaw(region);
    // The region was in use for a moment: without this the allocator's
    // peak (get_memory_info's "peak") would read the whole limit. Its
    // statistics restart from the bytes in use now.
    allocator->ClearStats();
    return rest;
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
// CPU only: a GPU allocator grows only where the user turned memory growth
// on, so that other processes may share the GPU; taking the rest of its
// memory would undo that choice.
REGISTER_KERNEL_BUILDER(Name("SnReserveRegion").Device(DEVICE_CPU),
                        SnReserveRegionOp);

}  // namespace
}  // namespace sntf
