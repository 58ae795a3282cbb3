"""Worker: one deep network's first training step, timed, with or without
sntf, and what the pass took on it.

    python -m sntf.testing.workers.pass_scaling --arch preact --size 200
        [--batch 8] [--policy swap+recompute|none] [--pool] [--profile PATH]

Builds the pre-activation ResNet of sntf.testing.deep (--size blocks) or
the zoo's GPT-style decoder (--size blocks), compiles it with SGD, and
times its first train_on_batch: tracing, Grappler and, with sntf, the
pass. With sntf it also gives the training graph's nodes, the pass's
seconds per stage and the growth of the process's resident memory while
the pass ran (sampled every few milliseconds). One inter-op thread unless
--pool. Prints one line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _RssWatch:
    """The largest resident set seen while it runs, sampled in a thread."""

    def __init__(self, period: float = 0.005):
        self.period, self.start, self.peak = period, _rss(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _watch_passes(growth: list, profile: str = "") -> None:
    """Wraps sntf's pass so that each call records its resident growth
    (and, given a path, its profile: the longest pass is the one written
    there)."""
    from sntf import passes

    real = passes.run_pass

    def watched(*args, **kwargs):
        profiler = None
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        with _RssWatch() as watch:
            result = real(*args, **kwargs)
        if profiler is not None:
            profiler.disable()
            seconds = result.report.get("pass_seconds") or 0.0
            if seconds >= max(profiled, default=0.0):
                profiler.dump_stats(profile)
            profiled.append(seconds)
        growth.append(watch.peak - watch.start)
        return result

    profiled: list = []       # the pass seconds of each call

    passes.run_pass = watched


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=("preact", "gpt"), default="preact")
    parser.add_argument("--size", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--policy", default="swap+recompute")
    parser.add_argument("--pool", action="store_true")
    parser.add_argument("--profile", default="", help="write the pass's cProfile here")
    args = parser.parse_args()
    # Keras builds and traces a functional model recursively, layer by
    # layer: a 1,000-block network goes deeper than Python's default limit.
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 50 * args.size + 1000))
    import numpy as np
    import tensorflow as tf

    if not args.pool:
        tf.config.threading.set_inter_op_parallelism_threads(1)
    growth: list = []
    if args.policy != "none":
        import sntf

        sntf.enable(policy=args.policy)
        _watch_passes(growth, args.profile)
    import keras

    keras.utils.set_random_seed(1234)
    from sntf.testing import deep, zoo

    if args.arch == "preact":
        model = deep.preact_resnet(args.size)
        r = np.random.RandomState(6)
        x = r.rand(args.batch, 32, 32, 3).astype("float32")
        y = r.randint(0, 10, args.batch)
    else:
        model = zoo.build("gpt", blocks=args.size)
        x, y = zoo.make_data("gpt", args.batch)
    start = time.perf_counter()
    model.train_on_batch(x, y)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model.train_on_batch(x, y)
    out = {"arch": args.arch, "size": args.size, "batch": args.batch,
           "policy": args.policy, "first_step_seconds": first,
           "second_step_seconds": time.perf_counter() - start}
    if args.policy != "none":
        import sntf

        training = [r for r in sntf.reports() if r.get("training")]
        largest = max(training, key=lambda r: r.get("nodes") or 0) if training else {}
        out.update(nodes=largest.get("nodes"), action=largest.get("action"),
                   pass_seconds=largest.get("pass_seconds"),
                   stage_seconds=largest.get("stage_seconds"),
                   passes_seconds=sum(r.get("pass_seconds") or 0.0 for r in sntf.reports()),
                   pass_rss_growth_bytes=max(growth, default=None),
                   predicted_peak_bytes=largest.get("predicted_peak_bytes"),
                   planned_peak_bytes=largest.get("planned_peak_bytes"))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
