"""Tests for sntf.config: budgets, policies, options, the environment and
the tf.config-style setters."""

import dataclasses
import logging
import math
import os

import numpy as np
import pytest

from conftest import run_python
from sntf import config
from sntf.config import Budget

GB = 10**9
MiB = 2**20
GiB = 2**30
RAM = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
SMALL = "below the smallest budget, 1 MiB"
FRACTION_HINT = "did you mean a fraction of device memory"
TOO_LARGE = "too large: at most 2**63-1"


# --------------------------------------------------------------------------
# Budgets: one table, every way a budget is given
# --------------------------------------------------------------------------

# (value, the Budget it means), for every accepted form.
GOOD_BUDGETS = [
    (None, None),
    ("64MB", Budget(bytes=64 * 10**6)),
    (8e9, Budget(bytes=8 * GB)),                     # a float above 1 is bytes
    (1048576.4, Budget(bytes=MiB)),                  # ... rounded
    (np.float32(0.5), Budget(fraction=0.5)),         # numpy scalars
    (np.float64(0.5), Budget(fraction=0.5)),
    (np.int64(GiB), Budget(bytes=GiB)),
    (np.uint32(2 * MiB), Budget(bytes=2 * MiB)),
    (MiB, Budget(bytes=MiB)),                        # the smallest budget
    (2**63 - 1, Budget(bytes=2**63 - 1)),            # the largest
    (12_000_000_000, Budget(bytes=12 * GB)),
    (0.5, Budget(fraction=0.5)),
    (1.0, Budget(fraction=1.0)),                     # all of device memory
    (0.001, Budget(fraction=0.001)),
    ("12GB", Budget(bytes=12 * GB)),
    ("12gb", Budget(bytes=12 * GB)),
    (" 12 GB ", Budget(bytes=12 * GB)),
    ("12G", Budget(bytes=12 * GB)),
    ("2TB", Budget(bytes=2 * 10**12)),
    ("512MiB", Budget(bytes=512 * MiB)),
    ("1.5GiB", Budget(bytes=1610612736)),
    ("1TiB", Budget(bytes=2**40)),
    ("1024KiB", Budget(bytes=MiB)),
    ("1048576", Budget(bytes=MiB)),
    ("1e9", Budget(bytes=10**9)),
    ("8e9", Budget(bytes=8 * GB)),
    ("50%", Budget(fraction=0.5)),
    (" 50 % ", Budget(fraction=0.5)),
    ("100%", Budget(fraction=1.0)),
    ("12.5%", Budget(fraction=0.125)),
    ("0.25", Budget(fraction=0.25)),
    (" 0.25\t", Budget(fraction=0.25)),
    (".5", Budget(fraction=0.5)),
    ("1.0", Budget(fraction=1.0)),
    ("auto", Budget(auto=True)),
    (" AUTO ", Budget(auto=True)),
]

# (value, the reason the error gives), for every refused form.
BAD_BUDGETS = [
    (1, SMALL),                          # one byte: surely not meant
    ("1", SMALL),
    (1.5, SMALL),                        # a float above 1 is bytes: 2 bytes
    (MiB - 1, SMALL),
    ("100B", SMALL),
    ("3kb", SMALL),
    ("4KiB", SMALL),
    (np.int32(4096), SMALL),
    (5e-324, "0 bytes, " + SMALL),       # a fraction that rounds to zero
    (1e-12, SMALL),
    ("0.5B", "it rounds to zero bytes"),
    (0, "it must be positive"),
    (-1, "it must be positive"),
    (-12 * GB, "it must be positive"),
    (0.0, "it must be positive"),
    (-0.5, "it must be positive"),
    ("-5GB", "it must be positive"),
    ("0", "it must be positive"),
    ("0GB", "it must be positive"),
    (2**63, TOO_LARGE),                  # beyond int64
    (10**20, TOO_LARGE),
    (1e19, TOO_LARGE),
    ("9223372036854775808", TOO_LARGE),
    ("99999999999999999999GB", TOO_LARGE),
    ("1e400GB", TOO_LARGE),
    ("1e400", TOO_LARGE),
    (float("nan"), "not a finite number"),
    (float("inf"), "not a finite number"),
    (float("-inf"), "not a finite number"),
    (True, "a bool is not a budget"),
    (False, "a bool is not a budget"),
    (np.bool_(True), "a bool is not a budget"),
    ("0%", "a percentage must lie in (0, 100]"),
    ("150%", "a percentage must lie in (0, 100]"),
    ("", "an empty string"),
    ("   ", "an empty string"),
    ("abc", "not a size, fraction or percentage"),
    ("12XB", "unknown unit 'XB'"),
    ("12Ki", "unknown unit 'Ki'"),
    ("GB", "not a size, fraction or percentage"),
    ("12 G B", "not a size, fraction or percentage"),
    ([1], "unsupported type list"),
    ((1,), "unsupported type tuple"),
    ({"bytes": 1}, "unsupported type dict"),
    (b"12GB", "unsupported type bytes"),
]


