// SnCacheOut / SnCacheIn: the run-time tensor cache of Superneurons' unified
// tensor pool.
//
//   ticket = SnCacheOut(x)        budget, headroom, uses attrs
//   y      = SnCacheIn(ticket)    one per swap-in window; `uses` of them
//
// SnCacheOut decides at run time whether x needs to leave the device. While
// the device allocator's live bytes (x already among them) stay within
// `budget`, and the device's cached tensors plus x within `headroom`, x is
// kept: the cache holds a reference to the device tensor and SnCacheIn
// returns it with no transfer (a hit). Otherwise the least recently cached
// tensors of the device are evicted to the host pool, and x itself is copied
// to the host pool when it still does not fit (a later miss). The headroom is
// what the plan leaves under the budget (budget - planned peak): the plan
// assumed every swapped tensor gone, so tensors kept within it can raise no
// step of the plan above the budget; the live-bytes test alone sees only the
// moment of the swap-out, not the later peak. Only evicting a tensor the
// cache alone holds frees device memory, so only those count against the
// budget (cache_core.h).
//
// On a GPU both kernels are asynchronous, like SnSwapOut and TensorFlow's
// _CopyFromGpuToHost: the decision is taken under the device's own lock
// (cache_core.h), the copies are issued after it is released and complete on
// the copier's stream; no kernel blocks an executor thread on a copy, and
// devices never contend for one lock. The default CPU kernels run the same
// bodies synchronously (their copier is a memcpy; see SyncKernel).
//
// The ticket is a scalar int64 whose buffer owns the cache entry: when the
// last tensor holding the ticket goes (all reads done, or the step failed
// and TensorFlow dropped its tensors), the entry and its buffers go too.
// Failed steps therefore leave nothing behind. A ticket carries the index of
// the device that issued it; read on another device it is an error, never
// that device's pointer.
//
// Allocator statistics are needed for the decision; a device allocator that
// keeps none (TensorFlow's default CPU allocator without
// TF_CPU_ALLOCATOR_USE_BFC) gets the safe behaviour: always copy.
//
// The GPU kernels are compiled and registered and have not run on a GPU; the
// same kernel code runs on CPU in tests with the delayed test copier (kernel
// label "sntf_async_test").

#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <utility>

#include "cache_core.h"
#include "swap_common.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/tensor_shape.pb.h"

namespace sntf {
namespace {

using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;

struct TensorTraits {
  static uint64_t Bytes(const Tensor& t) { return t.TotalBytes(); }
  static bool SoleOwner(const Tensor& t) { return t.RefCountIsOne(); }
};

using Registry = CacheRegistry<Tensor, TensorTraits>;
using DeviceCache = Registry::Cache;

Registry& Caches() {
  static Registry* registry = new Registry();  // never destroyed
  return *registry;
}

// The ticket's buffer: its destruction releases the cache entry. It does not
// own memory in TensorFlow's sense, so no kernel forwards it as an output
// buffer and overwrites the ticket.
class TicketBuffer : public tensorflow::TensorBuffer {
 public:
  explicit TicketBuffer(int64_t ticket)
      : TensorBuffer(&value_), value_(ticket), ticket_(ticket) {}
  ~TicketBuffer() override { Caches().Release(ticket_); }

  size_t size() const override { return sizeof(value_); }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(
      tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(sizeof(value_));
    proto->set_allocated_bytes(sizeof(value_));
    proto->set_allocator_name("sntf_cache_ticket");
  }
  bool OwnsMemory() const override { return false; }
  tensorflow::AllocatorMemoryType GetMemoryType() const override {
    return tensorflow::AllocatorMemoryType::kHostPageable;
  }

 private:
  alignas(64) int64_t value_;  // Eigen maps assume 64-byte alignment
  const int64_t ticket_;
};

Tensor TicketTensor(int64_t ticket) {
  auto* buffer = new TicketBuffer(ticket);
  Tensor tensor(tensorflow::DT_INT64, tensorflow::TensorShape({}), buffer);
  buffer->Unref();  // the tensor holds its own reference
  return tensor;
}

// The device allocator's bytes in use; -1 when it keeps no statistics.
int64_t LiveBytes(OpKernelContext* ctx) {
  tensorflow::Allocator* allocator =
      ctx->device()->GetAllocator(tensorflow::AllocatorAttributes());
  if (allocator == nullptr) return -1;
  auto stats = allocator->GetStats();
  if (!stats.has_value()) return -1;
  return stats->bytes_in_use;
}

// SnCacheIn's `shape` attr as a PartialTensorShape. Grappler's static shape
// inference marks symbolic dimensions with values below -1 (-2, -3, ...),
// and a rewrite may copy them into the attr; they mean "unknown", as -1 does.
Status ShapeFromAttr(const tensorflow::TensorShapeProto& proto,
                     tensorflow::PartialTensorShape* shape) {
  tensorflow::TensorShapeProto normalized = proto;
  for (auto& dim : *normalized.mutable_dim()) {
    if (dim.size() < -1) dim.set_size(-1);
  }
  return tensorflow::PartialTensorShape::BuildPartialTensorShape(normalized,
                                                                 shape);
}

// Calls `finish` with the first error once `count` reports have come in.
class CopyJoin {
 public:
  CopyJoin(int count, std::function<void(const Status&)> finish)
      : pending_(count), finish_(std::move(finish)) {}

