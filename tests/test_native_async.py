"""The device code paths of the swap and cache kernels, run on CPU.

The kernels registered under the label "sntf_async_test" are the GPU kernels'
code with a test copier that completes each copy on another thread, after a
delay, in issue order, and fails on request. Each case runs in a fresh
process: the label needs a graph, the copier's settings and the counters are
process-wide.
"""

import pytest

from conftest import TF_KERNELS_ENV

PRELUDE = """
import json, os
import numpy as np
import tensorflow as tf
from sntf import ops
from sntf.runtime import native as _native

LABELS = {op: _native.ASYNC_TEST_LABEL
          for op in ("SnSwapOut", "SnSwapIn", "SnCacheOut", "SnCacheIn")}

def labelled():
    # Selects the test-label kernels for the ops built inside a tf.function.
    return tf.compat.v1.get_default_graph()._kernel_label_map(LABELS)

def unlabelled():
    return tf.compat.v1.get_default_graph()._kernel_label_map({})

def make(seed, n=1 << 18):
    return tf.random.stateless_uniform([n], seed=[seed, 7])

def same(a, b):
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))

def settled(timeout=10.0):
    # TensorFlow may release a failed step's tensors (its tickets among them)
    # just after returning the step's error: wait until the gauges settle.
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (_native.cache_stats()["cache_entries"] == 0
                and _native.pool_stats()["bytes_in_use"] == 0):
            return True
        time.sleep(0.01)
    return False

def report(**values):
    values.update(copier=_native.async_test_copier_stats(),
                  swap=_native.swap_stats(), cache=_native.cache_stats(),
                  pool_in_use=_native.pool_stats()["bytes_in_use"])
    print("RESULT " + json.dumps(values))
"""

BFC = TF_KERNELS_ENV


def _run(fresh_python, body, env=None):
    return fresh_python(PRELUDE + body, env=env).result()


def test_outputs_appear_only_after_their_copy_finished(fresh_python):
    """The parked tensor is read directly by the next op: were the kernel to
    finish before its (delayed) copy, the sum would read an incomplete
    buffer. The source is a temporary the copy alone keeps alive."""
    r = _run(fresh_python, """
_native.set_async_test_copier(0.05)

@tf.function
def step(x):
    with labelled():
        parked = ops.swap_out(x * 2.0)
        total = tf.reduce_sum(parked)
        back = ops.swap_in(parked)
    return total, back

x = make(1)
results = []
for _ in range(3):
    total, back = step(x)
    results.append([float(total) == float(tf.reduce_sum(x * 2.0)),
                    same(back, x * 2.0)])
report(results=results)
""")
    assert r["results"] == [[True, True]] * 3
    assert r["copier"]["issued"] == 6 and r["copier"]["completed"] == 6
    assert r["copier"]["failed"] == 0 and r["swap"]["failed_ops"] == 0
    assert r["pool_in_use"] == 0


@pytest.mark.parametrize("kind", ["swap", "cache"])
def test_kernels_issue_copies_without_blocking_a_thread(fresh_python, kind):
    """With one inter-op thread, four independent swap-outs, or four cache
    parkings (each in its own process: the copier's high-water mark is
    process-wide), all have their copies in flight at once: no kernel waits
    for its copy on the executor's thread, and the cache copies outside its
    lock. (A TF1 graph: tf.function would chain the stateful ops in program
    order, as the Grappler rewrite's graphs are not.)"""
    r = _run(fresh_python, """
_native.set_async_test_copier(0.3)
graph = tf.Graph()
with graph.as_default(), graph._kernel_label_map(LABELS):
    xs = [make(i) for i in range(4)]
    if KIND == "swap":
        outs = [ops.swap_out(x) for x in xs]
    else:
        tickets = [ops.cache_out(x, 1 << 40, headroom=0) for x in xs]
        outs = [ops.cache_in(t, tf.float32, x.shape) for t, x in zip(tickets, xs)]
config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1,
                                  intra_op_parallelism_threads=1)
with tf.compat.v1.Session(graph=graph, config=config) as session:
    want = session.run(xs)
    got = session.run(outs)
report(equal=[same(g, w) for g, w in zip(got, want)])
""".replace("KIND", repr(kind)))
    assert r["equal"] == [True] * 4
    # A kernel that waited for its copy would hold the only thread: 1.
    assert r["copier"]["max_in_flight"] == 4, r["copier"]
    assert r["copier"]["issued"] == (4 if kind == "swap" else 8), r["copier"]
    assert r["cache"] == {"cache_entries": 0, "cached_device_bytes": 0}


