"""SnSwapOut / SnSwapIn: values, dtypes, shapes, pool accounting, errors, registry."""

import numpy as np
import pytest
import tensorflow as tf

from sntf import ops
from sntf.runtime import native as _native


def _bits(t):
    """Exact bit pattern of a tensor as bytes (dtype-independent comparison)."""
    return t.numpy().tobytes()


def _sample(dtype, shape):
    rng = np.random.default_rng(3)
    n = int(np.prod(shape)) if shape else 1
    if dtype == tf.bool:
        values = rng.random(n) > 0.5
    elif dtype.is_complex:
        values = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    elif dtype.is_floating:
        values = rng.standard_normal(n) * 100
    else:
        info = np.iinfo(dtype.as_numpy_dtype)
        values = rng.integers(info.min, info.max, n, endpoint=True, dtype=np.int64
                              if info.min < 0 else np.uint64)
    return tf.constant(np.asarray(values).astype(dtype.as_numpy_dtype).reshape(shape))


DTYPES = [tf.float32, tf.float64, tf.bfloat16, tf.float16, tf.int8, tf.int16,
          tf.int32, tf.int64, tf.uint8, tf.uint16, tf.uint32, tf.uint64, tf.bool,
          tf.complex64, tf.complex128]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_roundtrip_is_bit_exact_for_every_dtype(dtype):
    x = _sample(dtype, (3, 7))
    parked = ops.swap_out(x)
    y = ops.swap_in(parked)
    assert parked.dtype == dtype and y.dtype == dtype
    assert parked.shape == x.shape and y.shape == x.shape
    assert _bits(y) == _bits(x)


def test_quantized_dtype_roundtrip():
    x = tf.quantization.quantize(tf.constant([[0.1, 0.5], [0.9, 0.3]]), 0.0, 1.0,
                                 tf.qint8).output
    y = ops.swap_in(ops.swap_out(x))
    assert y.dtype == tf.qint8
    assert tf.reduce_all(tf.equal(tf.bitcast(y, tf.int8), tf.bitcast(x, tf.int8)))


@pytest.mark.parametrize("shape", [(), (0,), (0, 5), (4, 0, 2), (1,), (2, 3, 4, 5)])
def test_empty_scalar_and_nd_shapes(shape):
    x = _sample(tf.float32, shape)
    y = ops.swap_in(ops.swap_out(x))
    assert tuple(y.shape) == shape
    assert _bits(y) == _bits(x)


def test_unsupported_dtype_is_rejected_at_graph_construction():
    with pytest.raises((TypeError, ValueError, tf.errors.InvalidArgumentError)):
        ops.swap_out(tf.constant(["a", "b"]))


def test_shape_function_keeps_static_and_unknown_dims():
    seen = {}

    @tf.function(input_signature=[tf.TensorSpec([None, 3, 5], tf.float32)])
    def f(x):
        parked = ops.swap_out(x)
        y = ops.swap_in(parked)
        seen["parked"] = parked.shape.as_list()
        seen["y"] = y.shape.as_list()
        return y

    x = _sample(tf.float32, (4, 3, 5))
    assert _bits(f(x)) == _bits(x)
    assert seen == {"parked": [None, 3, 5], "y": [None, 3, 5]}


def test_pool_holds_parked_bytes_and_releases_them():
    before = _native.pool_stats()["bytes_in_use"]
    swaps_before = _native.swap_stats()
    x = tf.zeros([1024, 1024], tf.float32)  # 4 MiB
    parked = ops.swap_out(x)
    during = _native.pool_stats()
    assert during["bytes_in_use"] - before >= 4 * 2**20
    assert during["active_allocs"] >= 1
    y = ops.swap_in(parked)
    del parked
    after = _native.pool_stats()
    assert after["bytes_in_use"] == before
    swaps = _native.swap_stats()
    assert swaps["bytes_to_host"] - swaps_before["bytes_to_host"] == 4 * 2**20
    assert swaps["bytes_to_device"] - swaps_before["bytes_to_device"] == 4 * 2**20
    assert swaps["swap_out_ops"] - swaps_before["swap_out_ops"] == 1
    assert float(tf.reduce_sum(y)) == 0.0