  void Report(const Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!status.ok() && status_.ok()) status_ = status;
      if (--pending_ > 0) return;
    }
    finish_(status_);
    delete this;
  }

 private:
  std::mutex mu_;
  int pending_;
  Status status_;
  std::function<void(const Status&)> finish_;
};

#define SNTF_CACHE_TYPES SNTF_SWAP_TYPES

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
allocator's live bytes (x included) fit `budget` and the device's cached
tensors plus `x` fit `headroom` (negative: no cap), else parked in the host
pool (evicting older cached tensors first). `uses` SnCacheIn ops will read it
back; the entry lives no longer than the ticket.
)doc");

REGISTER_OP("SnCacheIn")
    .Input("ticket: int64")
    .Output("y: T")
    .Attr(SNTF_CACHE_TYPES)
    .Attr("shape: shape")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle scalar;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &scalar));
      tensorflow::TensorShapeProto proto;
      TF_RETURN_IF_ERROR(c->GetAttr("shape", &proto));
      tensorflow::PartialTensorShape shape;
      TF_RETURN_IF_ERROR(ShapeFromAttr(proto, &shape));
      tensorflow::shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shape, &out));
      c->set_output(0, out);
      return tensorflow::OkStatus();
    })
    .Doc(R"doc(
Returns the tensor a SnCacheOut registered: the device copy when it is still
cached (no transfer), else a copy from the host pool. `ticket` must be a
scalar issued on the same device.
)doc");

#undef SNTF_CACHE_TYPES

template <typename CopierT>
class CacheOutBody {
 public:
  explicit CacheOutBody(tensorflow::OpKernelConstruction* ctx)
      : cache_(Caches().ForDevice(ctx->device()->name())) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("budget", &budget_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("headroom", &headroom_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("uses", &uses_));
    OP_REQUIRES(ctx, uses_ >= 1,
                tensorflow::errors::InvalidArgument("uses must be >= 1, got ",
                                                    uses_));
    OP_REQUIRES(ctx, cache_ != nullptr,
                tensorflow::errors::ResourceExhausted(
                    "sntf tensor cache: more than ", kMaxCacheDevices,
                    " devices"));
  }

  void Run(OpKernelContext* ctx, KernelDone done) {
    copier_.Prepare(ctx);
    const Tensor& x = ctx->input(0);
    if (InputInHostMemory(ctx, 0)) {
      // Nothing on the device to keep or free: the ticket holds x as is.
      Counters().host_memory_passthrough.fetch_add(1);
      Counters().swap_out_ops.fetch_add(1);
      ctx->set_output(0, TicketTensor(cache_->PutHost(x, uses_)));
      done();
      return;
    }
    const int64_t live = LiveBytes(ctx);
    if (live < 0) Counters().cache_no_stats.fetch_add(1);
    DeviceCache::Decision decision =
        cache_->Put(x, live, budget_, headroom_, uses_);
    // From here the ticket tensor owns the entry: on any failure below it
    // dies with the callbacks, and the entry with it.
    Tensor ticket = TicketTensor(decision.ticket);
    const int copies =
        static_cast<int>(decision.victims.size()) + (decision.keep ? 0 : 1);
    auto* join = new CopyJoin(
        copies + 1, [ctx, ticket, done](const Status& status) {
          if (status.ok()) {
            ctx->set_output(0, ticket);
            Counters().swap_out_ops.fetch_add(1);
          } else {
            Counters().failed_ops.fetch_add(1);
            ctx->SetStatus(status);
          }
          done();
        });
    for (DeviceCache::Victim& victim : decision.victims) {
      Evict(ctx, std::move(victim), join);
    }
    if (!decision.keep) Park(ctx, x, decision.ticket, join);
    join->Report(tensorflow::OkStatus());  // everything is issued
  }

