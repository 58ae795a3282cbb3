"""The standalone native harness (benchmarks/native_harness.cc): the host
pool and the tensor cache's bookkeeping under concurrency, without
TensorFlow. benchmarks/sanitize_native.sh runs it under AddressSanitizer and
ThreadSanitizer; here a plain build keeps it compiling and passing."""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _build(out_dir: pathlib.Path) -> tuple[str, str]:
    harness, stub = out_dir / "native_harness", out_dir / "libcudart_stub.so"
    for command in (
            ["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-o", str(stub),
             str(ROOT / "tf_ops" / "testing" / "stub_cudart.cc")],
            ["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror",
             "-I" + str(ROOT / "tf_ops"), "-o", str(harness),
             str(ROOT / "benchmarks" / "native_harness.cc"),
             str(ROOT / "tf_ops" / "host_pool.cc"),
             str(ROOT / "tf_ops" / "cuda_runtime_pinning.cc"), "-ldl", "-pthread"]):
        res = subprocess.run(command, capture_output=True, text=True)
        assert res.returncode == 0, f"{' '.join(command)}\n{res.stderr}"
    return str(harness), str(stub)


def test_native_harness_passes(tmp_path):
    harness, stub = _build(tmp_path)
    env = dict(os.environ, SNTF_CUDART_LIBRARY=stub,
               STUB_CUDART_REFUSE_ABOVE=str(8 << 20))
    res = subprocess.run([harness, "--quick"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "harness: ok" in res.stdout
    assert "CUDA runtime pinning ok" in res.stdout


@pytest.mark.slow
def test_sanitizer_script_runs_clean():
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "sanitize_native.sh"),
                          "--quick"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "clean under AddressSanitizer and ThreadSanitizer" in res.stdout
