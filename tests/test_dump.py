"""tools/sntf_dump: each case runs the tool in a fresh process (the Grappler
plugin registers once per process)."""

import json
import os
import struct
import textwrap

import pytest

from conftest import REPO, run_python

TOOL = os.path.join(REPO, "tools", "sntf_dump")
BATCH = 16
GRAPH_FILES = ("original.pbtxt", "rewritten.pbtxt", "plan.json", "timeline.png",
               "timeline.json")

# A tiny CNN with BatchNormalization; compiled, with a sparse loss, so the
# tool synthesizes integer labels.
MODEL_FILE = textwrap.dedent("""
    import keras


    def build_model():
        layers = keras.layers
        model = keras.Sequential([
            keras.Input((16, 16, 3)),
            layers.Conv2D(8, 3, padding="same", activation="relu"),
            layers.BatchNormalization(),
            layers.MaxPooling2D(),
            layers.Conv2D(16, 3, padding="same", activation="relu"),
            layers.BatchNormalization(),
            layers.Flatten(),
            layers.Dense(10),
        ], name="tiny_cnn")
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
""")


def _tool(*args, cwd=None):
    return run_python(args=[TOOL, *map(str, args)], timeout=300, cwd=cwd)


def _describe(run):
    return (f"rc={run.returncode}\nstdout:\n{run.stdout[-3000:]}\n"
            f"stderr:\n{run.stderr[-3000:]}")


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def _one_line_error(run):
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, _describe(run)
    assert "Traceback" not in run.stderr, _describe(run)
    assert len(lines) == 1, _describe(run)
    assert lines[0].startswith("sntf_dump: error:"), _describe(run)
    return lines[0]


# The same CNN as build_model(keras), not compiled (the tool compiles it with
# Adam and a sparse loss), with its own make_data(n).
MODEL_FILE_KERAS_ARG = textwrap.dedent("""
    import numpy as np


    def build_model(keras):
        layers = keras.layers
        return keras.Sequential([
            keras.Input((16, 16, 3)),
            layers.Conv2D(8, 3, padding="same", activation="relu"),
            layers.BatchNormalization(),
            layers.MaxPooling2D(),
            layers.Conv2D(16, 3, padding="same", activation="relu"),
            layers.BatchNormalization(),
            layers.Flatten(),
            layers.Dense(10),
        ], name="tiny_cnn")


    def make_data(n):
        rng = np.random.default_rng(1)
        return (rng.random((n, 16, 16, 3), dtype=np.float32),
                rng.integers(0, 10, n))
""")