 private:
  // Copies an evicted tensor to the host; the cache swaps it in on success
  // and caches the device tensor again on failure.
  void Evict(OpKernelContext* ctx, DeviceCache::Victim victim,
             CopyJoin* join) {
    Tensor host;
    Status status = AllocateParkedOrHost(ctx, victim.device, &host);
    if (!status.ok()) {
      cache_->FinishEviction(victim.ticket, false, Tensor(), victim.freed);
      join->Report(status);
      return;
    }
    DeviceCache* cache = cache_;
    const int64_t ticket = victim.ticket;
    const int64_t freed = victim.freed;
    const uint64_t bytes = victim.device.TotalBytes();
    copier_.ToHost(ctx, std::move(victim.device), host,
                   [cache, ticket, freed, bytes, host,
                    join](const Status& s) {
                     cache->FinishEviction(ticket, s.ok(), host, freed);
                     if (s.ok()) {
                       Counters().cache_evictions.fetch_add(1);
                       Counters().bytes_to_host.fetch_add(bytes);
                     }
                     join->Report(s);
                   });
  }

  // Copies x to the host: its entry is a later miss.
  void Park(OpKernelContext* ctx, const Tensor& x, int64_t ticket,
            CopyJoin* join) {
    Tensor host;
    Status status = AllocateParked(x, &host);
    if (!status.ok()) {
      NotePoolFallback(status);
      if (copier_.DeviceIsHost()) {
        // Device memory is host memory: holding x itself costs nothing more.
        cache_->FinishParking(ticket, true, x);
        join->Report(tensorflow::OkStatus());
        return;
      }
      status = AllocateHost(ctx, x, &host);
    }
    if (!status.ok()) {
      join->Report(status);
      return;
    }
    DeviceCache* cache = cache_;
    const uint64_t bytes = x.TotalBytes();
    copier_.ToHost(ctx, x, host,
                   [cache, ticket, bytes, host, join](const Status& s) {
                     cache->FinishParking(ticket, s.ok(), host);
                     if (s.ok()) Counters().bytes_to_host.fetch_add(bytes);
                     join->Report(s);
                   });
  }

  CopierT copier_;
  DeviceCache* const cache_;
  int64_t budget_ = 0;
  int64_t headroom_ = -1;
  int uses_ = 1;
};

template <typename CopierT>
class CacheInBody {
 public:
  explicit CacheInBody(tensorflow::OpKernelConstruction* ctx)
      : cache_(Caches().ForDevice(ctx->device()->name())) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &dtype_));
    tensorflow::TensorShapeProto shape;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shape", &shape));
    OP_REQUIRES_OK(ctx, ShapeFromAttr(shape, &shape_));
    OP_REQUIRES(ctx, cache_ != nullptr,
                tensorflow::errors::ResourceExhausted(
                    "sntf tensor cache: more than ", kMaxCacheDevices,
                    " devices"));
  }

  void Run(OpKernelContext* ctx, KernelDone done) {
    copier_.Prepare(ctx);
    Tensor stored;
    bool on_device = false;
    OP_REQUIRES_OK_ASYNC(ctx, Lookup(ctx, &stored, &on_device), done);
    Counters().swap_in_ops.fetch_add(1);
    if (on_device) {
      Counters().cache_hits.fetch_add(1);
      ctx->set_output(0, stored);
      done();
      return;
    }
    if (OutputInHostMemory(ctx, 0)) {
      // The consumer reads host memory: no round trip through the device.
      Counters().host_memory_passthrough.fetch_add(1);
      ctx->set_output(0, stored);
      done();
      return;
    }
    Tensor* y = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, stored.shape(), &y),
                         done);
    const uint64_t bytes = stored.TotalBytes();
    copier_.ToDevice(ctx, stored, *y, [ctx, bytes, done](const Status& s) {
      if (s.ok()) {
        Counters().cache_misses.fetch_add(1);
        Counters().bytes_to_device.fetch_add(bytes);
      } else {
        Counters().failed_ops.fetch_add(1);
        ctx->SetStatus(s);
      }
      done();
    });
  }

 private:
  // Reads the ticket once: its tensor, and whether that is the device copy.
  Status Lookup(OpKernelContext* ctx, Tensor* stored, bool* on_device) {
    const Tensor& ticket_tensor = ctx->input(0);
    if (!tensorflow::TensorShapeUtils::IsScalar(ticket_tensor.shape())) {
      return tensorflow::errors::InvalidArgument(
          "SnCacheIn: the ticket must be a scalar (the output of SnCacheOut), "
          "got shape ",
          ticket_tensor.shape().DebugString());
    }
    const int64_t ticket = ticket_tensor.scalar<int64_t>()();
    std::string owner;
    const TakeResult result = Caches().Take(cache_, ticket, stored, &owner);
    TF_RETURN_IF_ERROR(CheckFound(result, ticket, owner));
    *on_device = result == TakeResult::kDevice;
    return CheckMatches(*stored, ticket);
  }

  Status CheckFound(TakeResult result, int64_t ticket,
                    const std::string& owner) const {
    switch (result) {
      case TakeResult::kMissing:
        return tensorflow::errors::InvalidArgument(
            "sntf tensor cache: ticket ", ticket,
            " is unknown (already consumed, released with its step, or "
            "cleared)");
      case TakeResult::kOtherDevice:
        return tensorflow::errors::InvalidArgument(
            "sntf tensor cache: ticket ", ticket, " was issued on ", owner,
            " and cannot be read on ", cache_->device());
      case TakeResult::kNotReady:
        return tensorflow::errors::FailedPrecondition(
            "sntf tensor cache: ticket ", ticket,
            " is read before its SnCacheOut finished");
      default:
        return tensorflow::OkStatus();
    }
  }

  Status CheckMatches(const Tensor& stored, int64_t ticket) const {
    if (stored.dtype() != dtype_) {
      return tensorflow::errors::InvalidArgument(
          "sntf tensor cache: ticket ", ticket, " holds ",
          tensorflow::DataTypeString(stored.dtype()), ", expected ",
          tensorflow::DataTypeString(dtype_));
    }
    if (!shape_.IsCompatibleWith(stored.shape())) {
      return tensorflow::errors::InvalidArgument(
          "sntf tensor cache: ticket ", ticket, " holds shape ",
          stored.shape().DebugString(), ", expected ", shape_.DebugString());
    }
    return tensorflow::OkStatus();
  }

  CopierT copier_;
  DeviceCache* const cache_;
  tensorflow::DataType dtype_;
  tensorflow::PartialTensorShape shape_;
};

