// See cuda_runtime_pinning.h. No CUDA headers or link dependency: the three
// entry points are found with dlsym.
#include "cuda_runtime_pinning.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

namespace sntf {
namespace {

using RegisterFn = int (*)(void*, size_t, unsigned int);
using UnregisterFn = int (*)(void*);
using GetLastErrorFn = int (*)();

// cudaHostRegisterPortable: the pages count as pinned in every CUDA
// context, as StreamExecutor's own registration (CU_MEMHOSTREGISTER_PORTABLE)
// makes them.
constexpr unsigned int kCudaHostRegisterPortable = 1;

struct CudaRuntime {
  RegisterFn host_register = nullptr;
  UnregisterFn host_unregister = nullptr;
  GetLastErrorFn get_last_error = nullptr;
  std::string library;
  std::string error;  // why the lookup failed
};

// A runtime another library (TensorFlow, PyTorch) already loaded comes
// first, so the pool registers with the runtime those copies use.
void* OpenRuntime(std::string* library) {
  const char* explicit_library = std::getenv(kCudaRuntimeEnv);
  if (explicit_library != nullptr && *explicit_library != '\0') {
    *library = explicit_library;
    return dlopen(explicit_library, RTLD_NOW | RTLD_LOCAL);
  }
  const char* names[] = {"libcudart.so.13", "libcudart.so.12",
                         "libcudart.so.11.0", "libcudart.so"};
  for (const char* name : names) {
    if (void* handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) {
      *library = name;
      return handle;
    }
  }
  for (const char* name : names) {
    if (void* handle = dlopen(name, RTLD_NOW | RTLD_LOCAL)) {
      *library = name;
      return handle;
    }
  }
  *library = "libcudart.so";
  return nullptr;
}

CudaRuntime LookUp() {
  CudaRuntime runtime;
  void* handle = OpenRuntime(&runtime.library);
  if (handle == nullptr) {
    const char* why = dlerror();
    runtime.error = "no CUDA runtime could be loaded (" + runtime.library +
                    "): " + (why != nullptr ? why : "unknown dlopen error");
    return runtime;
  }
  runtime.host_register =
      reinterpret_cast<RegisterFn>(dlsym(handle, "cudaHostRegister"));
  runtime.host_unregister =
      reinterpret_cast<UnregisterFn>(dlsym(handle, "cudaHostUnregister"));
  runtime.get_last_error =
      reinterpret_cast<GetLastErrorFn>(dlsym(handle, "cudaGetLastError"));
  if (runtime.host_register == nullptr || runtime.host_unregister == nullptr ||
      runtime.get_last_error == nullptr) {
    runtime.error = runtime.library +
                    " lacks cudaHostRegister, cudaHostUnregister or "
                    "cudaGetLastError";
    runtime.host_register = nullptr;
  }
  return runtime;
}

const CudaRuntime& Runtime() {
  static const CudaRuntime* runtime = new CudaRuntime(LookUp());  // leaked
  return *runtime;
}

int Register(void* base, uint64_t bytes) {
  const CudaRuntime& runtime = Runtime();
  const int result = runtime.host_register(base, static_cast<size_t>(bytes),
                                           kCudaHostRegisterPortable);
  // The runtime keeps a failed call's code as its "last error" until it is
  // read; TensorFlow's kernels read it after each launch and would fail.
  if (result != 0) runtime.get_last_error();
  return result;
}

void Unregister(void* base) {
  const CudaRuntime& runtime = Runtime();
  if (runtime.host_unregister(base) != 0) runtime.get_last_error();
}

}  // namespace

bool CudaRuntimePinHooks(PinHooks* hooks, std::string* error) {
  const CudaRuntime& runtime = Runtime();
  if (runtime.host_register == nullptr) {
    if (error != nullptr) *error = runtime.error;
    return false;
  }
  hooks->pin = &Register;
  hooks->unpin = &Unregister;
  return true;
}

std::string CudaRuntimeLibrary() {
  const CudaRuntime& runtime = Runtime();
  return runtime.host_register != nullptr ? runtime.library : "";
}

}  // namespace sntf

extern "C" {

// Pins `pool` (a handle from sntf_pool_new / sntf_pool_global) through the
// CUDA runtime. Returns 1 on success, 0 with a message in err otherwise.
__attribute__((visibility("default"))) int sntf_pool_pin_with_cuda_runtime(
    void* pool, char* err, uint64_t err_len) {
  if (err != nullptr && err_len > 0) err[0] = '\0';
  if (pool == nullptr) return 0;
  try {
    sntf::PinHooks hooks;
    std::string error;
    if (!sntf::CudaRuntimePinHooks(&hooks, &error)) {
      if (err != nullptr && err_len > 0) {
        const size_t n = std::min<size_t>(error.size(), err_len - 1);
        std::memcpy(err, error.data(), n);
        err[n] = '\0';
      }
      return 0;
    }
    static_cast<sntf::HostPool*>(pool)->SetPinHooks(std::move(hooks));
    return 1;
  } catch (...) {
    return 0;
  }
}

}  // extern "C"
