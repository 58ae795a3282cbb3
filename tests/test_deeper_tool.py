"""The depth search of benchmarks/deeper.py (sntf.testing.deeper: pure, with
fake fits/measure functions) and one end-to-end run on a tiny configuration."""

import io
import json
import os
import subprocess

import pytest

from conftest import REPO, run_python

from sntf.testing import deeper

MIB = 1 << 20


def _threshold_fits(boundary, calls):
    """fits(depth) true exactly up to `boundary` (0: nothing fits)."""
    def fits(depth):
        calls.append(depth)
        return depth <= boundary, {"depth": depth}
    return fits


@pytest.mark.parametrize("max_depth", [1, 2, 3, 5, 8, 13, 64, 100, 128])
def test_search_finds_exact_boundary(max_depth):
    bound = deeper.remaining_trials(0, None, max_depth)
    for boundary in range(0, max_depth + 2):
        calls = []
        result = deeper.search_deepest(_threshold_fits(boundary, calls), max_depth)
        expected = min(boundary, max_depth) or None
        assert result.deepest == expected, (boundary, calls)
        assert result.capped == (boundary >= max_depth)
        assert len(calls) == len(set(calls)), f"a depth tried twice: {calls}"
        assert all(1 <= d <= max_depth for d in calls), calls
        assert [t.depth for t in result.trials] == calls
        assert len(calls) <= bound, (boundary, calls, bound)


def test_search_grows_exponentially_then_bisects():
    calls = []
    result = deeper.search_deepest(_threshold_fits(37, calls), 128)
    assert calls[:7] == [1, 2, 4, 8, 16, 32, 64]
    # Then bisection between 32 (fits) and 64 (does not).
    assert all(32 < d < 64 for d in calls[7:])
    assert result.deepest == 37 and not result.capped
    assert result.trial(37).fits and not result.trial(38).fits


def test_search_respects_max_depth():
    calls = []
    result = deeper.search_deepest(_threshold_fits(10**6, calls), 100)
    assert calls == [1, 2, 4, 8, 16, 32, 64, 100]
    assert result.deepest == 100 and result.capped


def test_search_when_depth_one_fails():
    calls = []
    result = deeper.search_deepest(_threshold_fits(0, calls), 128)
    assert calls == [1]
    assert result.deepest is None and not result.capped
    assert not result.trials[0].fits


def test_search_progress_bound_never_grows():
    for boundary in (0, 1, 5, 37, 128):
        seen = []
        deeper.search_deepest(_threshold_fits(boundary, []), 128,
                              on_trial=lambda t, left: seen.append(left))
        totals = [i + 1 + left for i, left in enumerate(seen)]
        assert totals == sorted(totals, reverse=True), (boundary, totals)
        assert totals[0] <= deeper.remaining_trials(0, None, 128)
        assert seen[-1] == 0


def test_search_rejects_bad_max_depth():
    with pytest.raises(ValueError):
        deeper.search_deepest(lambda d: (True, None), 0)


def _fake_measure(tf_per_depth, sntf_per_depth, base=10 * MIB, fail_at=None,
                  timeout_at=None):
    """A stand-in for measure_peak.measure: peak = base + per_depth * depth."""
    calls = []

    def measure(family, batch, steps=2, policy="off", depth=None, repeats=1,
                timeout=900, budget=None, **kw):
        calls.append((policy, depth, budget))
        sntf_on = policy != "none"
        if sntf_on and depth == fail_at:
            raise RuntimeError("measure_peak failed (rc=1)\nstderr:\nTraceback ...\n"
                               "ValueError: something broke\n  in the rewrite\n")
        if sntf_on and depth == timeout_at:
            raise subprocess.TimeoutExpired(["worker"], timeout)
        per = sntf_per_depth if sntf_on else tf_per_depth
        return {"family": family, "depth": depth, "batch": batch, "policy": policy,
                "layers": 10 + 21 * depth,
                "measured_peak_bytes": base + per * depth,
                "seconds_per_step": 0.01 * depth * (1.5 if sntf_on else 1.0),
                "losses": [2.3, 2.2]}

    return measure, calls