def test_copy_failures_are_op_errors_and_leave_nothing_behind(fresh_python):
    r = _run(fresh_python, """
_native.set_async_test_copier(0.01)
errors = {}

def attempt(name, fn, *args):
    try:
        fn(*args)
        errors[name] = "no error"
    except tf.errors.InternalError as e:
        errors[name] = e.message

@tf.function
def swap(x):
    with labelled():
        return ops.swap_in(ops.swap_out(x))

@tf.function
def park(x):
    with labelled():
        return ops.cache_in(ops.cache_out(x, 1 << 40, headroom=0), tf.float32, x.shape)

@tf.function
def evict(a, b):
    # a is kept (headroom 6 MiB), then b's headroom 1 MiB evicts it; that copy fails.
    with labelled():
        ta = ops.cache_out(a, 1 << 40, headroom=6 << 20)
        with tf.control_dependencies([ta]):
            tb = ops.cache_out(b, 1 << 40, headroom=1 << 20)
        return (ops.cache_in(ta, tf.float32, a.shape),
                ops.cache_in(tb, tf.float32, b.shape))

x = make(1)
_native.set_async_test_copier(0.01, fail_next=1)
attempt("swap_out", swap, x)
_native.set_async_test_copier(0.01, fail_next=1)
attempt("park", park, x)
_native.set_async_test_copier(0.01, fail_next=1)
attempt("evict", evict, x, make(2))
_native.set_async_test_copier(0.01)
ok = [same(swap(x), x), same(park(x), x)] + [same(t, u) for t, u in zip(evict(x, make(2)), (x, make(2)))]
report(errors=errors, ok=ok)
""")
    for name in ("swap_out", "park", "evict"):
        assert "injected copy failure" in r["errors"][name], r["errors"]
    assert r["ok"] == [True] * 4
    assert r["copier"]["failed"] == 3 and r["swap"]["failed_ops"] == 3
    assert r["cache"] == {"cache_entries": 0, "cached_device_bytes": 0}
    assert r["pool_in_use"] == 0


@pytest.mark.parametrize("kernels", ["default", "async_test"])
def test_failed_steps_leave_no_cache_entries_or_pool_bytes(fresh_python, kernels):
    """Five steps fail between their cache_out and cache_in (an assertion on
    the gradient, before the backward pass reads the cached activations back):
    the tickets die with the failed steps, and so do their entries."""
    r = _run(fresh_python, f"""
_native.set_async_test_copier(0.01)
KERNELS = {kernels!r}

@tf.function
def train_step(w, x):
    with labelled() if KERNELS == "async_test" else unlabelled():
        h = tf.nn.relu(x * w)
        kept = ops.cache_out(h, 1 << 40)                     # stays on the device
        parked = ops.cache_out(h * 3.0, 1 << 40, headroom=0)  # goes to the pool
        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = tf.reduce_sum(x * w)
        grad = tape.gradient(loss, w)
        with tf.control_dependencies([kept, parked]):
            check = tf.debugging.assert_less(grad, -1.0, message="step fails")
        with tf.control_dependencies([check]):
            a = ops.cache_in(kept, tf.float32, h.shape)
            b = ops.cache_in(parked, tf.float32, h.shape)
    return tf.reduce_sum(a + b)

failures = 0
for _ in range(5):
    try:
        train_step(tf.constant(2.0), make(1))
    except tf.errors.InvalidArgumentError:
        failures += 1
report(failures=failures, settled=settled())
""", env=BFC)
    assert r["failures"] == 5 and r["settled"]
    assert r["swap"]["swap_out_ops"] == 10 and r["swap"]["bytes_to_host"] > 0
    assert r["cache"] == {"cache_entries": 0, "cached_device_bytes": 0}
    assert r["pool_in_use"] == 0


def test_a_ticket_is_only_read_on_the_device_that_issued_it(fresh_python):
    """Finding 8: two CPU devices; a ticket issued on one and read on the
    other is an InvalidArgument error naming both, not a foreign pointer."""
    r = _run(fresh_python, """
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
x = make(1)
with tf.device("/device:CPU:0"):
    ticket = ops.cache_out(x, 1 << 40, uses=2)       # kept on CPU:0
try:
    with tf.device("/device:CPU:1"):
        ops.cache_in(ticket, tf.float32, x.shape)
    error = "no error"
except tf.errors.InvalidArgumentError as e:
    error = str(e)
with tf.device("/device:CPU:0"):
    back = ops.cache_in(ticket, tf.float32, x.shape)
report(error=error, back=same(back, x))
""", env=BFC)
    assert "issued on /job:localhost/replica:0/task:0/device:CPU:0" in r["error"]
    assert "cannot be read on /job:localhost/replica:0/task:0/device:CPU:1" in r["error"]
    assert r["back"] and r["swap"]["cache_hits"] == 1


