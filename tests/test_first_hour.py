"""A new user's first hour: every way sntf would do nothing says so once,
the no-code switches work, and what sntf did reads in a few lines.

Each scenario runs in a fresh process (the plugin registers once per
process), repeats what triggers its warning, and checks the warning was
logged once, through the `sntf` logger, with the fix. The Keras scenarios
take 15-30 s each and are marked slow; the no-code switches run in the
fast subset.
"""

import os
import sysconfig
import textwrap

import pytest

from conftest import REPO

HEADER = textwrap.dedent("""
    import json, logging, os, sys
    import numpy as np
    records = []
    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("sntf").addHandler(Collect())
    logging.basicConfig()   # what a user sees on stderr
    import tensorflow as tf
    import keras

    def build(name="wrn16_4", groups=1, **compile_args):
        layers = keras.layers
        model = keras.Sequential([
            keras.Input((8, 8, 4)),
            layers.Conv2D(8, 3, padding="same", activation="relu", groups=groups),
            layers.GlobalAveragePooling2D(),
            layers.Dense(3)], name=name)
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), **compile_args)
        return model

    x = np.random.default_rng(0).random((16, 8, 8, 4), dtype=np.float32)
    y = np.arange(16) % 3

    def fit(model):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)

    def done(**extra):
        import sntf
        training = [[r["graph"], r["action"]] for r in sntf.reports() if r["training"]]
        print("RESULT " + json.dumps(dict(warnings=records, training=training, **extra)))
    """)


def _run(fresh_python, body, env=None):
    run = fresh_python(HEADER + textwrap.dedent(body), env=env)
    result = run.result()
    assert "sntf:sntf:" not in run.stderr, run.stderr[-2000:]
    return result, run


def _once(result, *words):
    """The one warning holding every word; no other warning repeats it."""
    hits = [w for w in result["warnings"] if all(word in w for word in words)]
    assert len(hits) == 1, (words, result["warnings"])
    assert len(result["warnings"]) == len(set(result["warnings"])), result["warnings"]
    assert not hits[0].startswith("sntf:"), hits[0]
    return hits[0]


# ---------------------------------------------------------------- one per cause


@pytest.mark.slow
def test_enable_after_the_first_fit(fresh_python):
    result, run = _run(fresh_python, """
        import sntf
        model = build()
        fit(model)                       # traced and optimized without sntf
        sntf.enable(policy="swap+recompute")
        fit(model)
        fit(model)
        before = len([r for r in sntf.reports() if r["training"]])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))           # the fix the warning gives
        fit(model)
        after = len([r for r in sntf.reports() if r["training"]])
        done(before=before, after=after)
    """)
    message = _once(result, "'wrn16_4' ran fit() before sntf was enabled",
                    "call sntf.enable() before the first fit()", "model.compile")
    assert result["before"] == 0 and result["after"] >= 1, result
    assert f"WARNING:sntf:{message}" in run.stderr


@pytest.mark.slow
def test_keras_jit_compile(fresh_python):
    result, _ = _run(fresh_python, """
        import sntf
        sntf.enable(policy="swap+recompute")
        model = build(jit_compile=True)
        fit(model)
        fit(model)
        done()
    """)
    _once(result, "'wrn16_4' is compiled with jit_compile=True", "no report appears",
          "jit_compile=False")
    assert result["training"] == []       # XLA's: no report at all


@pytest.mark.slow
def test_tf_function_jit_compile(fresh_python):
    result, _ = _run(fresh_python, """
        import sntf
        sntf.enable(policy="swap+recompute")
        w = tf.Variable(tf.ones([4, 4]))

        @tf.function(jit_compile=True)
        def step(v):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.nn.relu(v @ w))
            w.assign_sub(0.1 * tape.gradient(loss, w))
            return loss

        other = tf.function(lambda v: v * 2, jit_compile=True)
        for _ in range(2):
            step(tf.ones([2, 4]))
        other(tf.ones([2]))
        done()
    """)
    _once(result, "tf.function 'step' is created with jit_compile=True",
          "drop jit_compile=True")


@pytest.mark.slow
def test_grouped_convolution(fresh_python):
    result, _ = _run(fresh_python, """
        import sntf
        sntf.enable(policy="swap+recompute")
        model = build(groups=2)
        fit(model)
        fit(model)
        done()
    """)
    _once(result, "'wrn16_4' has a convolution with groups > 1", "groups=1")
    # The step itself is reported skipped, named, and not warned about twice.
    assert result["training"] and all(
        action == "skipped" for _, action in result["training"]), result["training"]
    assert not any("calls XLA-compiled code" in w for w in result["warnings"])