@pytest.mark.parametrize("value, expected", GOOD_BUDGETS, ids=repr)
def test_budget_argument_accepted(value, expected):
    assert config.parse_budget(value, RAM) == expected
    assert config.parse_budget(value) == expected


@pytest.mark.parametrize("value, why", BAD_BUDGETS, ids=repr)
def test_budget_argument_refused(value, why):
    with pytest.raises(ValueError) as excinfo:
        config.parse_budget(value, RAM)
    message = str(excinfo.value)
    assert message.startswith(f"sntf: invalid budget {value!r} (")
    assert why in message
    assert message.endswith(f"accepted forms: {config.BUDGET_FORMS}")


@pytest.mark.parametrize("value", [1, "100B", 1.5, MiB - 1], ids=repr)
def test_budget_below_a_mebibyte_asks_for_a_fraction(value):
    with pytest.raises(ValueError, match=FRACTION_HINT):
        config.parse_budget(value)


def _env_text(value):
    """How a value reads when it is written into SNTF_BUDGET."""
    return value if isinstance(value, str) else repr(float(value)) \
        if isinstance(value, (float, np.floating)) else str(value)


ENV_GOOD = [(v, b) for v, b in GOOD_BUDGETS
            if v is not None and (not isinstance(v, str) or v.strip())]
ENV_BAD = [(v, why) for v, why in BAD_BUDGETS
           if isinstance(v, (str, int, float, np.integer, np.floating))
           and not isinstance(v, (bool, np.bool_)) and str(v).strip()
           and (not isinstance(v, float) or math.isfinite(v))]


@pytest.mark.parametrize("value, expected", ENV_GOOD, ids=repr)
def test_budget_environment_accepted(value, expected):
    policy, budget = config.from_environment({"SNTF_BUDGET": _env_text(value)}, RAM)
    assert (policy, budget) == ("auto", expected)


@pytest.mark.parametrize("value, why", ENV_BAD, ids=repr)
def test_budget_environment_refused_with_the_same_reason(value, why):
    text = _env_text(value)
    with pytest.raises(ValueError) as excinfo:
        config.from_environment({"SNTF_BUDGET": text}, RAM)
    message = str(excinfo.value)
    assert message.startswith(f"SNTF_BUDGET={text.strip()!r}: sntf: invalid budget")
    assert why in message


@pytest.mark.parametrize("value, why", BAD_BUDGETS, ids=repr)
def test_budget_enable_and_setter_refuse_before_loading_anything(value, why):
    import sntf

    for call in (lambda: sntf.enable(policy="off", budget=value),
                 lambda: config.set_memory_budget(value)):
        with pytest.raises(ValueError) as excinfo:
            call()
        assert why in str(excinfo.value)
    assert not sntf.enabled()


