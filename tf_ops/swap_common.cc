// Pool-backed host tensors, memory-type checks and the CPU and GPU copiers;
// see swap_common.h.
#include "swap_common.h"

#include <atomic>
#include <cstring>
#include <string>
#include <utility>

#include "host_pool.h"
#include "tensorflow/core/common_runtime/device.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/device_base.h"

namespace sntf {

SwapCounters& Counters() {
  static SwapCounters* counters = new SwapCounters();  // never destroyed
  return *counters;
}

namespace {

// A tensor buffer carved out of the global host pool. It records whether
// its region was page-locked when the block was handed out; a region is
// never unpinned while one of its blocks is live.
class PoolBuffer : public tensorflow::TensorBuffer {
 public:
  PoolBuffer(void* data, size_t bytes, bool pinned)
      : TensorBuffer(data), bytes_(bytes), pinned_(pinned) {}
  ~PoolBuffer() override { GlobalHostPool().Deallocate(data()); }

  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(
      tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(bytes_));
    proto->set_allocated_bytes(static_cast<int64_t>(bytes_));
    proto->set_allocator_name("sntf_host_pool");
    proto->set_ptr(reinterpret_cast<uintptr_t>(data()));
  }
  tensorflow::AllocatorMemoryType GetMemoryType() const override {
    return pinned_ ? tensorflow::AllocatorMemoryType::kHostPinned
                   : tensorflow::AllocatorMemoryType::kHostPageable;
  }

 private:
  const size_t bytes_;
  const bool pinned_;
};

}  // namespace

tensorflow::Status AllocateParked(const tensorflow::Tensor& like,
                                  tensorflow::Tensor* parked) {
  const size_t bytes = like.TotalBytes();
  std::string error;
  bool pinned = false;
  void* data = GlobalHostPool().Allocate(bytes, &error, &pinned);
  if (data == nullptr) {
    return tensorflow::errors::ResourceExhausted(
        error, " (tensor of shape ", like.shape().DebugString(), ", ", bytes,
        " bytes)");
  }
  auto* buffer = new PoolBuffer(data, bytes, pinned);
  // The tensor takes its own reference; ours goes when this scope ends.
  *parked = tensorflow::Tensor(like.dtype(), like.shape(), buffer);
  buffer->Unref();
  return tensorflow::OkStatus();
}

tensorflow::Status AllocateHost(tensorflow::OpKernelContext* ctx,
                                const tensorflow::Tensor& like,
                                tensorflow::Tensor* host) {
  tensorflow::AllocatorAttributes attributes;
  attributes.set_on_host(true);
  attributes.set_gpu_compatible(true);
  return ctx->allocate_temp(like.dtype(), like.shape(), host, attributes);
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
  return AllocateHost(ctx, like, parked);
}

// size_t throughout so tensors above 4 GiB copy whole.
void CopyBytes(const tensorflow::Tensor& from, tensorflow::Tensor* to) {
  const size_t bytes = from.TotalBytes();
  if (bytes == 0) return;
  std::memcpy(const_cast<char*>(to->tensor_data().data()),
              from.tensor_data().data(), bytes);
}

bool InputInHostMemory(tensorflow::OpKernelContext* ctx, int index) {
  return ctx->input_memory_type(index) == tensorflow::HOST_MEMORY;
}

bool OutputInHostMemory(tensorflow::OpKernelContext* ctx, int index) {
  return ctx->output_memory_type(index) == tensorflow::HOST_MEMORY;
}

// `done` may run the kernel's successors inline, so the copier lets go of
// both buffers first: a source held past it would overlap the next tensors.
void CpuCopier::ToHost(tensorflow::OpKernelContext*, tensorflow::Tensor device,
                       tensorflow::Tensor host, Done done) const {
  CopyBytes(device, &host);
  device = tensorflow::Tensor();
  host = tensorflow::Tensor();
  done(tensorflow::OkStatus());
}

void CpuCopier::ToDevice(tensorflow::OpKernelContext*, tensorflow::Tensor host,
                         tensorflow::Tensor device, Done done) const {
  CopyBytes(host, &device);
  host = tensorflow::Tensor();
  device = tensorflow::Tensor();
  done(tensorflow::OkStatus());
}

void DeviceContextCopier::Prepare(tensorflow::OpKernelContext* ctx) const {
  EnsureDevicePinning(ctx);
}

void DeviceContextCopier::ToHost(tensorflow::OpKernelContext* ctx,
                                 tensorflow::Tensor device,
                                 tensorflow::Tensor host, Done done) const {
  if (device.TotalBytes() == 0) {
    done(tensorflow::OkStatus());
    return;
  }
  tensorflow::DeviceContext* device_context = ctx->op_device_context();
  if (device_context == nullptr) {
    done(tensorflow::errors::Internal("sntf: no device context on ",
                                      ctx->device()->name()));
    return;
  }
  // Heap copies share the buffers: both stay alive until the stream's
  // completion callback, whatever happens to the kernel meanwhile.
  auto* source = new tensorflow::Tensor(std::move(device));
  auto* destination = new tensorflow::Tensor(std::move(host));
  device_context->CopyDeviceTensorToCPU(
      source, "sntf_swap", static_cast<tensorflow::Device*>(ctx->device()),
      destination,
      [source, destination, done](const tensorflow::Status& status) {
        delete source;
        delete destination;
        done(status);
      });
}

void DeviceContextCopier::ToDevice(tensorflow::OpKernelContext* ctx,
                                   tensorflow::Tensor host,
                                   tensorflow::Tensor device,
                                   Done done) const {
  if (host.TotalBytes() == 0) {
    done(tensorflow::OkStatus());
    return;
  }
  tensorflow::DeviceContext* device_context = ctx->op_device_context();
  if (device_context == nullptr) {
    done(tensorflow::errors::Internal("sntf: no device context on ",
                                      ctx->device()->name()));
    return;
  }
  auto* source = new tensorflow::Tensor(std::move(host));
  auto* destination = new tensorflow::Tensor(std::move(device));
  device_context->CopyCPUTensorToDevice(
      source, static_cast<tensorflow::Device*>(ctx->device()), destination,
      [source, destination, done](const tensorflow::Status& status) {
        delete source;
        delete destination;
        done(status);
      },
      /*sync_dst_compute=*/true);
}

}  // namespace sntf