def _kernels(op):
    """{(device type, label, constrained to int32 only): host-memory args}."""
    from tensorflow.python.framework import kernels

    _native.load_ops()
    found = {}
    for k in kernels.get_registered_kernels_for_op(op).kernel:
        allowed = [list(c.allowed_values.list.type) for c in k.constraint]
        int32_only = allowed == [[tf.int32.as_datatype_enum]]
        found[(k.device_type, k.label, int32_only)] = sorted(k.host_memory_arg)
    return found


@pytest.mark.parametrize("op,device_arg,host_arg", [
    ("SnSwapOut", "x", "parked"), ("SnSwapIn", "y", "parked"),
    ("SnCacheOut", "x", "ticket"), ("SnCacheIn", "y", "ticket")])
def test_gpu_kernels_keep_host_arguments_and_int32_in_host_memory(op, device_arg,
                                                                   host_arg):
    """Finding 10: the GPU kernels take int32 (which TensorFlow keeps in host
    memory on a GPU) in host memory, so it is handed on instead of making a
    round trip; the test-label CPU kernels are registered the same way."""
    found = _kernels(op)
    for device, label in (("GPU", ""), ("CPU", _native.ASYNC_TEST_LABEL)):
        assert found[(device, label, False)] == [host_arg], found
        assert found[(device, label, True)] == sorted([device_arg, host_arg]), found
    assert found[("CPU", "", False)] == [], found


def test_a_tensor_the_pool_cannot_hold_stays_in_ordinary_memory(fresh_python):
    """Swapping must never fail a step: a tensor larger than the pool's limit
    is handed on in ordinary memory (on CPU, the tensor itself), counted as
    a pool fallback and warned about once; the pool keeps serving the
    tensors that fit."""
    run = fresh_python("""
        import json
        import tensorflow as tf
        from sntf import ops
        from sntf.runtime import native as _native
        big = tf.reshape(tf.range(1024 * 1024, dtype=tf.float32), [1024, 1024])
        back = ops.swap_in(ops.swap_out(big))          # 4 MiB > 1 MiB limit
        again = ops.swap_in(ops.swap_out(big * 2))     # warned once only
        small = ops.swap_in(ops.swap_out(tf.ones([16])))   # fits: pooled
        print("RESULT " + json.dumps({
              "same": bool(tf.reduce_all(back == big)),
              "same_again": bool(tf.reduce_all(again == big * 2)),
              "small": float(tf.reduce_sum(small)),
              "stats": _native.swap_stats(),
              "pool_allocs": _native.pool_stats()["num_allocs"]}))
    """, env={"SNTF_HOST_POOL_LIMIT": str(2**20), "TF_CPP_MIN_LOG_LEVEL": "0"})
    r = run.result()
    assert r["same"] and r["same_again"] and r["small"] == 16.0
    assert r["stats"]["pool_fallbacks"] == 2 and r["stats"]["failed_ops"] == 0
    assert r["stats"]["swap_out_ops"] == 1 and r["pool_allocs"] == 1
    warnings = [line for line in run.stderr.splitlines() if "pool_fallbacks" in line]
    assert len(warnings) == 1, run.stderr[-2000:]
    assert "pool limit 1048576 bytes" in warnings[0]
    assert "requested 4194304 bytes" in warnings[0]


def test_device_peak_excludes_parked_bytes(fresh_python):
    """A hand-built graph: park `a`, compute with `b`, bring `a` back.

    Without the swap, `a` (64 MiB) lives through `b`'s lifetime and the
    CPU:0 peak holds both; with it, `a`'s device copy dies at the swap-out and
    its bytes sit in the pool, which the device allocator does not count.
    """
    code = """
        import json, sys
        import tensorflow as tf
        from sntf import ops
        from sntf.runtime import native as _native
        swap = sys.argv[1] == "swap"
        n = 16 * 2**20   # float32 elements: 64 MiB

        @tf.function
        def step(n):
            a = tf.fill([n], 1.0)
            held = ops.swap_out(a) if swap else a
            with tf.control_dependencies([held]):
                b = tf.fill([n], 2.0)
            s = tf.reduce_sum(b)
            with tf.control_dependencies([s]):
                back = ops.swap_in(held) if swap else tf.identity(held)
            return tf.reduce_sum(back) + s

        value = float(step(tf.constant(n)))
        info = tf.config.experimental.get_memory_info("CPU:0")
        print("RESULT " + json.dumps({"value": value, "peak": info["peak"],
              "pool": _native.pool_stats(), "swap": _native.swap_stats()}))
    """
    # TensorFlow's default CPU allocator keeps statistics only with oneDNN on,
    # which depends on the CPU; its BFC allocator always keeps them.
    bfc = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
    plain = fresh_python(args=["-c", _dedent(code), "plain"], env=bfc).result()
    swapped = fresh_python(args=["-c", _dedent(code), "swap"], env=bfc).result()
    mib = 2**20
    assert plain["value"] == swapped["value"] == 3.0 * 16 * mib
    assert plain["peak"] >= 128 * mib, plain
    assert swapped["peak"] <= 0.75 * plain["peak"], (swapped["peak"], plain["peak"])
    assert swapped["pool"]["peak_bytes_in_use"] >= 64 * mib
    assert swapped["pool"]["bytes_in_use"] == 0
    assert swapped["swap"]["bytes_to_host"] == 64 * mib
    assert plain["swap"]["bytes_to_host"] == 0


