// Page-locked host pool on GPU machines: when a GPU kernel of the swap ops is
// constructed, the CUDA runtime that TensorFlow loaded is looked up and every
// region of the host pool is registered with cudaHostRegister (and
// unregistered before it is unmapped), so device<->host copies of parked
// tensors run at pinned-memory speed and asynchronously.
//
// No CUDA headers or link dependency: the two entry points are found with
// dlsym in the already-loaded runtime. If none is loaded, the pool stays
// pageable and sntf_gpu_pinning() says so. This has not run on a GPU; the
// pool's hook logic is exercised on CPU with injected hooks
// (sntf_pool_set_pin_hooks).

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "host_pool.h"
#include "swap_common.h"

namespace sntf {
namespace {

using RegisterFn = int (*)(void*, size_t, unsigned int);
using UnregisterFn = int (*)(void*);

RegisterFn g_register = nullptr;
UnregisterFn g_unregister = nullptr;
std::atomic<int> g_state{0};  // 0: not tried, 1: pinning, -1: no CUDA runtime

constexpr unsigned int kCudaHostRegisterPortable = 1;

int Pin(void* base, uint64_t bytes) {
  return g_register(base, static_cast<size_t>(bytes), kCudaHostRegisterPortable);
}

void Unpin(void* base) { g_unregister(base); }

void* LoadedCudaRuntime() {
  const char* names[] = {"libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0",
                         "libcudart.so"};
  for (const char* name : names) {
    // RTLD_NOLOAD: only a runtime TensorFlow already loaded.
    if (void* handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) return handle;
  }
  return nullptr;
}

void TryEnable() {
  void* handle = LoadedCudaRuntime();
  void* reg = handle ? dlsym(handle, "cudaHostRegister")
                     : dlsym(RTLD_DEFAULT, "cudaHostRegister");
  void* unreg = handle ? dlsym(handle, "cudaHostUnregister")
                       : dlsym(RTLD_DEFAULT, "cudaHostUnregister");
  if (reg == nullptr || unreg == nullptr) {
    g_state = -1;
    return;
  }
  g_register = reinterpret_cast<RegisterFn>(reg);
  g_unregister = reinterpret_cast<UnregisterFn>(unreg);
  PinHooks hooks;
  hooks.pin = &Pin;
  hooks.unpin = &Unpin;
  GlobalHostPool().SetPinHooks(hooks);
  g_state = 1;
}

}  // namespace

void EnableGpuPinning() {
  static std::once_flag once;
  std::call_once(once, TryEnable);
}

}  // namespace sntf

extern "C" {

// 0: no GPU swap kernel built yet; 1: the host pool is page-locked through
// the CUDA runtime; -1: a GPU kernel was built but no CUDA runtime was found.
__attribute__((visibility("default"))) int sntf_gpu_pinning() {
  return sntf::g_state.load();
}

}  // extern "C"
