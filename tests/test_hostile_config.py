"""Hostile use of the switch (issue #41, parts 3 and 5): a host pool limit
that outlives the options that set it, the runner's flag against a
malformed environment, and set_options naming itself in its errors."""

from __future__ import annotations

import os
import sys

import pytest

from sntf import config


def test_set_options_names_itself_in_an_unknown_option_error():
    with pytest.raises(TypeError) as excinfo:
        config.set_options({"host_pool_limt": 4096})
    message = str(excinfo.value)
    assert message.startswith("sntf.config.set_options() got unknown option(s) "
                              "['host_pool_limt']; accepted options: "), message
    assert "sntf.enable()" not in message
    assert config.current().enabled is False


def test_host_pool_limit_follows_the_options(fresh_python):
    run = fresh_python("""
        import json, os
        import sntf

        def limit():
            return sntf.stats()["pool"]["limit_bytes"]

        seen = {}
        sntf.enable("swap", host_pool_limit=4096)
        seen["set"] = limit()
        sntf.enable("swap")                                   # the issue's case
        seen["enable_again"] = limit()
        sntf.enable("swap", host_pool_limit="1MiB")
        sntf.disable()
        seen["disabled"] = limit()          # rewritten graphs keep their limit
        sntf.enable("swap")
        seen["disable_enable"] = limit()
        sntf.config.set_options({"host_pool_limit": 8192})
        seen["set_options"] = limit()
        sntf.config.set_options({"host_pool_limit": None})
        seen["set_options_none"] = limit()
        sntf.config.set_policy("recompute")                  # keeps the options
        sntf.config.set_options({"host_pool_limit": 8192})
        sntf.config.set_policy("swap")
        seen["set_policy_keeps"] = limit()
        from sntf.runtime import native
        seen["physical"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        seen["sysconf"] = getattr(native, "physical_memory_bytes", lambda: None)()
        print("RESULT " + json.dumps(seen))
        """)
    seen = run.result()
    physical = seen.pop("physical")
    assert physical > 1 << 20
    helper = seen.pop("sysconf")
    # None is the RAM default: the pool's own, counted as the pool counts it.
    assert seen == {"set": 4096, "enable_again": physical, "disabled": 1 << 20,
                    "disable_enable": physical, "set_options": 8192,
                    "set_options_none": physical, "set_policy_keeps": 8192}
    assert helper == physical


def test_host_pool_limit_none_means_the_environment_limit(fresh_python):
    run = fresh_python("""
        import json
        import sntf
        sntf.enable("swap", host_pool_limit=4096)
        sntf.enable("swap")
        print("RESULT " + json.dumps(sntf.stats()["pool"]["limit_bytes"]))
        """, env={"SNTF_HOST_POOL_LIMIT": "2MiB"})
    assert run.result() == 2 << 20


@pytest.mark.parametrize("variable, value", [
    ("SNTF_POLICY", "swap+foo"), ("SNTF_BUDGET", "lots")])
def test_runner_flags_override_a_malformed_environment(fresh_python, tmp_path,
                                                       variable, value):
    """`SNTF_POLICY=swap+foo python -m sntf --policy swap train.py` runs the
    script under the flag's policy: the flag overrides the variable, as it
    does a well-formed one."""
    script = tmp_path / "train.py"
    script.write_text("import json, sntf\n"
                      "print('RESULT ' + json.dumps([sntf.config.get_policy(), "
                      "sntf.config.get_memory_budget()]))\n")
    flag = ["--policy", "swap"] if variable == "SNTF_POLICY" else ["--budget", "64MiB"]
    run = fresh_python(args=["-m", "sntf", *flag, "--nosummary", str(script)],
                       env={variable: value})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "not enabled in this process" not in run.stderr, run.stderr[-3000:]
    policy, budget = run.result()
    if variable == "SNTF_POLICY":
        assert policy == "swap" and budget is None
    else:
        assert policy == "auto" and budget == 64 << 20


def test_runner_without_the_flag_still_refuses_the_malformed_variable(fresh_python,
                                                                      tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    run = fresh_python(args=["-m", "sntf", "--budget", "64MiB", str(script)],
                       env={"SNTF_POLICY": "swap+foo"})
    assert run.returncode != 0 and "ran" not in run.stdout
    assert run.returncode > 0, run.returncode          # no signal
    assert "SNTF_POLICY='swap+foo'" in run.stderr, run.stderr[-3000:]


def test_runner_flags_read_from_the_command_line():
    argv = [sys.executable, "-X", "dev", "-m", "sntf", "--policy=swap", "--budget",
            "1GB", "--option", "batch_size=8", "train.py", "--policy", "off"]
    assert config.runner_flags(argv) == {"policy": "swap", "budget": "1GB"}
    assert config.runner_flags([sys.executable, "-msntf", "-policy", "off",
                                "t.py"]) == {"policy": "off"}
    assert config.runner_flags([sys.executable, "train.py", "--policy", "x"]) == {}
    assert config.runner_flags([sys.executable, "-c", "pass", "-m", "sntf",
                                "--policy", "x"]) == {}
    assert config.runner_flags([sys.executable, "-m", "sntf", "--", "--policy",
                                "x"]) == {}
    environ = {"SNTF_POLICY": "swap+foo", "SNTF_BUDGET": "2GB"}
    assert config.from_environment(environ, argv=[
        sys.executable, "-m", "sntf", "--policy", "swap", "t.py"])[1].bytes == 2 * 10**9
    with pytest.raises(ValueError, match="SNTF_POLICY='swap\\+foo'"):
        config.from_environment(environ, argv=[sys.executable, "t.py"])
    assert os.environ.get("SNTF_POLICY") is None