@pytest.fixture(scope="module")
def cnn_dump(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dump_py")
    model = tmp / "tiny_cnn.py"
    model.write_text(MODEL_FILE_KERAS_ARG)
    out = tmp / "out"
    run = _tool("--model", model, "--batch", BATCH, "--out", out)
    return run, out


def test_python_model_file_dumps_every_file(cnn_dump):
    run, out = cnn_dump
    assert run.returncode == 0, _describe(run)
    folder = out / "graph_0"
    for name in GRAPH_FILES:
        assert (folder / name).is_file(), f"{name} missing\n{_describe(run)}"
    for name in ("original", "rewritten"):
        events = list((folder / "tensorboard" / name).glob("events.out.tfevents.*"))
        assert events and events[0].stat().st_size > 0, name
    assert (out / "summary.txt").is_file()
    width, height = _png_size(folder / "timeline.png")
    assert width > 300 and height > 200


def test_timeline_has_two_curves_and_the_lower_bound(cnn_dump):
    run, out = cnn_dump
    assert run.returncode == 0, _describe(run)
    data = json.loads((out / "graph_0" / "timeline.json").read_text())
    plan = json.loads((out / "graph_0" / "plan.json").read_text())
    series = data["series"]
    assert sorted(series) == ["original", "planned"]
    assert len(series["original"]) == len(series["planned"]) > 10
    # Policy "off": the planned graph is the original one.
    assert series["planned"] == series["original"]
    assert max(series["original"]) == data["predicted_peak_bytes"]
    assert data["lower_bound_bytes"] == plan["lower_bound_bytes"] > 0
    assert data["lower_bound_bytes"] <= data["predicted_peak_bytes"]
    assert data["budget_bytes"] is None
    assert 0 <= data["backward_start"] < len(series["original"])
    assert data["checkpoint_steps"]


def test_plan_json_and_graphs_load_back(cnn_dump):
    from google.protobuf import text_format
    import tensorflow as tf

    run, out = cnn_dump
    assert run.returncode == 0, _describe(run)
    folder = out / "graph_0"
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["policy"] == "off"
    assert plan["predicted_peak_bytes"] > 0
    assert plan["planned_peak_bytes"] == plan["predicted_peak_bytes"]
    assert plan["batch"] == BATCH
    assert plan["nodes"] > 100
    # Policy "off" moves nothing and says so for every activation it keeps.
    assert plan["decisions"] and all(
        d["action"] == "keep" and [r["code"] for r in d["why"]] == ["untouched"]
        for d in plan["decisions"])
    graphs = {}
    for name in ("original", "rewritten"):
        graph_def = text_format.Parse((folder / f"{name}.pbtxt").read_text(),
                                      tf.compat.v1.GraphDef())
        assert len(graph_def.node) > 100
        graphs[name] = graph_def
    assert len(graphs["original"].node) == plan["nodes"]
    assert graphs["rewritten"] == graphs["original"]  # policy "off"


def test_summary_reports_predicted_and_measured(cnn_dump):
    run, out = cnn_dump
    assert run.returncode == 0, _describe(run)
    text = run.stdout
    assert "predicted peak" in text and "measured CPU:0 peak" in text
    assert "predicted (graph ran unchanged)/measured" in text and "lower bound" in text
    assert "graph_0" in text and "tiny_cnn" in text
    assert "make_data(16)" in text and "not compiled" in text
    # The stages of the pass, in the order they ran.
    stages = next(line for line in text.splitlines() if line.startswith("  stages: "))
    names = [part.split()[0] for part in stages[len("  stages: "):].split(" -> ")]
    assert names[:5] == ["parse", "index", "detect", "shapes", "analysis"], stages
    assert (out / "summary.txt").read_text() == text


def test_saved_keras_model_with_budget(tmp_path):
    path = tmp_path / "saved.keras"
    saved = run_python(code=MODEL_FILE + textwrap.dedent(f"""
        build_model().save({str(path)!r})
        print("RESULT {{}}")
    """))
    saved.result()
    out = tmp_path / "out"
    run = _tool("--model", path, "--batch", 8, "--budget", "64MiB", "--out", out)
    assert run.returncode == 0, _describe(run)
    # A budget alone means policy "auto": a plan, not a report of none.
    assert "policy 'auto', budget 64MiB" in run.stdout, run.stdout
    data = json.loads((out / "graph_0" / "timeline.json").read_text())
    assert data["budget_bytes"] == 64 << 20
    assert len(data["series"]["original"]) > 10
    plan = json.loads((out / "graph_0" / "plan.json").read_text())
    assert plan["batch"] == 8 and plan["predicted_peak_bytes"] > 0
    # The measurement is set against the graph that ran.
    label = ("planned (rewritten graph, which ran)/measured"
             if plan["action"] == "rewritten" else "predicted (graph ran unchanged)/measured")
    assert label in run.stdout, run.stdout
    assert "saved.keras" in run.stdout and "budget 64MiB" in run.stdout
    assert "random samples" in run.stdout and "not compiled" not in run.stdout
    _png_size(out / "graph_0" / "timeline.png")


def test_help():
    run = _tool("--help")
    assert run.returncode == 0, _describe(run)
    for flag in ("--model", "--batch", "--policy", "--budget", "--out", "--steps"):
        assert flag in run.stdout
    assert "build_model" in run.stdout


def test_bad_budget_behaviour_free_budget_exits_2(tmp_path):
    model = tmp_path / "m.py"
    model.write_text(MODEL_FILE)
    line = _one_line_error(_tool("--model", model, "--batch", 4, "--policy", "auto",
                                 "--budget", "-3", "--out", tmp_path / "out"))
    assert "invalid budget '-3'" in line and "'auto'" in line
    assert not (tmp_path / "out").exists()


def test_missing_model_file_exits_2(tmp_path):
    line = _one_line_error(_tool("--model", tmp_path / "nope.py", "--batch", 4))
    assert "no such file" in line and "nope.py" in line


@pytest.mark.parametrize("case", ["no_build_model", "batch_zero", "batch_text",
                                  "no_batch", "bad_policy", "bad_budget"])
def test_input_errors_exit_2(tmp_path, case):
    good = tmp_path / "m.py"
    good.write_text(MODEL_FILE)
    args = {
        "no_build_model": ("--model", tmp_path / "empty.py", "--batch", 4),
        "batch_zero": ("--model", good, "--batch", 0),
        "batch_text": ("--model", good, "--batch", "many"),
        "no_batch": ("--model", good),
        "bad_policy": ("--model", good, "--batch", 4, "--policy", "fast"),
        "bad_budget": ("--model", good, "--batch", 4, "--budget", "lots"),
    }[case]
    (tmp_path / "empty.py").write_text("import os\n\ndef make_data(n):\n    return None\n")
    line = _one_line_error(_tool(*args))
    expected = {"no_build_model": "build_model", "batch_zero": "--batch",
                "batch_text": "batch", "no_batch": "--batch",
                "bad_policy": "policy", "bad_budget": "budget"}[case]
    assert expected in line