def test_budget_tools_refuse_with_the_same_reasons(tmp_path):
    """sntf_dump --budget and python -m sntf --budget parse with the same
    rules (in one fresh process: the tool sets TF_* variables at import)."""
    model = tmp_path / "m.py"
    model.write_text("def build_model():\n    pass\n")
    texts = sorted({_env_text(v) for v, _ in ENV_BAD + ENV_GOOD})
    run = run_python(f"""
        import json
        from sntf import __main__ as runner
        from sntf.tools import dump
        out = {{}}
        for text in {texts!r}:
            got = []
            try:
                got.append(repr(dump.parse_flags(
                    ["sntf_dump", "--model", {str(model)!r}, "--batch", "2",
                     "--budget", text]).budget))
            except dump.DumpError as e:
                got.append("error: " + str(e))
            try:
                got.append(repr(runner.settings(["runner", "--budget", text])[1]))
            except runner.UsageError as e:
                got.append("error: " + str(e))
            out[text] = got
        print("RESULT " + json.dumps(out))
    """)
    result = run.result()
    for value, why in ENV_BAD:
        dump_said, runner_said = result[_env_text(value)]
        assert dump_said.startswith("error: --budget: sntf: invalid budget"), dump_said
        assert why in dump_said and runner_said.startswith("error:") and why in runner_said
    for value, expected in ENV_GOOD:
        dump_said, runner_said = result[_env_text(value)]
        assert dump_said == repr(expected), (value, dump_said)
        assert runner_said == repr(_env_text(value)), (value, runner_said)


def test_budget_forms_name_every_form():
    for form in ("'12GB'", "'512MiB'", "'1.5GiB'", "(0, 1]", "'50%'", "None",
                 "at least 1 MiB", "8e9"):
        assert form in config.BUDGET_FORMS


def test_parse_budget_types_of_fields():
    by_bytes = config.parse_budget("12GB")
    assert type(by_bytes.bytes) is int and by_bytes.fraction is None
    by_fraction = config.parse_budget(np.float32(0.5))
    assert type(by_fraction.fraction) is float and by_fraction.bytes is None
    assert type(config.parse_budget(np.int64(GiB)).bytes) is int
    assert type(config.parse_budget(8e9).bytes) is int


def test_fraction_check_needs_the_device_memory():
    # 0.001 of a 512 MiB device is 0.5 MiB: refused where the memory is known.
    with pytest.raises(ValueError, match="0.001 of this device's 536870912 bytes"):
        config.parse_budget(0.001, 512 * MiB)
    assert config.parse_budget(0.001) == Budget(fraction=0.001)


# --------------------------------------------------------------------------
# Sizes: host_pool_limit (option and SNTF_HOST_POOL_LIMIT), swap_min_bytes
# --------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    (1, 1), ("1", 1), ("12GB", 12 * GB), ("512 MiB", 512 * MiB), ("7b", 7),
    ("2.5KB", 2500), ("1m", 10**6), ("1t", 10**12), (4e9, 4 * GB),
    (np.int64(4096), 4096), (1.5, 2), ("1.5", 2), (2**63 - 1, 2**63 - 1),
])
def test_parse_size(value, expected):
    assert config.parse_size(value) == expected


@pytest.mark.parametrize("value, why", [
    (0, "it must be positive"), (-3, "it must be positive"),
    ("0", "it must be positive"), ("-1MB", "it must be positive"),
    (0.4, "it rounds to zero bytes"), ("0.4B", "it rounds to zero bytes"),
    (True, "expected a number"), (None, "expected a number"),
    ("x", "not a number with an optional unit"), ("", "not a number"),
    ("12XB", "unknown unit 'XB'"), (2**63, TOO_LARGE), ("1e400GB", TOO_LARGE),
    ("1e400", TOO_LARGE), (float("nan"), "not a number"),
], ids=repr)
def test_parse_size_rejects_naming_argument(value, why):
    with pytest.raises(ValueError) as excinfo:
        config.parse_size(value, "host_pool_limit")
    assert f"invalid host_pool_limit {value!r}" in str(excinfo.value)
    assert why in str(excinfo.value)


HOST_POOL_LIMITS = [("4096", 4096), ("1GiB", GiB), ("8GB", 8 * GB), ("1e9", 10**9),
                    ("0", "it must be positive"), ("-1", "it must be positive"),
                    ("12XB", "unknown unit"), ("lots", "not a number"),
                    ("99999999999999999999", TOO_LARGE), ("1e400GB", TOO_LARGE)]


