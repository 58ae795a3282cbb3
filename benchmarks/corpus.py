"""Records and checks the corpus of graphs the pass is replayed on.

    python benchmarks/corpus.py --record families      # one fit step per family
    python benchmarks/corpus.py --record fuzz --seeds 1,2,3 --cases 40
    TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/corpus.py --record zoo   # zoo graphs
    python benchmarks/corpus.py --expect               # re-record expected.json
    python benchmarks/corpus.py --check                # compare, print mismatches

Recording trains real models (TensorFlow, the plugin loaded) and keeps every
training graph the pass planned (Grappler's last call for it), with what the
pass read around it; see sntf/testing/corpus.py. --expect replays every entry
under its configurations and writes tests/corpus/expected.json; --check
replays and compares with it (tests/test_corpus.py does the same).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from sntf.testing import corpus  # noqa: E402

FOLDER = os.path.join(REPO, "tests", "corpus", "graphs")
EXPECTED = os.path.join(REPO, "tests", "corpus", "expected.json")

FLAGS = flags.FLAGS
flags.DEFINE_enum("record", None, ["families", "fuzz", "zoo"], "what to capture")
flags.DEFINE_list("models", ["gpt", "transformer", "vit", "mobilenet_v2",
                             "preact_resnet", "unet_transpose", "se_resnet",
                             "allconv_swish"],
                  "sntf.testing.zoo architectures (--record zoo)")
flags.DEFINE_list("seeds", ["1", "2", "3"], "fuzzer seeds (--record fuzz)")
flags.DEFINE_integer("cases", 40, "fuzzer cases per seed (--record fuzz)")
flags.DEFINE_integer("batch", 32, "batch of the family models (--record families)")
flags.DEFINE_bool("expect", False, "replay every entry and write expected.json")
flags.DEFINE_bool("check", False, "replay every entry and compare with expected.json")

# Every family is replayed under each of these; budgets are fractions of the
# graph's predicted peak, made absolute when the entry is recorded.
FAMILY_CONFIGS = (
    ("off", None, {}),
    ("off", None, {"identity_rewrite": True}),
    ("recompute", None, {"recompute_mode": "speed"}),
    ("recompute", None, {"recompute_mode": "memory"}),
    ("recompute", None, {"recompute_mode": "auto"}),
    ("swap", None, {}),
    ("swap", None, {"swap_min_bytes": 0}),
    ("swap+recompute", None, {}),
    ("auto", None, {}),
    ("auto", 0.8, {}),
    ("auto", 0.6, {}),
    ("auto", 0.4, {}),
    ("auto", 0.6, {"budget_behaviour": "unchanged"}),
    ("swap+recompute", 0.6, {}),
)
# Zoo entries (architectures outside the families, captured as users run
# them: oneDNN's rewrites on) are replayed under these.
ZOO_CONFIGS = (
    ("off", None, {}),
    ("recompute", None, {}),
    ("swap", None, {}),
    ("swap+recompute", None, {}),
    ("auto", None, {}),
    ("auto", 0.5, {}),
)
# Fuzz entries: their own case's configuration, and these.
FUZZ_CONFIGS = (
    ("recompute", None, {}),
    ("swap", None, {"swap_min_bytes": 0}),
    ("swap+recompute", None, {"swap_min_bytes": 0}),
    ("auto", None, {"swap_min_bytes": 0}),
    ("auto", 0.5, {"swap_min_bytes": 0}),
)


class Recorder:
    """Spies on the pass as the plugin calls it and keeps its planned calls."""

    def __init__(self):
        from sntf import passes

        self.passes = passes
        self.original = passes.run_pass
        self.captured: list = []
        passes.run_pass = self.spy

    def spy(self, graph_bytes, fetch, preserve, state, properties=None, env=None,
            defer=False):
        raw = None
        if not defer and properties is not None:
            from tensorflow.core.framework import graph_pb2

            names = [n.name for n in graph_pb2.GraphDef.FromString(graph_bytes).node]
            raw = {k: list(v) for k, v in properties(names).items()}
        result = self.original(graph_bytes, fetch, preserve, state, properties, env,
                               defer)
        if raw is not None and result.report["training"] and not result.deferred:
            env = env or self.passes.Environment()
            self.captured.append(dict(
                graph=graph_bytes, fetch=tuple(fetch), preserve=tuple(preserve),
                properties=raw, runtime_batch=env.runtime_batch,
                in_use_bytes=env.in_use("CPU:0") if env.in_use else None,
                device_memory_bytes=env.device_memory("CPU:0"), threads=env.threads,
                onednn=env.onednn, state=state))
        return result


def _state_config(state) -> dict:
    import dataclasses

    defaults = dataclasses.asdict(type(state.options)())
    options = {k: v for k, v in dataclasses.asdict(state.options).items()
               if v != defaults[k]}
    budget = None if state.budget is None else state.budget.to_user()
    return corpus.config(state.policy, budget, **options)


def _entry(name: str, captured: dict, configs: list) -> corpus.Entry:
    fields = {k: v for k, v in captured.items() if k != "state"}
    return corpus.Entry(name=name, configs=tuple(configs), **fields)


def _absolute(entry: corpus.Entry, specs) -> list:
    """Configurations with budget fractions made bytes of the predicted peak."""
    peak = corpus.replay(entry, corpus.config("off"))["predicted_peak_bytes"]
    configs = []
    for policy, fraction, options in specs:
        budget = None if fraction is None else int(fraction * peak)
        configs.append(corpus.config(policy, budget, **options))
    return configs


def record_families(batch: int) -> None:
    import sntf
    from sntf import models

    recorder = Recorder()
    sntf.enable(policy="recompute")
    for family in models.FAMILIES:
        recorder.captured.clear()
        model = models.build(family)
        x, y = models.make_data(family, batch)
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        train = max(recorder.captured, key=lambda c: len(c["graph"]))
        entry = _entry(f"family-{family}", train, [])
        entry = corpus.Entry(**{**entry.__dict__,
                                "configs": tuple(_absolute(entry, FAMILY_CONFIGS))})
        print(corpus.save(entry, FOLDER), flush=True)


def record_zoo(models: list) -> None:
    import tensorflow as tf

    import sntf
    from sntf.testing import zoo

    recorder = Recorder()
    sntf.enable(policy="recompute")
    for name in models:
        recorder.captured.clear()
        model = zoo.build(name)
        batch = zoo.default_batch(name)
        x, y = zoo.make_data(name, batch)
        # A batched tf.data pipeline, as measure_peak feeds: its batch
        # dimension is unknown, so the backward pass reads shapes (Shape ops).
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        model.fit(data, epochs=1, verbose=0)
        train = max(recorder.captured, key=lambda c: len(c["graph"]))
        entry = _entry(f"zoo-{name}", train, [])
        entry = corpus.Entry(**{**entry.__dict__,
                                "configs": tuple(_absolute(entry, ZOO_CONFIGS))})
        print(corpus.save(entry, FOLDER), flush=True)


def record_fuzz(seeds: list, cases: int) -> None:
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings

    from sntf.testing import fuzz, fuzz_cases

    recorder = Recorder()
    harness = fuzz.Harness()
    for seed in seeds:
        before = len(recorder.captured)

        @settings(max_examples=cases, deadline=None, database=None,
                  phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
        @given(fuzz_cases.case_specs(fuzz_cases.POLICIES))
        def one_case(spec):
            harness.run_case(spec)

        hypothesis.seed(int(seed))(one_case)()
        for k, captured in enumerate(recorder.captured[before:]):
            entry = _entry(f"fuzz-s{seed}-{k:03d}", captured, [])
            configs = [_state_config(captured["state"])]
            configs += [c for c in _absolute(entry, FUZZ_CONFIGS) if c not in configs]
            entry = corpus.Entry(**{**entry.__dict__, "configs": tuple(configs)})
            corpus.save(entry, FOLDER)
        print(f"seed {seed}: {len(recorder.captured) - before} graphs", flush=True)


def replay_all() -> dict:
    results = {}
    for entry in corpus.entries(FOLDER):
        start = time.perf_counter()
        results[entry.name] = {corpus.config_key(c): corpus.replay(entry, c)
                               for c in entry.configs}
        print(f"{entry.name}: {len(entry.configs)} configs, "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    return results


def main(argv) -> int:
    del argv
    if FLAGS.record == "families":
        record_families(FLAGS.batch)
    elif FLAGS.record == "fuzz":
        record_fuzz(FLAGS.seeds, FLAGS.cases)
    elif FLAGS.record == "zoo":
        record_zoo(FLAGS.models)
    if FLAGS.expect:
        results = replay_all()
        with open(EXPECTED, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
            f.write("\n")
    if FLAGS.check:
        with open(EXPECTED) as f:
            expected = json.load(f)
        results = replay_all()
        bad = [(name, key) for name, got in results.items() for key, out in got.items()
               if expected.get(name, {}).get(key) != out]
        for name, key in bad:
            print(f"MISMATCH {name} {key}\n  expected {expected.get(name, {}).get(key)}"
                  f"\n  got      {results[name][key]}")
        print(f"{sum(len(v) for v in results.values())} replays, {len(bad)} mismatches")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    app.run(main)