def test_run_with_fake_measure_table_and_json():
    # TF: 10 + 8*d MiB <= 50 MiB up to d=5; sntf: 10 + 2*d <= 50 up to d=20.
    measure, calls = _fake_measure(8 * MIB, 2 * MIB)
    stream = io.StringIO()
    out = deeper.run("resnet", 8, 50 * MIB, "swap+recompute", steps=4, max_depth=64,
                     measure=measure, progress=deeper.ProgressBar(stream))
    assert out["tf"]["deepest_depth"] == 5 and out["tf"]["layers"] == 115
    assert out["sntf"]["deepest_depth"] == 20 and out["sntf"]["layers"] == 430
    assert out["deeper"] == pytest.approx(430 / 115)
    # TensorFlow never gets a budget; sntf always gets the budget in bytes.
    assert all(b is None for p, _, b in calls if p == "none")
    assert all(b == 50 * MIB for p, _, b in calls if p != "none")
    # Depth 5 is not on the sntf search's path: one extra sntf trial there.
    assert out["sntf"]["time_trial"]["depth"] == 5
    assert out["time_ratio"]["value"] == pytest.approx(1.5)
    assert out["time_ratio"]["source"] == "extra trial"
    assert "depth 6: peak 58.0 MiB > budget 50.0 MiB" in out["tf"]["limit"]
    table = deeper.result_table(out)
    assert "| resnet | 8 | 50 MiB | 5 | 115 | 50.0 | swap+recompute | 20 | 430 |" in table
    assert "| 1.50 | 3.74x |" in table
    trials = deeper.trials_table(out)
    assert trials.count("\n") == 2 + len(calls) - 1
    json.dumps(out)  # everything JSON-able
    # One progress line per finished trial (not a terminal).
    lines = stream.getvalue().splitlines()
    assert len(lines) == len(calls)
    assert lines[-1].startswith("[" + "#" * 24 + "]")


def test_run_records_failures_and_timeouts():
    # sntf would fit up to 20 but fails at depth 4 and times out at 3.
    measure, _ = _fake_measure(8 * MIB, 2 * MIB, fail_at=4, timeout_at=3)
    out = deeper.run("resnet", 8, 50 * MIB, "swap+recompute", max_depth=64,
                     measure=measure, time_ratio=False)
    sntf = out["sntf"]
    assert sntf["deepest_depth"] == 2
    reasons = {t["depth"]: t["reason"] for t in sntf["trials"]}
    assert reasons[4] == "failed: ValueError: something broke in the rewrite"
    assert reasons[3] == "timed out after 900 s"
    assert "Traceback" in next(t for t in sntf["trials"] if t["depth"] == 4)["error"]
    # TF's deepest (5) was not measured by sntf, and no extra trial was asked.
    assert out["time_ratio"]["value"] is None
    assert "--notime_ratio" in out["time_ratio"]["note"]
    assert "n/a" in deeper.result_table(out)


def test_run_flags_a_single_timed_step():
    measure, _ = _fake_measure(8 * MIB, 2 * MIB)
    out = deeper.run("resnet", 8, 50 * MIB, "swap+recompute", steps=2, max_depth=64,
                     measure=measure)
    assert "| 1.50 (1 timed step) |" in deeper.result_table(out)
    assert "one timed step" in out["time_ratio"]["note"]


def test_run_when_nothing_fits():
    measure, calls = _fake_measure(8 * MIB, 2 * MIB, base=100 * MIB)
    out = deeper.run("resnet", 8, 50 * MIB, "swap+recompute", max_depth=8,
                     measure=measure)
    assert out["tf"]["deepest_depth"] is None and out["sntf"]["deepest_depth"] is None
    assert len(calls) == 2 and out["deeper"] is None
    table = deeper.result_table(out)
    assert "none (depth 1: peak 108.0 MiB > budget 50.0 MiB)" in table
    assert "TensorFlow fits no depth" in table