@pytest.mark.parametrize("text, expected", HOST_POOL_LIMITS)
def test_host_pool_limit_option_and_environment_share_rules(text, expected):
    environ = {"SNTF_HOST_POOL_LIMIT": f" {text} "}
    if isinstance(expected, int):
        assert config.parse_options({"host_pool_limit": text}).host_pool_limit == expected
        assert config.host_pool_limit_from_environment(environ) == expected
        return
    with pytest.raises(ValueError, match=f"invalid host_pool_limit '{text}'") as option:
        config.parse_options({"host_pool_limit": text})
    with pytest.raises(ValueError) as env:
        config.host_pool_limit_from_environment(environ)
    assert str(env.value) == f"SNTF_HOST_POOL_LIMIT={text!r}: {option.value}"
    assert expected in str(option.value)


def test_host_pool_limit_environment_unset():
    assert config.host_pool_limit_from_environment({}) is None
    assert config.host_pool_limit_from_environment({"SNTF_HOST_POOL_LIMIT": " "}) is None


def test_host_pool_limit_from_environment_reaches_the_pool(fresh_python):
    """A size with a unit, which the native pool alone would ignore, sets its
    limit; a zero limit fails the import as the option fails enable()."""
    run = fresh_python("""
        import json, sntf
        sntf.enable(policy="off")
        print("RESULT " + json.dumps(sntf.stats()["pool"]["limit_bytes"]))
    """, env={"SNTF_HOST_POOL_LIMIT": "8GiB"})
    assert run.result() == 8 * GiB
    assert "ignoring malformed" not in run.stderr
    zero = fresh_python("import sntf", env={"SNTF_HOST_POOL_LIMIT": "0"})
    assert zero.returncode == 1
    assert ("ValueError: SNTF_HOST_POOL_LIMIT='0': sntf: invalid host_pool_limit '0': "
            "it must be positive") in zero.stderr


# --------------------------------------------------------------------------
# Budget
# --------------------------------------------------------------------------

def test_budget_resolve_bytes_ignores_device_memory():
    assert Budget(bytes=1234).resolve(10**12) == 1234
    assert Budget(bytes=1234).resolve(1) == 1234


def test_budget_resolve_fraction():
    assert Budget(fraction=0.5).resolve(1000) == 500
    assert Budget(fraction=1.0).resolve(16 * GiB) == 16 * GiB
    assert Budget(fraction=0.25).resolve(10) == 2   # 2.5 rounds down
    assert config.parse_budget("50%").resolve(8 * GiB) == 4 * GiB
    assert type(Budget(fraction=0.5).resolve(1000)) is int


def test_budget_resolve_percentage_is_exact():
    assert config.parse_budget("29%").resolve(100) == 29


def test_budget_describe():
    assert Budget(bytes=64 * MiB).describe() == "67108864 bytes (64.0 MiB)"
    assert Budget(fraction=0.5).describe() == "0.5 of device memory"


def test_budget_is_frozen():
    with pytest.raises(Exception) as excinfo:
        Budget(bytes=1).bytes = 2
    assert type(excinfo.value).__name__ == "FrozenInstanceError"


# --------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("off", "off"), ("OFF", "off"), ("  Off\n", "off"), ("recompute", "recompute"),
    ("Swap", "swap"), (" swap+RECOMPUTE ", "swap+recompute"), ("AUTO", "auto"),
])
def test_parse_policy(value, expected):
    assert config.parse_policy(value) == expected


@pytest.mark.parametrize("value", ["", "bogus", "swap + recompute", "swap_recompute",
                                   None, 1, True, ["off"]], ids=repr)
def test_parse_policy_rejects(value):
    with pytest.raises(ValueError) as excinfo:
        config.parse_policy(value)
    assert str(excinfo.value) == (
        f"sntf: unknown policy {value!r}; accepted policies: "
        "'off', 'recompute', 'swap', 'swap+recompute', 'auto'")