using tensorflow::DEVICE_CPU;
using tensorflow::DEVICE_GPU;

template <typename CopierT>
using SnCacheOutOp = AsyncKernel<CacheOutBody<CopierT>>;
template <typename CopierT>
using SnCacheInOp = AsyncKernel<CacheInBody<CopierT>>;

REGISTER_KERNEL_BUILDER(Name("SnCacheOut").Device(DEVICE_CPU),
                        SyncKernel<CacheOutBody<CpuCopier>>);
REGISTER_KERNEL_BUILDER(Name("SnCacheIn").Device(DEVICE_CPU),
                        SyncKernel<CacheInBody<CpuCopier>>);

// GPU: the ticket in host memory; int32, which TensorFlow keeps in host
// memory on a GPU, is held as it is and handed back without a copy. The
// test-only CPU kernels (label kAsyncTestLabel, delayed copier) are
// registered the same way, so that tests run the GPU kernels' code paths.
#define SNTF_REGISTER_CACHE_KERNELS(builder, Copier)                       \
  REGISTER_KERNEL_BUILDER(builder("SnCacheOut")                            \
                              .TypeConstraint("T", SNTF_DEVICE_MEMORY_TYPES) \
                              .HostMemory("ticket"),                       \
                          SnCacheOutOp<Copier>);                           \
  REGISTER_KERNEL_BUILDER(builder("SnCacheOut")                            \
                              .TypeConstraint<int32_t>("T")                \
                              .HostMemory("x")                             \
                              .HostMemory("ticket"),                       \
                          SnCacheOutOp<Copier>);                           \
  REGISTER_KERNEL_BUILDER(builder("SnCacheIn")                             \
                              .TypeConstraint("T", SNTF_DEVICE_MEMORY_TYPES) \
                              .HostMemory("ticket"),                       \
                          SnCacheInOp<Copier>);                            \
  REGISTER_KERNEL_BUILDER(builder("SnCacheIn")                             \
                              .TypeConstraint<int32_t>("T")                \
                              .HostMemory("ticket")                        \
                              .HostMemory("y"),                            \
                          SnCacheInOp<Copier>)

#define SNTF_GPU_KERNEL(op) Name(op).Device(DEVICE_GPU)
#define SNTF_ASYNC_TEST_KERNEL(op) \
  Name(op).Device(DEVICE_CPU).Label(kAsyncTestLabel)

SNTF_REGISTER_CACHE_KERNELS(SNTF_GPU_KERNEL, DeviceContextCopier);
SNTF_REGISTER_CACHE_KERNELS(SNTF_ASYNC_TEST_KERNEL, DelayedTestCopier);

#undef SNTF_REGISTER_CACHE_KERNELS
#undef SNTF_GPU_KERNEL
#undef SNTF_ASYNC_TEST_KERNEL

}  // namespace
}  // namespace sntf

extern "C" {

// Drops every cache entry (their buffers go back when no tensor holds them);
// returns how many there were.
__attribute__((visibility("default"))) int64_t sntf_cache_clear() {
  try {
    return sntf::Caches().Clear();
  } catch (...) {
    return 0;
  }
}

// out[0] = live entries, out[1] = bytes of the entries kept on a device.
__attribute__((visibility("default"))) int sntf_cache_gauges(int64_t* out,
                                                             int n) {
  if (out == nullptr || n < 2) return 0;
  sntf::Caches().Gauges(&out[0], &out[1]);
  return 2;
}

}  // extern "C"