def test_hard_limit_counts_trains_not_peaks():
    """Under a hard limit a depth fits when it trains: the worker gets the
    limit, sntf no budget (it reads the device's limit, as `sntf.enable()`
    does), and a step that needs more fails with ResourceExhaustedError."""
    calls = []

    def measure(family, batch, steps=2, policy="off", depth=None, repeats=1,
                timeout=900, budget=None, limit_mib=None, **kw):
        calls.append((policy, depth, budget, limit_mib))
        # TensorFlow needs 10 + 8*d MiB, sntf 10 + 2*d MiB.
        need = 10 + (8 if policy == "none" else 2) * depth
        if need > limit_mib:
            raise RuntimeError("measure_peak failed (rc=1)\nstderr:\nTraceback ...\n"
                               "tensorflow.python.framework.errors_impl."
                               "ResourceExhaustedError: OOM when allocating\n")
        return {"family": family, "depth": depth, "layers": 10 + 21 * depth,
                "measured_peak_bytes": need * MIB, "seconds_per_step": 0.01 * depth,
                "losses": [2.3, 2.2]}

    out = deeper.run("resnet", 32, 80 * MIB, "auto", max_depth=64, measure=measure,
                     hard_limit=True)
    assert out["tf"]["deepest_depth"] == 8 and out["sntf"]["deepest_depth"] == 35
    assert all(limit == 80 and budget is None for _, _, budget, limit in calls)
    reasons = {t["depth"]: t["reason"] for t in out["tf"]["trials"]}
    assert reasons[16] == "out of memory"
    assert reasons[8] == "trains under 80 MiB, peak 74.0 MiB"
    assert "| 80 MiB (hard limit) |" in deeper.result_table(out)
    # Any other failure is still a failure, not an out-of-memory verdict.
    fits = deeper.make_fits("resnet", 32, 2, 80 * MIB, "auto", hard_limit=True,
                            measure=lambda *a, **k: (_ for _ in ()).throw(
                                RuntimeError("ValueError: bad\n")))
    ok, record = fits(1)
    assert not ok and record["reason"] == "failed: ValueError: bad"


def test_cli_rejects_bad_flags():
    script = os.path.join(REPO, "benchmarks", "deeper.py")
    run = run_python(args=[script, "--budget", "12XB"], timeout=60)
    assert run.returncode != 0 and "invalid budget" in run.stderr
    run = run_python(args=[script, "--budget", "1GiB", "--policy", "bogus"], timeout=60)
    assert run.returncode != 0 and "unknown policy" in run.stderr
    run = run_python(args=[script], timeout=60)
    assert run.returncode != 0 and "--budget is required" in run.stderr


@pytest.mark.slow
def test_end_to_end_tiny_mlp(tmp_path):
    # mlp at batch 4 peaks near 6 MiB at depth 1 and 24 MiB at depth 2 (each
    # 1024x1024 layer adds weights, gradients and two Adam slots), far from a
    # 16 MiB budget on either side: both searches stop at depth 1 after two
    # trials, whatever the few-percent noise between runs.
    out = tmp_path / "deeper.json"
    script = os.path.join(REPO, "benchmarks", "deeper.py")
    run = run_python(args=[script, "--family", "mlp", "--batch", "4", "--budget", "16MiB",
                           "--policy", "swap+recompute", "--max_depth", "4",
                           "--out", str(out)], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("| mlp | 4 | 16 MiB | 1 | 3 |" in run.stdout), run.stdout
    assert "| swap+recompute | 1 | 3 |" in run.stdout
    assert "(1 timed step) | 1.00x |" in run.stdout
    assert ("Produced by `python benchmarks/deeper.py --family mlp --batch 4 --budget 16MiB "
            "--policy swap+recompute --max_depth 4 --out ") in run.stdout
    assert "sntf depth 2: does not fit" in run.stderr
    data = json.loads(out.read_text())
    for key in ("tf", "sntf"):
        assert data[key]["deepest_depth"] == 1
        assert [t["depth"] for t in data[key]["trials"]] == [1, 2]
        assert data[key]["trials"][1]["reason"].startswith("peak ")
        assert data[key]["trials"][1]["result"]["measured_peak_bytes"] > 16 * MIB
    assert data["sntf"]["trials"][0]["result"]["policy"] == "swap+recompute"
    assert data["sntf"]["trials"][0]["result"]["budget"] == str(16 * MIB)
    assert data["time_ratio"]["source"] == "sntf search"
    assert data["table"] in run.stdout