@pytest.mark.parametrize("value", ["auto", " AUTO ", "Auto"])
def test_budget_auto(value):
    budget = config.parse_budget(value)
    assert budget == Budget(auto=True)
    assert budget.to_user() == "auto"
    # On a device of 16 GB, "auto" is all of it (the pass asks for no budget
    # at all on a CPU graph; see test_pipeline).
    assert budget.resolve(16 * GB) == 16 * GB
    assert "auto" in budget.describe()


def test_budget_to_user_round_trips():
    for value in (12 * GB, 0.5, "auto"):
        assert config.parse_budget(config.parse_budget(value).to_user()) == \
            config.parse_budget(value)


@pytest.mark.parametrize("value", ["best_effort", "unchanged"])
def test_budget_behaviour_accepted(value):
    assert config.parse_options({"budget_behaviour": value}).budget_behaviour == value


@pytest.mark.parametrize("value", ["best-effort", "", None, 1, "skip"])
def test_budget_behaviour_rejected(value):
    with pytest.raises(ValueError) as excinfo:
        config.parse_options({"budget_behaviour": value})
    assert str(excinfo.value) == ("sntf: budget_behaviour must be 'best_effort' or "
                                  f"'unchanged', got {value!r}")


SHARES = {"budget_margin": "[0, 0.5)", "min_gain": "[0, 1)"}


@pytest.mark.parametrize("name, value", [
    ("budget_margin", v) for v in (0, 0.0, 0.08, 0.49)] + [
    ("min_gain", v) for v in (0, 0.0, 0.05, 0.5, 0.99)])
def test_share_options_accepted(name, value):
    assert getattr(config.parse_options({name: value}), name) == value


@pytest.mark.parametrize("name, value", [
    ("budget_margin", v) for v in (-0.1, 0.5, 1, float("nan"), "0.1", True, None)] + [
    ("min_gain", v) for v in (-0.01, 1, 1.5, float("nan"), "5%", True, None)])
def test_share_options_rejected(name, value):
    with pytest.raises(ValueError) as excinfo:
        config.parse_options({name: value})
    assert str(excinfo.value) == (f"sntf: {name} must be a number in {SHARES[name]}, "
                                  f"got {value!r}")


def test_cpu_device_memory_is_ram():
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    from sntf.runtime import environment

    assert environment.device_memory_bytes() == ram


def test_a_gpu_budget_without_its_allocator_limit_warns_once(monkeypatch, caplog):
    # Where fit() never read the allocator's limit, the CUDA runtime's total
    # of the current GPU stands in for it; the user is told, once per GPU.
    from sntf.runtime import environment

    monkeypatch.setattr(environment, "_gpu_total", [8 << 30])
    monkeypatch.setattr(environment, "_unread_warned", set())
    monkeypatch.setattr(environment, "_device_limits", {"GPU:1": 6 << 30})
    with caplog.at_level(logging.WARNING, logger="sntf"):
        assert environment.device_memory_bytes("/device:GPU:1") == 6 << 30
        assert not caplog.records                   # the limit was read: no warning
        for _ in range(3):
            assert environment.device_memory_bytes("/device:GPU:0") == 8 << 30
    (record,) = caplog.records
    assert "GPU:0" in record.getMessage() and "8192 MiB" in record.getMessage()
    assert "budget in bytes" in record.getMessage()


# --------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------

def test_parse_options_defaults():
    options = config.parse_options({})
    assert options == config.Options()
    assert options == config.Options(identity_rewrite=False, batch_size=None,
                                     host_pool_limit=None, max_reports=1000)


def test_option_names():
    assert config.OPTION_NAMES == ("identity_rewrite", "batch_size",
                                   "host_pool_limit", "max_reports", "keep_graphs",
                                   "recompute_mode", "swap_min_bytes",
                                   "link_bandwidth", "budget_behaviour",
                                   "budget_margin", "min_gain", "pin_order",
                                   "exact_sums", "progress", "one_region")


def test_parse_options_values():
    options = config.parse_options({"identity_rewrite": True, "batch_size": 32,
                                    "host_pool_limit": "1GiB", "max_reports": 5})
    assert options == config.Options(identity_rewrite=True, batch_size=32,
                                     host_pool_limit=GiB, max_reports=5)
    assert config.parse_options({"host_pool_limit": 4096}).host_pool_limit == 4096
    assert config.parse_options({"batch_size": None}).batch_size is None
    assert config.parse_options({"host_pool_limit": None}).host_pool_limit is None


