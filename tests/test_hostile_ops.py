"""sntf.ops.cache_out given bad arguments (issue #41, part 4): a ValueError
naming the value and the accepted forms, raised before anything is created,
and no cache entry, device bytes or pool bytes left behind."""

from __future__ import annotations

import pytest

from sntf import ops


@pytest.mark.parametrize("kwargs, words", [
    ({"budget": 2**63}, "budget must be an int number of bytes from 0 to 2**63 - 1, "
                        "got 9223372036854775808"),
    ({"budget": -1}, "budget must be an int number of bytes from 0 to 2**63 - 1, got -1"),
    ({"budget": 1.5e9}, "budget must be an int number of bytes from 0 to 2**63 - 1, "
                        "got 1500000000.0 (float)"),
    ({"budget": "1GB"}, "got '1GB' (str)"),
    ({"budget": True}, "got True (bool)"),
    ({"budget": 1 << 30, "headroom": 2**64},
     "headroom must be an int number of bytes from 0 to 2**63 - 1, or -1 for no "
     "cap, got 18446744073709551616"),
    ({"budget": 1 << 30, "headroom": -2}, "or -1 for no cap, got -2"),
    ({"budget": 1 << 30, "uses": 0}, "uses must be an int from 1 to 2**31 - 1, got 0"),
    ({"budget": 1 << 30, "uses": 2**31}, "uses must be an int from 1 to 2**31 - 1"),
    ({"budget": 1 << 30, "name": 5}, "name must be a string or None, got 5"),
])
def test_cache_out_refuses_bad_arguments_before_running(kwargs, words):
    # x is not even a tensor: the arguments are checked before TensorFlow
    # sees anything.
    with pytest.raises(ValueError) as excinfo:
        ops.cache_out(object(), **kwargs)
    assert str(excinfo.value).startswith("sntf.ops.cache_out: ")
    assert words in str(excinfo.value), str(excinfo.value)


def test_cache_out_leaves_nothing_behind_on_bad_arguments(fresh_python):
    """The issue's reproduction, verbatim, then the same with budget=2**63 and
    the other bad arguments: no cache entry, device bytes or pool bytes
    outlive the failed calls, and a good call still works."""
    run = fresh_python("""
        import gc, json
        import tensorflow as tf
        import sntf
        from sntf import ops

        sntf.enable("off")
        for i in range(5):
            t = tf.fill([4096, 1024], float(i))
            try: ops.cache_out(t, budget=1 << 30, headroom=2**64)
            except Exception: pass
            del t
        gc.collect()

        def state():
            s = sntf.stats()
            return [s["swap"]["cache_entries"], s["swap"]["cached_device_bytes"],
                    s["pool"]["bytes_in_use"]]

        after = {"headroom": state()}
        errors = []
        for kwargs in ({"budget": 2**63}, {"budget": 1 << 30, "uses": 2**40},
                       {"budget": 1 << 30, "name": 5}, {"budget": -1},
                       {"budget": 0, "headroom": -2**64}):
            t = tf.fill([4096, 1024], 1.0)
            try:
                ops.cache_out(t, **kwargs)
            except Exception as e:
                errors.append(type(e).__name__)
            del t
        gc.collect()
        after["others"] = state()
        x = tf.fill([1024], 3.0)
        y = ops.cache_in(ops.cache_out(x, 1 << 40), tf.float32, [1024])
        good = bool(tf.reduce_all(y == x))
        del x, y
        gc.collect()
        after["good"] = state()
        print("RESULT " + json.dumps({"after": after, "errors": errors, "good": good}))
        """)
    result = run.result()
    assert result["after"] == {"headroom": [0, 0, 0], "others": [0, 0, 0],
                               "good": [0, 0, 0]}, result
    assert result["errors"] == ["ValueError"] * 5
    assert result["good"] is True