def test_live_bytes_count_the_tensor_once_and_only_sole_owners_free(fresh_python):
    """Finding 9. x is already among the allocator's live bytes, so it stays
    while live <= budget; an eviction frees device bytes only when the cache
    alone holds the tensor, so a tensor the caller still holds is not evicted
    to make room, and one it dropped is."""
    r = _run(fresh_python, """
MIB = 1 << 20
n = MIB                                   # float32: 4 MiB
stats = lambda: dict(_native.swap_stats(), **_native.cache_stats())
a = make(1, n)
budget = tf.config.experimental.get_memory_info("CPU:0")["current"] + 2 * MIB
ta = ops.cache_out(a, budget)             # live == budget - 2 MiB: kept
s1 = stats()
b = make(2, n)                            # live: budget + 2 MiB
tb = ops.cache_out(b, budget)             # a is also the caller's: b parks
s2 = stats()
del a                                     # now the cache alone holds a
c = make(3, n)
tc = ops.cache_out(c, budget)             # evicting a frees 4 MiB: evicted
s3 = stats()
back = [ops.cache_in(t, tf.float32, [n]) for t in (ta, tb, tc)]
report(steps=[s1, s2, s3],
       equal=[same(x, make(s, n)) for x, s in zip(back, (1, 2, 3))])
""", env=BFC)
    s1, s2, s3 = r["steps"]
    mib4 = 4 << 20
    assert (s1["cached_device_bytes"], s1["bytes_to_host"]) == (mib4, 0), s1
    assert (s2["cache_evictions"], s2["bytes_to_host"]) == (0, mib4), s2
    assert s2["cached_device_bytes"] == mib4
    assert s3["cache_evictions"] == 1 and s3["bytes_to_host"] == 3 * mib4, s3
    assert s3["cached_device_bytes"] == 0
    assert r["equal"] == [True] * 3


def test_cache_in_rejects_a_non_scalar_ticket(fresh_python):
    """Eagerly, inside tf.function with an unknown shape, and for the
    test-label kernels: an InvalidArgument error, never an abort. A ticket
    of known non-scalar shape is refused when the graph is built."""
    run = fresh_python(PRELUDE + """
errors = {}
bad = tf.constant([1, 2], tf.int64)

def attempt(name, fn):
    try:
        fn()
        errors[name] = "no error"
    except (tf.errors.InvalidArgumentError, ValueError) as e:
        errors[name] = type(e).__name__ + ": " + str(e)

attempt("eager", lambda: ops.cache_in(bad, tf.float32))

@tf.function(input_signature=[tf.TensorSpec(None, tf.int64)])
def unknown(t):
    return ops.cache_in(t, tf.float32)

@tf.function(input_signature=[tf.TensorSpec(None, tf.int64)])
def unknown_labelled(t):
    with labelled():
        return ops.cache_in(t, tf.float32)

@tf.function(input_signature=[tf.TensorSpec([2], tf.int64)])
def known(t):
    return ops.cache_in(t, tf.float32)

attempt("function", lambda: unknown(bad))
attempt("function_async_test", lambda: unknown_labelled(bad))
attempt("trace", lambda: known(bad))
report(errors=errors)
""")
    assert run.returncode == 0, run.stderr[-3000:]
    errors = run.result()["errors"]
    for name in ("eager", "function", "function_async_test"):
        assert errors[name].startswith("InvalidArgumentError"), errors
        assert "ticket must be a scalar" in errors[name], errors
    # Shape inference refuses it while tracing (TensorFlow reports that as
    # InvalidArgumentError or ValueError, depending on the path).
    assert "must be rank 0 but is rank 1" in errors["trace"], errors


def test_int32_in_host_memory_is_handed_on_without_a_copy(fresh_python):
    """Finding 10: int32 arguments live in host memory on a GPU, so the GPU
    kernels (here their test-label twins) hand them on; float32 is copied."""
    r = _run(fresh_python, """
_native.set_async_test_copier(0.01)

@tf.function
def roundtrips(i, f):
    with labelled():
        out = [ops.swap_in(ops.swap_out(i)),
               ops.cache_in(ops.cache_out(i, 1 << 40, headroom=0), tf.int32, i.shape),
               ops.swap_in(ops.swap_out(f))]
    return out

i = tf.range(1000, dtype=tf.int32)
f = make(1, 1000)
a, b, c = roundtrips(i, f)
report(equal=[same(a, i), same(b, i), same(c, f)])
""")
    assert r["equal"] == [True, True, True]
    # swap_out, swap_in, cache_out, cache_in of the int32 tensor: no copy.
    assert r["swap"]["host_memory_passthrough"] == 4
    assert r["copier"]["issued"] == 2          # the float32 round trip only
    assert r["swap"]["bytes_to_host"] == 4000