def test_parse_options_accepts_numpy_scalars():
    options = config.parse_options({"batch_size": np.int64(32), "max_reports": np.int32(7),
                                    "budget_margin": np.float32(0.25),
                                    "link_bandwidth": np.float64(25e9),
                                    "host_pool_limit": np.uint64(GiB)})
    assert (options.batch_size, options.max_reports, options.budget_margin,
            options.link_bandwidth, options.host_pool_limit) == (32, 7, 0.25, 25e9, GiB)
    assert type(options.batch_size) is int and type(options.budget_margin) is float


def test_pin_order_takes_a_bool_only():
    assert config.parse_options({}).pin_order is True
    assert config.parse_options({"pin_order": False}).pin_order is False
    with pytest.raises(ValueError, match=r"sntf: pin_order must be True or False, got 'no'"):
        config.parse_options({"pin_order": "no"})


def test_one_region_takes_a_bool_only():
    assert config.parse_options({}).one_region is True
    assert config.parse_options({"one_region": False}).one_region is False
    with pytest.raises(ValueError, match=r"sntf: one_region must be True or False, got 0"):
        config.parse_options({"one_region": 0})


def test_max_reports_bounds():
    assert config.parse_options({"max_reports": config.MAX_REPORTS}).max_reports == \
        config.MAX_REPORTS
    with pytest.raises(ValueError, match="from 1 to 1000000"):
        config.parse_options({"max_reports": config.MAX_REPORTS + 1})


def test_parse_options_unknown_key():
    with pytest.raises(TypeError) as excinfo:
        config.parse_options({"zeta": 1, "identity_rewrite": True, "alpha": 2})
    assert str(excinfo.value) == (
        "sntf.enable() got unknown option(s) ['alpha', 'zeta']; accepted "
        "options: identity_rewrite, batch_size, host_pool_limit, max_reports, "
        "keep_graphs, recompute_mode, swap_min_bytes, link_bandwidth, "
        "budget_behaviour, budget_margin, min_gain, pin_order, exact_sums, progress, "
        "one_region")


@pytest.mark.parametrize("options, fragment", [
    ({"identity_rewrite": 1}, "identity_rewrite must be True or False, got 1"),
    ({"identity_rewrite": "yes"}, "identity_rewrite must be True or False, got 'yes'"),
    ({"identity_rewrite": None}, "identity_rewrite must be True or False, got None"),
    ({"batch_size": 0}, "batch_size must be a positive int, got 0"),
    ({"batch_size": -2}, "batch_size must be a positive int, got -2"),
    ({"batch_size": True}, "batch_size must be a positive int, got True"),
    ({"batch_size": 8.0}, "batch_size must be a positive int, got 8.0"),
    ({"batch_size": "8"}, "batch_size must be a positive int, got '8'"),
    ({"host_pool_limit": 0}, "invalid host_pool_limit 0"),
    ({"host_pool_limit": "12XB"}, "invalid host_pool_limit '12XB'"),
    ({"host_pool_limit": 0.4}, "invalid host_pool_limit 0.4: it rounds to zero"),
    ({"host_pool_limit": 2**63}, "invalid host_pool_limit 9223372036854775808: too large"),
    ({"max_reports": 0}, "max_reports must be an int from 1 to 1000000, got 0"),
    ({"max_reports": None}, "max_reports must be an int from 1 to 1000000, got None"),
    ({"max_reports": False}, "max_reports must be an int from 1 to 1000000, got False"),
    ({"max_reports": 2.0}, "max_reports must be an int from 1 to 1000000, got 2.0"),
    ({"max_reports": 10**20}, "max_reports must be an int from 1 to 1000000, got "
                              "100000000000000000000"),
    ({"batch_size": np.float32(8)}, "batch_size must be a positive int"),
])
def test_parse_options_bad_values(options, fragment):
    with pytest.raises(ValueError) as excinfo:
        config.parse_options(options)
    assert fragment in str(excinfo.value)


