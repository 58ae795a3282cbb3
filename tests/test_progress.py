"""A slow pass shows on stderr what it is doing, and then what it took."""

import io
import time

import pytest

from sntf.runtime import progress

MIB = 1 << 20


def _report(**fields) -> dict:
    return {"graph": "g", "nodes": 41000, "stage_seconds": {}, **fields}


def test_a_slow_pass_shows_its_stage_then_what_it_took():
    stream = io.StringIO()
    shown = progress.Progress(lambda r: f"train step of {r['graph']!r}", stream, delay=0.0,
                              period=0.01)
    report = _report()
    shown.watch(report)
    report["stage_seconds"]["analysis"] = 0.0
    deadline = time.time() + 5
    while "analysis" not in stream.getvalue() and time.time() < deadline:
        time.sleep(0.01)
    report.update(predicted_peak_bytes=422 * MIB, planned_peak_bytes=23 * MIB)
    shown.finish(report)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("sntf: planning train step of 'g' (41,000 nodes): ")
    assert any(": analysis, " in line for line in lines), lines
    assert lines[-1].startswith("sntf: planned train step of 'g': 41,000 nodes in ")
    assert lines[-1].endswith(" s, planned peak 23.0 MiB of 422.0 predicted")


def test_a_pass_shorter_than_the_delay_shows_nothing():
    stream = io.StringIO()
    shown = progress.Progress(lambda r: "g", stream, delay=60.0)
    report = _report()
    shown.watch(report)
    shown.finish(report)
    assert stream.getvalue() == "" and not shown.shown


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_the_line_is_rewritten_in_place():
    stream = _Terminal()
    shown = progress.Progress(lambda r: "g", stream, delay=0.0)
    report = _report()
    shown.watch(report)
    deadline = time.time() + 5
    while not stream.getvalue() and time.time() < deadline:
        time.sleep(0.01)
    shown.finish(report)
    text = stream.getvalue()
    assert text.startswith("\rsntf: planning g (41,000 nodes): starting, ")
    assert text.count("\n") == 1 and text.endswith("\n")
    assert "\rsntf: planned g: 41,000 nodes in " in text


PROGRAM = """
    import json, logging, sys
    import numpy as np
    import keras
    import sntf
    from sntf.runtime import progress
    progress.DELAY_SECONDS = 0.0      # every plan is slow enough to show
    options = json.loads(sys.argv[1])
    if options.pop("quiet_logger", False):
        logging.getLogger("sntf").setLevel(logging.ERROR)
    sntf.enable(policy="swap+recompute", **options)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, "relu"),
                              keras.layers.Dense(256, "relu"), keras.layers.Dense(4)])
    model.compile("sgd", "mse")
    model.fit(np.ones((64, 64), np.float32), np.ones((64, 4), np.float32),
              epochs=1, batch_size=64, verbose=0)
    nodes = max(r["nodes"] for r in sntf.reports() if r["training"])
    print("RESULT " + json.dumps({"nodes": nodes}))
    """


@pytest.mark.parametrize("options, shows", [
    ({}, True), ({"progress": False}, False), ({"quiet_logger": True}, False)])
def test_in_a_fresh_process_the_display_shows_unless_turned_off(fresh_python, options,
                                                                  shows):
    import json
    import textwrap

    run = fresh_python(args=["-c", textwrap.dedent(PROGRAM), json.dumps(options)])
    nodes = run.result()["nodes"]
    planning = [ln for ln in run.stderr.splitlines() if ln.startswith("sntf: planning ")]
    planned = [ln for ln in run.stderr.splitlines() if ln.startswith("sntf: planned ")]
    if not shows:
        assert not planning and not planned, run.stderr[-2000:]
        return
    assert planning and f"({nodes:,} nodes)" in planning[0], run.stderr[-2000:]
    assert len(planned) == 1 and f": {nodes:,} nodes in " in planned[0]
    assert "planned peak " in planned[0]


def test_the_option_is_a_bool():
    from sntf import config

    assert config.parse_options({}).progress is True
    with pytest.raises(ValueError, match="progress must be True or False"):
        config.parse_options({"progress": "no"})