def _dedent(code):
    import textwrap

    return textwrap.dedent(code)


@pytest.mark.slow
def test_tensor_above_4gib_roundtrips(fresh_python):
    run = fresh_python("""
        import json
        import tensorflow as tf
        from sntf import ops
        n = 2**32 + 64                      # uint8 elements: just over 4 GiB
        tail = tf.range(64, dtype=tf.int32) % 251
        x = tf.concat([tf.fill([2**32], tf.constant(7, tf.uint8)),
                       tf.cast(tail, tf.uint8)], axis=0)
        parked = ops.swap_out(x)
        del x
        y = ops.swap_in(parked)
        del parked
        head = y[:16].numpy().tolist()
        end = y[-64:].numpy().tolist()
        middle = y[2**32 - 8:2**32 + 8].numpy().tolist()
        print("RESULT " + json.dumps({"size": int(tf.size(y, out_type=tf.int64)),
              "head": head, "end": end, "middle": middle}))
    """, timeout=900)
    r = run.result()
    assert r["size"] == 2**32 + 64
    assert r["head"] == [7] * 16
    assert r["end"] == [i % 251 for i in range(64)]
    assert r["middle"] == [7] * 8 + [0, 1, 2, 3, 4, 5, 6, 7]


# ------------------------------------------------------------- tensor cache
CACHE_LRU = """
import json, os
os.environ.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="true")
import numpy as np
import tensorflow as tf
import sntf
from sntf import ops

MIB = 1 << 20
n = 4 * MIB // 4
stats = lambda: sntf.stats()["swap"]
make = lambda seed: tf.random.stateless_uniform([n], seed=[seed, 0])
budget = tf.config.experimental.get_memory_info("CPU:0")["current"] + 10 * MIB
steps = []
# No Python reference is kept to the cached tensors: once the statement is
# done the cache alone holds each, so evicting one frees its device bytes.
ta = ops.cache_out(make(1), budget)      # live + 4 MiB fits: kept
steps.append(stats())
tb = ops.cache_out(make(2), budget)      # live grows by 4 MiB, still fits: kept
steps.append(stats())
tc = ops.cache_out(make(3), budget)      # over: the oldest (a) goes to host
steps.append(stats())
back = [ops.cache_in(t, tf.float32, [n]) for t in (ta, tb, tc)]
steps.append(stats())
equal = [bool(np.array_equal(x.numpy(), make(s).numpy()))
         for x, s in zip(back, (1, 2, 3))]
a = make(1)
twice = ops.cache_out(a, 1 << 40, uses=2)
first = ops.cache_in(twice, tf.float32, [n])
second = ops.cache_in(twice, tf.float32, [n])
try:
    ops.cache_in(twice, tf.float32, [n])
    third = "no error"
except tf.errors.InvalidArgumentError as e:
    third = str(e)
steps.append(stats())
print("RESULT " + json.dumps({"steps": steps, "equal": equal, "third": third,
      "reuse": bool(np.array_equal(second.numpy(), a.numpy()))}))
"""


