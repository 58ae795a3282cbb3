// SnCacheOut / SnCacheIn: the run-time tensor cache of Superneurons' unified
// tensor pool.
//
//   ticket = SnCacheOut(x)        budget, uses attrs
//   y      = SnCacheIn(ticket)    one per swap-in window; `uses` of them
//
// SnCacheOut decides at run time whether x needs to leave the device. While
// the device allocator's live bytes plus x stay within `budget`, and the
// device's cached tensors plus x within `headroom`, x is kept: the cache
// holds a reference to the device tensor and SnCacheIn returns it with no
// transfer (a hit). Otherwise the least recently cached tensors of the same
// device are evicted to the host pool until x fits, and x itself is copied
// to the host pool when it still does not (a later miss). The headroom is
// what the plan leaves under the budget (budget - planned peak): the plan
// assumed every swapped tensor gone, so tensors kept within it can raise no
// step of the plan above the budget, wherever the step lies; the live-bytes
// test alone sees only the moment of the swap-out, not the later peak. The small
// int64 ticket is what flows between the two ops; the cache entry goes away
// when its last SnCacheIn has run, so TensorFlow's refcounts still govern the
// buffers' lifetimes.
//
// Allocator statistics are needed for the decision; a device allocator that
// keeps none (TensorFlow's default CPU allocator without
// TF_CPU_ALLOCATOR_USE_BFC) gets the safe behaviour: always copy.
//
// GPU kernels copy with the device context's synchronous copies (the cache
// decision, eviction included, happens under one lock); they are compiled and
// registered, and have not run on a GPU.

#include <climits>
#include <cstdint>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "swap_common.h"
#include "tensorflow/core/common_runtime/device.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace sntf {
namespace {

using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;

// Moves bytes between a device tensor and a host tensor of the same shape.
class Mover {
 public:
  virtual ~Mover() = default;
  virtual Status ToHost(OpKernelContext* ctx, const Tensor& device,
                        Tensor* host) const = 0;
  virtual Status ToDevice(OpKernelContext* ctx, const Tensor& host,
                          Tensor* device) const = 0;
};

class CpuMover : public Mover {
 public:
  Status ToHost(OpKernelContext*, const Tensor& device,
                Tensor* host) const override {
    CopyBytes(device, host);
    return tensorflow::OkStatus();
  }
  Status ToDevice(OpKernelContext*, const Tensor& host,
                  Tensor* device) const override {
    CopyBytes(host, device);
    return tensorflow::OkStatus();
  }
};

class GpuMover : public Mover {
 public:
  GpuMover() { EnableGpuPinning(); }

  Status ToHost(OpKernelContext* ctx, const Tensor& device,
                Tensor* host) const override {
    if (device.TotalBytes() == 0) return tensorflow::OkStatus();
    tensorflow::DeviceContext* dc = ctx->op_device_context();
    if (dc == nullptr) return tensorflow::errors::Internal("no device context");
    return dc->CopyDeviceTensorToCPUSync(
        &device, "sntf_cache", static_cast<tensorflow::Device*>(ctx->device()),
        host);
  }
  Status ToDevice(OpKernelContext* ctx, const Tensor& host,
                  Tensor* device) const override {
    if (host.TotalBytes() == 0) return tensorflow::OkStatus();
    tensorflow::DeviceContext* dc = ctx->op_device_context();
    if (dc == nullptr) return tensorflow::errors::Internal("no device context");
    return dc->CopyCPUTensorToDeviceSync(
        &host, static_cast<tensorflow::Device*>(ctx->device()), device);
  }
};

struct Entry {
  Tensor tensor;        // the device tensor while cached, else its host copy
  bool on_device = false;
  int uses_left = 1;    // SnCacheIn ops still to come
  std::string device;
  std::list<int64_t>::iterator lru;  // position in its device's list
};

class TensorCache {
 public:
  static TensorCache& Get() {
    static TensorCache* cache = new TensorCache();  // never destroyed
    return *cache;
  }