@pytest.mark.slow
@pytest.mark.parametrize("option, value", [("use_plugin_optimizers", False),
                                           ("disable_meta_optimizer", True)])
def test_optimizer_options_that_keep_plugins_out(fresh_python, option, value):
    result, _ = _run(fresh_python, f"""
        import sntf
        tf.config.optimizer.set_experimental_options({{{option!r}: {value!r}}})
        sntf.enable(policy="swap+recompute")
        enabled = sntf.enabled()
        fit(build())
        fit(build("second"))
        done(enabled=enabled, enabled_after=sntf.enabled())
    """)
    _once(result, f"({option}={value})", "sntf.enabled() returns False",
          "set_experimental_options")
    assert result["enabled"] is False and result["enabled_after"] is False
    assert result["training"] == []


@pytest.mark.slow
def test_optimizer_option_set_after_enable(fresh_python):
    result, _ = _run(fresh_python, """
        import sntf
        sntf.enable(policy="off")
        before = sntf.enabled()
        tf.config.optimizer.set_experimental_options({"use_plugin_optimizers": False})
        fit(build())
        fit(build("second"))
        done(before=before, after=sntf.enabled())
    """)
    _once(result, "(use_plugin_optimizers=False)")
    assert (result["before"], result["after"]) == (True, False)


@pytest.mark.slow
def test_keras_run_eagerly(fresh_python):
    result, _ = _run(fresh_python, """
        import sntf
        sntf.enable(policy="swap+recompute")
        model = build(run_eagerly=True)
        fit(model)
        fit(model)
        done()
    """)
    _once(result, "'wrn16_4' is compiled with run_eagerly=True", "without run_eagerly")
    # Its GradientTape runs eagerly too: the same cause, not a second warning.
    assert not any("GradientTape" in w for w in result["warnings"]), result["warnings"]


@pytest.mark.slow
def test_gradient_tape_without_tf_function(fresh_python):
    result, _ = _run(fresh_python, """
        import sntf
        sntf.enable(policy="swap+recompute")
        w = tf.Variable(tf.ones([4, 4]))
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.nn.relu(tf.ones([2, 4]) @ w))
            w.assign_sub(0.1 * tape.gradient(loss, w))
        done()
    """)
    _once(result, "tf.GradientTape outside a tf.function", "@tf.function")


@pytest.mark.slow
def test_no_warning_when_sntf_works(fresh_python):
    result, _ = _run(fresh_python, """
        import sntf
        sntf.enable(policy="swap+recompute")
        model = build()
        fit(model)
        fit(model)
        done()
    """)
    assert result["warnings"] == []
    assert result["training"] and result["training"][0][0] == "train step of 'wrn16_4'"


@pytest.mark.parametrize("call", ["sntf.enable(max_reports=10**20)",
                                  "sntf.enable(budget=2**63)",
                                  "sntf.enable(budget=1)"])
def test_values_that_would_fail_inside_the_pass_are_refused_up_front(call):
    import sntf

    with pytest.raises(ValueError):
        eval(call, {"sntf": sntf})
    assert not sntf.enabled()


# ---------------------------------------------------------------- no-code switches