def test_parse_options_huge_host_pool_limit():
    with pytest.raises(ValueError, match="invalid host_pool_limit"):
        config.parse_options({"host_pool_limit": "1e400"})


# --------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------

@pytest.mark.parametrize("environ", [
    {}, {"SNTF_POLICY": ""}, {"SNTF_BUDGET": ""},
    {"SNTF_POLICY": "  ", "SNTF_BUDGET": "\t"}, {"OTHER": "off"},
])
def test_from_environment_unset(environ):
    assert config.from_environment(environ) is None


@pytest.mark.parametrize("environ, expected", [
    ({"SNTF_POLICY": "off"}, ("off", None)),
    ({"SNTF_POLICY": " Swap "}, ("swap", None)),
    ({"SNTF_BUDGET": "12GB"}, ("auto", Budget(bytes=12 * GB))),
    ({"SNTF_BUDGET": " 50% "}, ("auto", Budget(fraction=0.5))),
    ({"SNTF_POLICY": "recompute", "SNTF_BUDGET": "512MiB"},
     ("recompute", Budget(bytes=512 * MiB))),
    ({"SNTF_POLICY": "off", "SNTF_BUDGET": ""}, ("off", None)),
    ({"SNTF_POLICY": "", "SNTF_BUDGET": "0.5"}, ("auto", Budget(fraction=0.5))),
])
def test_from_environment(environ, expected):
    assert config.from_environment(environ) == expected


@pytest.mark.parametrize("environ, prefix", [
    ({"SNTF_POLICY": "fast"}, "SNTF_POLICY='fast': sntf: unknown policy 'fast'"),
    ({"SNTF_POLICY": "fast", "SNTF_BUDGET": "12GB"},
     "SNTF_POLICY='fast': sntf: unknown policy"),
    ({"SNTF_BUDGET": "12XB"}, "SNTF_BUDGET='12XB': sntf: invalid budget '12XB'"),
    ({"SNTF_BUDGET": " 150% "}, "SNTF_BUDGET='150%': sntf: invalid budget"),
    ({"SNTF_POLICY": "off", "SNTF_BUDGET": "lots"},
     "SNTF_BUDGET='lots': sntf: invalid budget 'lots'"),
])
def test_from_environment_malformed(environ, prefix):
    with pytest.raises(ValueError) as excinfo:
        config.from_environment(environ)
    assert str(excinfo.value).startswith(prefix)
    assert excinfo.value.__cause__ is None
    assert excinfo.value.__suppress_context__ is True


def test_from_environment_huge_budget_names_variable():
    with pytest.raises(ValueError, match="^SNTF_BUDGET='1e400'"):
        config.from_environment({"SNTF_BUDGET": "1e400"})


def test_from_environment_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("SNTF_POLICY", "OFF")
    monkeypatch.delenv("SNTF_BUDGET", raising=False)
    assert config.from_environment() == ("off", None)
    monkeypatch.delenv("SNTF_POLICY")
    assert config.from_environment() is None


# --------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------

def test_state_defaults():
    state = config.State()
    assert (state.enabled, state.policy, state.budget, state.options) == (
        False, "off", None, config.Options())


def test_set_state_and_current():
    saved = config.current()
    try:
        new = config.State(enabled=True, policy="off", budget=Budget(bytes=5))
        config.set_state(new)
        assert config.current() is new
    finally:
        config.set_state(saved)
    assert config.current() is saved


def test_device_memory_bytes_positive_int():
    from sntf.runtime import environment

    memory = environment.device_memory_bytes()
    assert type(memory) is int and memory > 0
    assert math.isfinite(memory)


def test_sizes_beyond_64_bits_are_rejected():
    with pytest.raises(ValueError) as e:
        config.parse_options({"host_pool_limit": 2**64})
    assert "2**63-1" in str(e.value)


@pytest.mark.parametrize("value, expected", [
    (0, 0), ("1MiB", 1 << 20), (4096, 4096)])
