#!/usr/bin/env bash
# Builds the standalone native harness (benchmarks/native_harness.cc: the host
# pool, its pinning through a CUDA runtime, and the tensor cache's
# bookkeeping, without TensorFlow) under AddressSanitizer (with leak
# detection) and ThreadSanitizer, and runs it against the stub CUDA runtime
# in tf_ops/testing/. Exits non-zero on the first report or failed check.
#
#   bash benchmarks/sanitize_native.sh [--quick]
#
# Needs g++ with libasan and libtsan; no TensorFlow, no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${SNTF_SANITIZE_DIR:-${TMPDIR:-/tmp}/sntf_sanitize}"
mkdir -p "$OUT"
SOURCES=(benchmarks/native_harness.cc tf_ops/host_pool.cc tf_ops/cuda_runtime_pinning.cc)
COMMON=(-std=c++17 -O1 -g -fno-omit-frame-pointer -Wall -Wextra -Itf_ops)

for sanitizer in address thread; do
  echo "sanitize_native: building with -fsanitize=$sanitizer"
  g++ "${COMMON[@]}" -fsanitize="$sanitizer" -fPIC -shared \
    -o "$OUT/libcudart_stub_$sanitizer.so" tf_ops/testing/stub_cudart.cc
  g++ "${COMMON[@]}" -fsanitize="$sanitizer" -o "$OUT/harness_$sanitizer" \
    "${SOURCES[@]}" -ldl -pthread
  echo "sanitize_native: running under -fsanitize=$sanitizer"
  SNTF_CUDART_LIBRARY="$OUT/libcudart_stub_$sanitizer.so" \
  STUB_CUDART_REFUSE_ABOVE=$((8 << 20)) \
  ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0" \
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" \
    "$OUT/harness_$sanitizer" "$@"
done
echo "sanitize_native: clean under AddressSanitizer and ThreadSanitizer"