  // Registers x; keeps it on the device when live + x fits the budget and
  // the device's cached bytes + x fit the headroom (negative: no cap),
  // evicting older cached tensors of the device if needed.
  Status Put(OpKernelContext* ctx, const Mover& mover, const Tensor& x,
             int64_t budget, int64_t headroom, int uses, int64_t* ticket) {
    const int64_t bytes = static_cast<int64_t>(x.TotalBytes());
    const std::string device = ctx->device()->name();
    std::optional<int64_t> live = LiveBytes(ctx);
    if (!live.has_value()) Counters().cache_no_stats.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu_);
    Entry entry;
    entry.uses_left = uses;
    entry.device = device;
    if (live.has_value()) {
      int64_t projected = *live + bytes;
      int64_t& cached = cached_bytes_[device];
      const int64_t cap = headroom < 0 ? INT64_MAX : headroom;
      std::list<int64_t>& order = lru_[device];
      while ((projected > budget || cached + bytes > cap) && !order.empty()) {
        Status s = Evict(ctx, mover, order.front());
        if (!s.ok()) return s;
        projected -= evicted_bytes_;
      }
      if (projected <= budget && cached + bytes <= cap) {
        entry.tensor = x;
        entry.on_device = true;
        cached += bytes;
      }
    }
    if (!entry.on_device) {
      Tensor host;
      Status s = AllocateParkedOrHost(ctx, x, &host);
      if (!s.ok()) return s;
      s = mover.ToHost(ctx, x, &host);
      if (!s.ok()) return s;
      entry.tensor = std::move(host);
      Counters().bytes_to_host.fetch_add(bytes);
    }
    *ticket = next_ticket_++;
    if (entry.on_device) {
      std::list<int64_t>& order = lru_[device];
      entry.lru = order.insert(order.end(), *ticket);
    }
    entries_.emplace(*ticket, std::move(entry));
    return tensorflow::OkStatus();
  }

  // Looks a ticket up for one SnCacheIn; the entry is dropped after its
  // last use. Returns the tensor and whether it is the device copy.
  Status Take(int64_t ticket, Tensor* tensor, bool* on_device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(ticket);
    if (it == entries_.end()) {
      return tensorflow::errors::Internal(
          "sntf tensor cache: ticket ", ticket,
          " is unknown (already consumed, or cleared)");
    }
    Entry& entry = it->second;
    *tensor = entry.tensor;
    *on_device = entry.on_device;
    if (entry.on_device) {
      // Recently used: the last to be evicted.
      std::list<int64_t>& order = lru_[entry.device];
      order.splice(order.end(), order, entry.lru);
    }
    if (--entry.uses_left <= 0) Drop(it);
    return tensorflow::OkStatus();
  }

  // Drops every entry (after an aborted step); returns how many there were.
  int64_t Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t n = static_cast<int64_t>(entries_.size());
    entries_.clear();
    lru_.clear();
    cached_bytes_.clear();
    return n;
  }

  void Gauges(int64_t* entries, int64_t* device_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    *entries = static_cast<int64_t>(entries_.size());
    *device_bytes = 0;
    for (const auto& kv : entries_) {
      if (kv.second.on_device) *device_bytes += kv.second.tensor.TotalBytes();
    }
  }

 private:
  static std::optional<int64_t> LiveBytes(OpKernelContext* ctx) {
    tensorflow::Allocator* allocator =
        ctx->device()->GetAllocator(tensorflow::AllocatorAttributes());
    if (allocator == nullptr) return std::nullopt;
    auto stats = allocator->GetStats();
    if (!stats.has_value()) return std::nullopt;
    return stats->bytes_in_use;
  }

  // Moves the cached tensor of `ticket` to the host pool (lock held).
  Status Evict(OpKernelContext* ctx, const Mover& mover, int64_t ticket) {
    Entry& entry = entries_.at(ticket);
    Tensor host;
    Status s = AllocateParkedOrHost(ctx, entry.tensor, &host);
    if (!s.ok()) return s;
    s = mover.ToHost(ctx, entry.tensor, &host);
    if (!s.ok()) return s;
    evicted_bytes_ = static_cast<int64_t>(entry.tensor.TotalBytes());
    Counters().bytes_to_host.fetch_add(evicted_bytes_);
    Counters().cache_evictions.fetch_add(1);
    lru_[entry.device].erase(entry.lru);
    cached_bytes_[entry.device] -= evicted_bytes_;
    entry.tensor = std::move(host);
    entry.on_device = false;
    return tensorflow::OkStatus();
  }

  void Drop(std::unordered_map<int64_t, Entry>::iterator it) {
    if (it->second.on_device) {
      lru_[it->second.device].erase(it->second.lru);
      cached_bytes_[it->second.device] -=
          static_cast<int64_t>(it->second.tensor.TotalBytes());
    }
    entries_.erase(it);
  }

  std::mutex mu_;
  std::unordered_map<int64_t, Entry> entries_;
  std::unordered_map<std::string, std::list<int64_t>> lru_;  // oldest first
  // Bytes of each device's tensors kept on it by the cache.
  std::unordered_map<std::string, int64_t> cached_bytes_;
  int64_t next_ticket_ = 1;
  int64_t evicted_bytes_ = 0;
};

#define SNTF_CACHE_TYPES                                                   \
  "T: {bfloat16, half, float, double, int8, int16, int32, int64, uint8, "  \
  "uint16, uint32, uint64, bool, complex64, complex128, qint8, quint8, "    \
  "qint16, quint16, qint32}"