def test_swap_min_bytes(value, expected):
    assert config.parse_options({"swap_min_bytes": value}).swap_min_bytes == expected


@pytest.mark.parametrize("key, value, words", [
    ("swap_min_bytes", -1, "zero or more"),
    ("swap_min_bytes", "lots", "optional unit"),
    ("link_bandwidth", 0, "positive number of bytes per second"),
    ("link_bandwidth", float("nan"), "positive number of bytes per second"),
    ("link_bandwidth", "fast", "positive number of bytes per second"),
])
def test_swap_options_rejected(key, value, words):
    with pytest.raises(ValueError) as excinfo:
        config.parse_options({key: value})
    assert words in str(excinfo.value) and repr(value) in str(excinfo.value)


# --------------------------------------------------------------------------
# tf.config-style set/get pairs
# --------------------------------------------------------------------------

def test_getters_while_disabled():
    saved = config.current()
    try:
        config.set_state(config.State())
        assert config.get_policy() is None
        assert config.get_memory_budget() is None
        assert config.get_options() == dataclasses.asdict(config.Options())
    finally:
        config.set_state(saved)


@pytest.mark.parametrize("call, error, words", [
    (lambda: config.set_policy("fast"), ValueError, "unknown policy 'fast'"),
    (lambda: config.set_policy(None), ValueError, "unknown policy None"),
    (lambda: config.set_memory_budget(1), ValueError, FRACTION_HINT),
    (lambda: config.set_memory_budget("lots"), ValueError, "invalid budget 'lots'"),
    (lambda: config.set_memory_budget(2**63), ValueError, TOO_LARGE),
    (lambda: config.set_options({"zeta": 1}), TypeError, "unknown option(s) ['zeta']"),
    (lambda: config.set_options({"batch_size": 0}), ValueError,
     "batch_size must be a positive int"),
    (lambda: config.set_options({"max_reports": 10**20}), ValueError,
     "max_reports must be an int from 1 to 1000000"),
    (lambda: config.set_options("batch_size=8"), TypeError, "takes a dict of options"),
    (lambda: config.set_options([("batch_size", 8)]), TypeError, "takes a dict"),
])
def test_setters_refuse_bad_values_and_leave_the_switch(call, error, words):
    before = config.current()
    with pytest.raises(error) as excinfo:
        call()
    assert words in str(excinfo.value)
    assert config.current() is before


def test_setters_and_getters_in_a_fresh_process(fresh_python):
    run = fresh_python("""
        import json, sntf
        from sntf import config
        seen = []
        config.set_memory_budget("6GB")            # enables sntf, policy "auto"
        seen.append([sntf.enabled(), config.get_policy(), config.get_memory_budget()])
        config.set_policy("SWAP+recompute")        # keeps the budget
        seen.append([config.get_policy(), config.get_memory_budget()])
        config.set_options({"batch_size": 16, "recompute_mode": "speed"})
        config.set_options({"swap_min_bytes": "2MiB"})   # keeps batch_size
        options = config.get_options()
        seen.append([options["batch_size"], options["recompute_mode"],
                     options["swap_min_bytes"], config.get_policy()])
        config.set_memory_budget(0.5)
        seen.append([config.get_memory_budget(), options["batch_size"]])
        config.set_memory_budget(None)
        seen.append([config.get_memory_budget(), config.get_policy()])
        try:
            config.set_policy("fastest")
        except ValueError as e:
            seen.append(["refused", config.get_policy()])
        sntf.disable()
        seen.append([sntf.enabled(), config.get_policy(), config.get_memory_budget()])
        config.set_policy("off")
        seen.append([sntf.enabled(), config.get_policy(),
                     config.get_options()["batch_size"]])
        print("RESULT " + json.dumps(seen))
    """)
    assert run.result() == [
        [True, "auto", 6 * GB],
        ["swap+recompute", 6 * GB],
        [16, "speed", 2 * MiB, "swap+recompute"],
        [0.5, 16],
        [None, "swap+recompute"],
        ["refused", "swap+recompute"],
        [False, None, None],
        [True, "off", None],
    ], run.stderr[-2000:]
