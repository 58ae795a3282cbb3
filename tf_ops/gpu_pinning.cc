// Page-locked host pool on GPU machines.
//
// The first time a GPU kernel of sntf's ops runs, the host pool is given pin
// hooks that register its regions through the StreamExecutor of that
// kernel's device: stream->parent()->HostMemoryRegister(), TensorFlow's own
// path to cuMemHostRegister. The executor activates its device's context for
// each call, so pinning never depends on which context (if any) the calling
// thread has current, and a refused registration is returned as `false`
// rather than left behind as the CUDA runtime's last error. StreamExecutor
// registers with CU_MEMHOSTREGISTER_PORTABLE, so one executor's
// registration serves every GPU. Kernel constructors never pin: they run
// where no device stream is at hand.
//
// The pool pins regions only up to its pin cap (HostPool::DefaultPinLimit,
// SNTF_HOST_PIN_LIMIT) and never under its mutex. This has not run on a GPU;
// the pool's side of it runs on CPU with injected hooks and with a stub CUDA
// runtime (tests/test_host_pool.py).

#include <atomic>
#include <cstdint>
#include <mutex>

#include "host_pool.h"
#include "swap_common.h"
#include "tensorflow/core/framework/device_base.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"

namespace sntf {
namespace {

// 0: no GPU kernel has run; 1: pinning through a StreamExecutor; -1: a GPU
// kernel ran but its device exposed no stream executor.
std::atomic<int> g_state{0};

stream_executor::StreamExecutor* ExecutorOf(tensorflow::OpKernelContext* ctx) {
  const tensorflow::DeviceBase::AcceleratorDeviceInfo* info =
      ctx->device()->tensorflow_accelerator_device_info();
  if (info == nullptr || info->stream == nullptr) return nullptr;
  return info->stream->parent();
}

PinHooks ExecutorHooks(stream_executor::StreamExecutor* executor) {
  PinHooks hooks;
  hooks.pin = [executor](void* base, uint64_t bytes) {
    return executor->HostMemoryRegister(base, bytes) ? 0 : 1;
  };
  hooks.unpin = [executor](void* base) {
    executor->HostMemoryUnregister(base);
  };
  return hooks;
}

void PinThroughDevice(tensorflow::OpKernelContext* ctx) {
  stream_executor::StreamExecutor* executor = ExecutorOf(ctx);
  if (executor == nullptr) {
    g_state = -1;
    return;
  }
  GlobalHostPool().SetPinHooks(ExecutorHooks(executor));
  g_state = 1;
}

}  // namespace

void EnsureDevicePinning(tensorflow::OpKernelContext* ctx) {
  static std::once_flag once;
  std::call_once(once, PinThroughDevice, ctx);
}

}  // namespace sntf

extern "C" {

// 0: no GPU kernel of sntf's ops has run; 1: the host pool is page-locked
// through a device's StreamExecutor; -1: a GPU kernel ran but its device
// exposed no stream executor, so the pool stays pageable.
__attribute__((visibility("default"))) int sntf_gpu_pinning() {
  return sntf::g_state.load();
}

}  // extern "C"