REGISTER_OP("SnCacheOut")
    .Input("x: T")
    .Output("ticket: int64")
    .Attr(SNTF_CACHE_TYPES)
    .Attr("budget: int")
    .Attr("headroom: int = -1")
    .Attr("uses: int = 1")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
Hands `x` to sntf's tensor cache: kept on the device while the device
allocator's live bytes plus `x` fit `budget` and the device's cached tensors
plus `x` fit `headroom` (negative: no cap), else parked in the host pool
(evicting older cached tensors first). `uses` SnCacheIn ops will read it back.
)doc");

REGISTER_OP("SnCacheIn")
    .Input("ticket: int64")
    .Output("y: T")
    .Attr(SNTF_CACHE_TYPES)
    .Attr("shape: shape")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::PartialTensorShape shape;
      TF_RETURN_IF_ERROR(c->GetAttr("shape", &shape));
      tensorflow::shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shape, &out));
      c->set_output(0, out);
      return tensorflow::OkStatus();
    })
    .Doc(R"doc(
Returns the tensor a SnCacheOut registered: the device copy when it is still
cached (no transfer), else a copy from the host pool.
)doc");

#undef SNTF_CACHE_TYPES

template <typename MoverT>
class SnCacheOutOp : public tensorflow::OpKernel {
 public:
  explicit SnCacheOutOp(tensorflow::OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("budget", &budget_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("headroom", &headroom_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("uses", &uses_));
    OP_REQUIRES(ctx, uses_ >= 1,
                tensorflow::errors::InvalidArgument("uses must be >= 1, got ",
                                                    uses_));
  }

  void Compute(OpKernelContext* ctx) override {
    int64_t ticket = 0;
    Status s = TensorCache::Get().Put(ctx, mover_, ctx->input(0), budget_,
                                      headroom_, uses_, &ticket);
    if (!s.ok()) Counters().failed_ops.fetch_add(1);
    OP_REQUIRES_OK(ctx, s);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    out->scalar<int64_t>()() = ticket;
    Counters().swap_out_ops.fetch_add(1);
  }

 private:
  MoverT mover_;
  int64_t budget_ = 0;
  int64_t headroom_ = -1;
  int uses_ = 1;
};

template <typename MoverT>
class SnCacheInOp : public tensorflow::OpKernel {
 public:
  explicit SnCacheInOp(tensorflow::OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &dtype_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int64_t ticket = ctx->input(0).scalar<int64_t>()();
    Tensor stored;
    bool on_device = false;
    OP_REQUIRES_OK(ctx, TensorCache::Get().Take(ticket, &stored, &on_device));
    OP_REQUIRES(ctx, stored.dtype() == dtype_,
                tensorflow::errors::Internal(
                    "sntf tensor cache: ticket ", ticket, " holds ",
                    tensorflow::DataTypeString(stored.dtype()), ", expected ",
                    tensorflow::DataTypeString(dtype_)));
    Counters().swap_in_ops.fetch_add(1);
    if (on_device) {
      Counters().cache_hits.fetch_add(1);
      ctx->set_output(0, stored);
      return;
    }
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, stored.shape(), &y));
    Status s = mover_.ToDevice(ctx, stored, y);
    if (!s.ok()) Counters().failed_ops.fetch_add(1);
    OP_REQUIRES_OK(ctx, s);
    Counters().cache_misses.fetch_add(1);
    Counters().bytes_to_device.fetch_add(stored.TotalBytes());
  }

 private:
  MoverT mover_;
  tensorflow::DataType dtype_;
};

REGISTER_KERNEL_BUILDER(Name("SnCacheOut").Device(tensorflow::DEVICE_CPU),
                        SnCacheOutOp<CpuMover>);
REGISTER_KERNEL_BUILDER(Name("SnCacheIn").Device(tensorflow::DEVICE_CPU),
                        SnCacheInOp<CpuMover>);
REGISTER_KERNEL_BUILDER(Name("SnCacheOut")
                            .Device(tensorflow::DEVICE_GPU)
                            .HostMemory("ticket"),
                        SnCacheOutOp<GpuMover>);
REGISTER_KERNEL_BUILDER(Name("SnCacheIn")
                            .Device(tensorflow::DEVICE_GPU)
                            .HostMemory("ticket"),
                        SnCacheInOp<GpuMover>);

}  // namespace
}  // namespace sntf

extern "C" {

// Drops every cache entry (their buffers go back when no tensor holds them);
// returns how many there were.
__attribute__((visibility("default"))) int64_t sntf_cache_clear() {
  return sntf::TensorCache::Get().Clear();
}

// out[0] = live entries, out[1] = bytes of the entries kept on a device.
__attribute__((visibility("default"))) int sntf_cache_gauges(int64_t* out,
                                                             int n) {
  if (out == nullptr || n < 2) return 0;
  sntf::TensorCache::Get().Gauges(&out[0], &out[1]);
  return 2;
}

}  // extern "C"