def test_tensor_cache_keeps_under_budget_and_evicts_least_recent(fresh_python):
    r = fresh_python(CACHE_LRU).result()
    kept_a, kept_b, evicted, back, reused = r["steps"]
    mib4 = 4 << 20
    assert (kept_a["cache_entries"], kept_a["cached_device_bytes"], kept_a["bytes_to_host"]) == (
        1, mib4, 0)
    assert (kept_b["cache_entries"], kept_b["cached_device_bytes"], kept_b["bytes_to_host"]) == (
        2, 2 * mib4, 0)
    assert evicted["cache_evictions"] == 1 and evicted["bytes_to_host"] == mib4
    assert evicted["cached_device_bytes"] == 2 * mib4          # b and c
    # a comes back from the host (a miss), b and c are hits with no transfer.
    assert (back["cache_misses"], back["cache_hits"], back["bytes_to_device"]) == (1, 2, mib4)
    assert back["cache_entries"] == 0 and back["cached_device_bytes"] == 0
    assert r["equal"] == [True, True, True] and r["reuse"]
    # A ticket serves exactly `uses` swap-ins.
    assert "ticket" in r["third"] and "unknown" in r["third"]
    assert reused["cache_hits"] == 4 and reused["cache_entries"] == 0


def test_tensor_cache_headroom_caps_the_cached_bytes(fresh_python):
    # Far under the budget, the headroom alone decides: with 6 MiB of it, one
    # 4 MiB tensor stays, the next evicts it; headroom 0 keeps nothing and
    # evicts what was kept.
    r = fresh_python("""
        import json
        import tensorflow as tf
        import sntf
        from sntf import ops
        MIB = 1 << 20
        stats = lambda: sntf.stats()["swap"]
        a = tf.random.uniform([MIB], seed=1)
        b = tf.random.uniform([MIB], seed=2)
        steps = []
        ta = ops.cache_out(a, 1 << 40, headroom=6 * MIB)
        steps.append(stats())
        tb = ops.cache_out(b, 1 << 40, headroom=6 * MIB)
        steps.append(stats())
        tz = ops.cache_out(a, 1 << 40, headroom=0)
        steps.append(stats())
        for t in (ta, tb, tz):
            ops.cache_in(t, tf.float32, [MIB])
        steps.append(stats())
        print("RESULT " + json.dumps(steps))
    """, env={"TF_CPU_ALLOCATOR_USE_BFC": "true"}).result()
    first, second, zero, done = r
    mib4 = 4 << 20
    assert (first["cached_device_bytes"], first["bytes_to_host"]) == (mib4, 0)
    assert (second["cached_device_bytes"], second["cache_evictions"]) == (mib4, 1)
    assert second["bytes_to_host"] == mib4
    assert zero["cached_device_bytes"] == 0 and zero["cache_evictions"] == 2
    assert zero["bytes_to_host"] == 3 * mib4
    assert done["cached_device_bytes"] == 0 and done["cache_entries"] == 0


def test_tensor_cache_without_allocator_stats_always_copies(fresh_python):
    # The default oneDNN CPU allocator may or may not keep stats; with
    # TF_ENABLE_ONEDNN_OPTS=0 and no BFC it keeps none: the cache must copy.
    r = fresh_python("""
        import json, os
        os.environ.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="false")
        import numpy as np
        import tensorflow as tf
        import sntf
        from sntf import ops
        a = tf.random.uniform([1024], seed=1)
        y = ops.cache_in(ops.cache_out(a, 1 << 40), tf.float32, [1024])
        print("RESULT " + json.dumps({"swap": sntf.stats()["swap"],
              "equal": bool(np.array_equal(y.numpy(), a.numpy()))}))
    """).result()
    assert r["equal"]
    assert r["swap"]["cache_no_stats"] == 1 and r["swap"]["cache_misses"] == 1
    assert r["swap"]["bytes_to_host"] == 4096


def test_cache_ops_shapes():
    @tf.function
    def f(x):
        y = ops.cache_in(ops.cache_out(x, 1 << 40), tf.float32, [None, 3])
        assert y.shape.as_list() == [None, 3]
        return y

    x = tf.ones([2, 3])
    assert np.array_equal(f(x).numpy(), x.numpy())


def test_gpu_pinning_is_not_attempted_without_a_gpu_kernel():
    # Pinning starts when a GPU kernel of the swap ops first runs (its
    # copier's Prepare); on a CPU-only machine none does, and the pool stays
    # ordinary pageable memory. That the GPU path pins only a GPU can show.
    assert _native.ops_cdll().sntf_gpu_pinning() == 0
    stats = _native.pool_stats()
    assert stats["pinned_regions"] == 0 and stats["pin_failures"] == 0
