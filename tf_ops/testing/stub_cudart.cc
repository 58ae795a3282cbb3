// A stand-in for the CUDA runtime's page-locking entry points, for tests and
// the sanitizer harness: it records every call, refuses registrations above
// STUB_CUDART_REFUSE_ABOVE bytes (env, read per call) with
// cudaErrorMemoryAllocation, and keeps that code as the "last error" until
// cudaGetLastError reads it, as the real runtime does.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace {
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorMemoryAllocation = 2;
constexpr int kCudaErrorHostMemoryNotRegistered = 713;

std::atomic<uint64_t> g_registers{0};
std::atomic<uint64_t> g_refusals{0};
std::atomic<uint64_t> g_unregisters{0};
std::atomic<uint64_t> g_last_error_reads{0};
std::atomic<uint64_t> g_registered_bytes{0};
std::atomic<unsigned int> g_last_flags{0};
std::atomic<int> g_last_error{kCudaSuccess};

uint64_t RefuseAbove() {
  const char* env = std::getenv("STUB_CUDART_REFUSE_ABOVE");
  return env == nullptr ? ~uint64_t{0} : std::strtoull(env, nullptr, 10);
}
}  // namespace

extern "C" {

__attribute__((visibility("default"))) int cudaHostRegister(void* ptr,
                                                            size_t bytes,
                                                            unsigned int flags) {
  g_last_flags = flags;
  if (ptr == nullptr || bytes > RefuseAbove()) {
    g_refusals.fetch_add(1);
    g_last_error = kCudaErrorMemoryAllocation;
    return kCudaErrorMemoryAllocation;
  }
  g_registers.fetch_add(1);
  g_registered_bytes.fetch_add(bytes);
  return kCudaSuccess;
}

__attribute__((visibility("default"))) int cudaHostUnregister(void* ptr) {
  if (ptr == nullptr) {
    g_last_error = kCudaErrorHostMemoryNotRegistered;
    return kCudaErrorHostMemoryNotRegistered;
  }
  g_unregisters.fetch_add(1);
  return kCudaSuccess;
}

__attribute__((visibility("default"))) int cudaGetLastError() {
  g_last_error_reads.fetch_add(1);
  return g_last_error.exchange(kCudaSuccess);
}

// out: registers, refusals, unregisters, last-error reads, registered
// bytes, flags of the last register call, the pending last error.
__attribute__((visibility("default"))) int stub_cudart_counts(uint64_t* out,
                                                              int n) {
  const uint64_t values[] = {g_registers,        g_refusals,
                             g_unregisters,      g_last_error_reads,
                             g_registered_bytes, g_last_flags,
                             static_cast<uint64_t>(g_last_error.load())};
  const int total = static_cast<int>(sizeof(values) / sizeof(values[0]));
  const int count = n < total ? n : total;
  for (int i = 0; i < count; ++i) out[i] = values[i];
  return count;
}

}  // extern "C"
