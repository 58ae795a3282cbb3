// Page-locking the host pool through the CUDA runtime, found at run time.
//
// TensorFlow-free on purpose: the standalone harness (benchmarks/) pins a
// pool with it on machines that have CUDA but no TensorFlow, and tests load
// a stub runtime through the same lookup. Inside TensorFlow the op library
// pins through the device's StreamExecutor instead (gpu_pinning.cc), which
// activates the device's own context for each call.
#ifndef SNTF_TF_OPS_CUDA_RUNTIME_PINNING_H_
#define SNTF_TF_OPS_CUDA_RUNTIME_PINNING_H_

#include <string>

#include "host_pool.h"

namespace sntf {

// Environment variable naming the CUDA runtime library to use (a path or a
// soname); unset: a runtime already loaded in the process, else the first
// libcudart.so.* the dynamic loader finds.
constexpr char kCudaRuntimeEnv[] = "SNTF_CUDART_LIBRARY";

// Fills *hooks with cudaHostRegister(portable) / cudaHostUnregister of the
// runtime the lookup finds (once per process; later calls reuse it). After a
// refused call the hooks clear the runtime's last error with
// cudaGetLastError, so the refusal does not surface as the error of an
// unrelated later kernel launch. Returns false with *error when no complete
// runtime is found.
bool CudaRuntimePinHooks(PinHooks* hooks, std::string* error);

// Path (or soname) of the runtime the lookup loaded; "" before a successful
// lookup.
std::string CudaRuntimeLibrary();

}  // namespace sntf

#endif  // SNTF_TF_OPS_CUDA_RUNTIME_PINNING_H_
