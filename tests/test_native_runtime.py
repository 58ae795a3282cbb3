"""What the native layer tells and keeps across a process: the memory type of
parked tensors, the device allocator's limit, and the plugin's registration
across exec."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUB_CUDART_SOURCE = ROOT / "tf_ops" / "testing" / "stub_cudart.cc"


@pytest.fixture(scope="module")
def stub_cudart(tmp_path_factory):
    """A stub CUDA runtime (tf_ops/testing/stub_cudart.cc), compiled once."""
    so = tmp_path_factory.mktemp("stub") / "libcudart_stub.so"
    res = subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-o",
                          str(so), str(STUB_CUDART_SOURCE)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return str(so)


MEMORY_TYPES = """
import ctypes, json, os
import tensorflow as tf
from sntf import ops
from sntf.runtime import native as _native
lib = _native.ops_cdll()
pool = lib.sntf_pool_global()
pinning = int(lib.sntf_pool_pin_with_cuda_runtime(pool, None, 0)) if os.environ.get(
    "SNTF_CUDART_LIBRARY") else 0
x = tf.random.stateless_uniform([1 << 16], seed=[1, 2])
small = ops.swap_out(x)                           # first region: within the cap
_native.set_host_pin_limit(_native.pool_stats()["pinned_bytes"])
big = ops.swap_out(tf.zeros([80 << 20], tf.uint8))  # a new region, over the cap
print("RESULT " + json.dumps({
    "pinning": pinning,
    "small": ops.memory_type(small).numpy().decode(),
    "big": ops.memory_type(big).numpy().decode(),
    "source": ops.memory_type(x).numpy().decode(),
    "back": bool(tf.reduce_all(ops.swap_in(small) == x)),
    "pool": _native.pool_stats()}))
"""


def test_parked_tensors_report_pinned_or_pageable_memory(fresh_python, stub_cudart):
    """Finding 4: a parked tensor's buffer says host_pinned when its pool
    region is page-locked and host_pageable otherwise, which is what makes
    TensorFlow's GPU copies stage the pageable ones (gpu_util.cc's
    NeedStaging reads Tensor::GetMemoryType). Pinning here goes through a
    stub CUDA runtime; beyond the pin cap regions stay pageable."""
    r = fresh_python(MEMORY_TYPES, env={"SNTF_CUDART_LIBRARY": stub_cudart}).result()
    assert r["pinning"] == 1
    assert (r["small"], r["big"]) == ("host_pinned", "host_pageable")
    # TensorFlow's own CPU memory is never pinned (its oneDNN allocator does
    # not say which it is: "unknown").
    assert r["source"] in ("host_pageable", "unknown"), r["source"]
    assert r["back"]
    assert r["pool"]["pinned_regions"] == 1 and r["pool"]["pin_over_limit"] == 1


def test_parked_tensors_are_pageable_without_pinning(fresh_python):
    r = fresh_python(MEMORY_TYPES).result()
    assert r["pinning"] == 0 and (r["small"], r["big"]) == ("host_pageable",
                                                            "host_pageable")
    assert r["pool"]["pinned_regions"] == 0


DEVICE_LIMIT = """
import json
from sntf.runtime import native as _native
try:
    _native.device_bytes_limit("")
    bad = "no error"
except ValueError as e:
    bad = str(e)
print("RESULT " + json.dumps({
    "cpu": _native.device_bytes_limit("CPU:0"),
    "full": _native.device_bytes_limit("/job:localhost/replica:0/task:0/device:CPU:0"),
    "gpu": _native.device_bytes_limit("GPU:0"),
    "bad": bad}))
"""


def test_device_bytes_limit_reads_the_allocator_limit(fresh_python):
    """Item 5's native half: the CPU BFC allocator's limit, as a GPU's would
    be read; None for a device this process does not have."""
    r = fresh_python(DEVICE_LIMIT, env={"TF_CPU_ALLOCATOR_USE_BFC": "true",
                                        "TF_CPU_BFC_MEM_LIMIT_IN_MB": "300",
                                        "CUDA_VISIBLE_DEVICES": ""}).result()
    assert r["cpu"] == r["full"] == 300 << 20
    assert r["gpu"] is None
    assert "device must name a device" in r["bad"]


def test_device_bytes_limit_is_none_without_allocator_statistics(fresh_python):
    r = fresh_python(DEVICE_LIMIT, env={"TF_CPU_ALLOCATOR_USE_BFC": "false",
                                        "TF_ENABLE_ONEDNN_OPTS": "0",
                                        "CUDA_VISIBLE_DEVICES": ""}).result()
    assert r["cpu"] is None and r["gpu"] is None


EXEC_SELF = """
import json, os, sys
import tensorflow as tf
import sntf
from sntf.runtime import plugin

stage = sys.argv[1]
sntf.enable(policy="off")

@tf.function
def f(x):
    return tf.reduce_sum(x * 2.0)

f(tf.ones([4]))
calls = plugin._shim().counters()["calls"]
if stage == "first":
    sys.stdout.flush()
    # Same pid, same environment (the marker included), fresh process image.
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[2], "second",
                              sys.argv[2], str(os.getpid()), str(calls)])
print("RESULT " + json.dumps({
    "pid_before": int(sys.argv[3]), "pid_after": os.getpid(),
    "calls_before": int(sys.argv[4]), "calls_after": calls,
    "registered": plugin.registered_path()}))
"""


def test_registration_survives_exec_with_the_same_pid(fresh_python):
    """A process that enables sntf and then execs itself (same pid, same
    environment, so the same "registered" marker) must register the plugin
    again: TensorFlow's optimizer registry did not survive the exec."""
    run = fresh_python(args=["-c", EXEC_SELF, "first", EXEC_SELF])
    r = run.result()
    assert r["pid_before"] == r["pid_after"]
    assert r["calls_before"] > 0
    assert r["calls_after"] > 0, "the exec'd image never ran the pass: not registered"
    assert r["registered"].endswith(".so")