# A training step whose activations (2 MiB) the swap policies act on; the
# script never imports sntf.
NO_IMPORT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    tf.config.experimental.enable_op_determinism()
    w1 = tf.Variable(tf.random.stateless_normal([512, 512], seed=[1, 2]) * 0.05)
    w2 = tf.Variable(tf.random.stateless_normal([512, 512], seed=[3, 4]) * 0.05)
    x = tf.constant(np.linspace(-1, 1, 1024 * 512, dtype=np.float32).reshape(1024, 512))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = tf.nn.relu(x @ w1)
            loss = tf.reduce_mean(tf.square(tf.nn.relu(h @ w2)))
        for v, g in zip((w1, w2), tape.gradient(loss, (w1, w2))):
            v.assign_sub(0.1 * g)
        return loss

    losses = [float(step()) for _ in range(2)]
    sntf = sys.modules.get("sntf")       # imported by the startup hook, if at all
    reports = [] if sntf is None else [
        [r["action"], len(r["swapped"] or ()), len(r["recomputed"] or ())]
        for r in sntf.reports() if r["training"]]
    print("RESULT " + json.dumps({"losses": losses, "imported": sntf is not None,
                                  "reports": reports, "argv": sys.argv[1:]}))
    """)


@pytest.fixture(scope="module")
def no_import_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "train.py"
    path.write_text(NO_IMPORT)
    return str(path)


def test_startup_hook_is_installed_in_site_packages():
    import sntf_startup

    path = os.path.join(sysconfig.get_paths()["purelib"], sntf_startup.PTH_NAME)
    assert os.path.isfile(path), (
        f"{path} is missing: install sntf with tools/bootstrap.sh or "
        "pip install --no-build-isolation -e .")
    with open(path, encoding="utf-8") as f:
        assert f.read() == sntf_startup.PTH_LINE


def test_environment_switch_rewrites_a_script_that_never_imports_sntf(
        fresh_python, no_import_script):
    plain = fresh_python(args=[no_import_script]).result()
    assert plain["imported"] is False
    run = fresh_python(args=[no_import_script], env={"SNTF_POLICY": "swap+recompute"},
                       cwd=os.path.dirname(no_import_script))
    result = run.result()
    assert result["imported"] is True
    assert result["losses"] == plain["losses"]
    assert any(action == "rewritten" and swapped for action, swapped, _ in
               result["reports"]), result["reports"]


def test_malformed_environment_at_startup_is_one_line(fresh_python):
    run = fresh_python("""
        import json, sys
        print("RESULT " + json.dumps("sntf" in sys.modules))
    """, env={"SNTF_BUDGET": "lots"})
    assert run.result() is False                # the program ran, without sntf
    lines = [line for line in run.stderr.splitlines() if "SNTF_BUDGET" in line]
    assert len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith("sntf: not enabled in this process: ValueError: "
                               "SNTF_BUDGET='lots': sntf: invalid budget 'lots' (")
    assert "Traceback" not in run.stderr


def test_runner_rewrites_a_script(fresh_python, no_import_script):
    run = fresh_python(args=["-m", "sntf", "--policy", "swap+recompute",
                             no_import_script, "--epochs", "3"])
    result = run.result()
    assert result["argv"] == ["--epochs", "3"]        # the script's own arguments
    assert any(action == "rewritten" and swapped for action, swapped, _ in
               result["reports"]), result["reports"]
    summary = [line for line in run.stderr.splitlines() if line.startswith("sntf: policy")]
    assert summary == ["sntf: policy 'swap+recompute', no budget; 1 training graph(s) "
                       "of 1 graph(s) seen"], run.stderr[-2000:]


def test_runner_flag_errors_are_one_line(fresh_python, no_import_script):
    for args, words in ((["--budget", "1", no_import_script], "did you mean a fraction"),
                        (["--policy", "fast", no_import_script], "unknown policy 'fast'"),
                        (["--option", "zeta=1", no_import_script], "unknown option"),
                        (["--policy", "off"], "no script to run"),
                        (["missing.py"], "missing.py: no such file")):
        run = fresh_python(args=["-m", "sntf", *args])
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, (args, run.stderr[-2000:])
        assert lines[0].startswith("python -m sntf: error: ") and words in lines[0]


def test_runner_split_argv():
    from sntf.__main__ import split_argv

    assert split_argv(["r", "--policy", "swap", "--nosummary", "t.py", "--policy", "x"]) \
        == (["r", "--policy", "swap", "--nosummary"], "t.py", None, ["--policy", "x"])
    assert split_argv(["r", "--budget=6GB", "-m", "pkg.train", "-v"]) == (
        ["r", "--budget=6GB"], None, "pkg.train", ["-v"])
    assert split_argv(["r", "--", "-odd.py"]) == (["r"], "-odd.py", None, [])


# ---------------------------------------------------------------- what sntf did


@pytest.mark.slow
def test_summary_names_the_model_and_fits_on_a_line(fresh_python):
    result, run = _run(fresh_python, """
        import sntf
        tf.config.threading.set_inter_op_parallelism_threads(1)
        sntf.enable(budget="2MiB")
        model = build()
        fit(model)
        text = sntf.summary()
        print(text)
        done(summary=text, reports=len(sntf.reports()), ops=callable(sntf.ops.swap_out))
    """)
    lines = result["summary"].splitlines()
    assert lines[0].startswith("sntf: policy 'auto', budget 2097152 bytes (2.0 MiB); "
                               "1 training graph(s) of ")
    assert len(lines) == 2 and result["reports"] > 2, result["summary"]
    line = lines[1]
    assert line.startswith("  train step of 'wrn16_4': "), line
    assert " MiB, budget 2.0 MiB, swapped " in line and ", recomputed " in line
    assert len(line.split("; ", 1)[1]) <= 110, line
    assert result["ops"] is True


@pytest.mark.slow
def test_summary_when_nothing_reached_sntf(fresh_python):
    result, _ = _run(fresh_python, """
        import sntf
        sntf.enable(policy="swap+recompute")
        fit(build(run_eagerly=True))
        done(summary=sntf.summary())
    """)
    assert result["summary"].splitlines()[-1] == (
        "  no training graph reached sntf (see the warnings logged: eager)")


def test_summary_line_of_a_report():
    from sntf.runtime import plugin

    report = {"graph": "train step of 'm'", "action": "rewritten", "training": True,
              "predicted_peak_bytes": 100 << 20, "planned_peak_bytes": 60 << 20,
              "budget_bytes": 64 << 20, "budget_fits": False,
              "achievable_peak_bytes": 70 << 20, "swapped": ["a:0", "b:0"],
              "recomputed": ["c:0"], "reason": "training graph (x (y)); " + "z" * 900}
    assert plugin.summary_line(report) == (
        "train step of 'm': rewritten, peak 100.0 -> 60.0 MiB, budget 64.0 MiB, "
        "swapped 2, recomputed 1; no plan reaches the target (the budget less margin "
        "and allocator slack); least planned 70.0 MiB")
    # The target comes from its field, never from the reason's prose.
    report["reason"] = "auto: budget 67108864 bytes (plan target 1 bytes: ...)"
    report["budget_target_bytes"] = 40 << 20
    assert plugin.short_reason(report) == (
        "no plan reaches the 40.0 MiB target (the budget less margin and allocator "
        "slack); least planned 70.0 MiB")
    report["budget_fits"] = True
    assert plugin.short_reason(report) == (
        "fits the 40.0 MiB target (the budget less margin and allocator slack)")
    # A training graph's gist is its notes, not why it is a training graph.
    report.update(reason="training graph (x (y)); " + "z" * 900, training_reason="x (y)",
                  notes=["z" * 900], budget_bytes=None, budget_fits=None)
    reason = plugin.short_reason(report)
    assert reason == "z" * 107 + "..." and len(reason) == plugin.REASON_CHARACTERS
    report["notes"] = ["swap: 3 tensor(s)", "order: 2 edge(s)", "y" * 200]
    assert plugin.short_reason(report) == "swap: 3 tensor(s); order: 2 edge(s)"
    report.update(deferred=True)
    assert plugin.short_reason(report).startswith("deferred: ")
    report.update(action="skipped", reason="XLA-compiled graph: custom ops cannot run",
                  deferred=False, training_reason=None, notes=[])
    assert plugin.short_reason(report) == "XLA-compiled graph: custom ops cannot run"


def test_import_sntf_makes_ops_available():
    import sntf

    assert callable(sntf.ops.swap_out) and callable(sntf.ops.cache_in)


def test_startup_module_is_importable_from_the_repository():
    assert os.path.isfile(os.path.join(REPO, "sntf_startup.py"))


def test_pool_fallback_warning_reads_the_loaded_op_library(monkeypatch, caplog):
    """The fallback warning reads the swap kernels' counters once the op
    library is loaded: it must see the library loaded (and warn once), not
    skip for want of an attribute the loader no longer has."""
    from sntf.runtime import native, noops

    native.load_ops()
    assert native.ops_loaded()
    monkeypatch.setattr(native, "swap_stats", lambda: {"pool_fallbacks": 2})
    monkeypatch.setattr(native, "pool_stats", lambda: {"limit_bytes": 4096})
    monkeypatch.setattr(noops, "_warned", set())
    with caplog.at_level("WARNING", logger="sntf"):
        noops.check_pool_fallbacks()
        noops.check_pool_fallbacks()
    lines = [r.getMessage() for r in caplog.records if "could not hold" in r.getMessage()]
    assert len(lines) == 1 and "limit 4096 bytes" in lines[0] and "2 swapped" in lines[0]


def test_an_xla_skip_is_told_by_its_code_not_its_wording(monkeypatch):
    """A training graph skipped as XLA-compiled is warned about once, by the
    report's skip code; a reason that merely mentions XLA is not."""
    from sntf.runtime import noops

    monkeypatch.setattr(noops, "_warned", set())
    told = []
    monkeypatch.setattr(noops, "warn_once", lambda cause, **f: told.append(cause))
    report = {"training": True, "action": "skipped", "graph": "g",
              "reason": "not XLA at all", "skip": "not_training"}
    noops.check_report(report)
    assert told == []
    noops.check_report(dict(report, skip="xla_compiled", reason="compiled"))
    assert told == ["xla_graph"]
