"""Tests for sntf.config: budgets, policies, options and the environment."""

import math
import os

import pytest

from sntf import config
from sntf.config import Budget

GB = 10**9
MiB = 2**20
GiB = 2**30


# --------------------------------------------------------------------------
# parse_budget
# --------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    (None, None),
    (1, Budget(bytes=1)),
    (12_000_000_000, Budget(bytes=12 * GB)),
    (0.5, Budget(fraction=0.5)),
    (1.0, Budget(fraction=1.0)),
    (1e-9, Budget(fraction=1e-9)),
    ("12GB", Budget(bytes=12 * GB)),
    ("12gb", Budget(bytes=12 * GB)),
    (" 12 GB ", Budget(bytes=12 * GB)),
    ("12G", Budget(bytes=12 * GB)),
    ("3kb", Budget(bytes=3000)),
    ("2TB", Budget(bytes=2 * 10**12)),
    ("512MiB", Budget(bytes=512 * MiB)),
    ("512mib", Budget(bytes=512 * MiB)),
    ("4KiB", Budget(bytes=4096)),
    ("1.5GiB", Budget(bytes=1610612736)),
    ("1TiB", Budget(bytes=2**40)),
    ("100B", Budget(bytes=100)),
    ("1048576", Budget(bytes=1048576)),
    ("1e9", Budget(bytes=10**9)),
    ("50%", Budget(fraction=0.5)),
    (" 50 % ", Budget(fraction=0.5)),
    ("100%", Budget(fraction=1.0)),
    ("12.5%", Budget(fraction=0.125)),
    ("0.25", Budget(fraction=0.25)),
    (" 0.25\t", Budget(fraction=0.25)),
    (".5", Budget(fraction=0.5)),
    ("1.0", Budget(fraction=1.0)),
])
def test_parse_budget_accepts(value, expected):
    assert config.parse_budget(value) == expected


def test_parse_budget_types_of_fields():
    by_bytes = config.parse_budget("12GB")
    assert type(by_bytes.bytes) is int and by_bytes.fraction is None
    by_fraction = config.parse_budget("50%")
    assert type(by_fraction.fraction) is float and by_fraction.bytes is None


BAD_BUDGETS = [0, -1, -12 * GB, 1.5, 0.0, -0.5, float("nan"), float("inf"),
               float("-inf"), True, False, "abc", "12XB", "12Ki", "", "   ",
               "-5GB", "0%", "150%", "-5%", "0", "0GB", "0.5B", "GB", "12 G B",
               [1], (1,), {"bytes": 1}, b"12GB", object]


@pytest.mark.parametrize("value", BAD_BUDGETS, ids=repr)
def test_parse_budget_rejects(value):
    with pytest.raises(ValueError) as excinfo:
        config.parse_budget(value)
    message = str(excinfo.value)
    assert message.startswith(f"sntf: invalid budget {value!r} (")
    assert message.endswith(f"accepted forms: {config.BUDGET_FORMS}")


@pytest.mark.parametrize("value, why", [
    (0, "it must be positive"),
    (-1, "it must be positive"),
    (True, "a bool is not a budget"),
    (1.5, "a float budget is a fraction of device memory and must lie in (0, 1]"),
    (float("nan"), "must lie in (0, 1]"),
    ("150%", "a percentage must lie in (0, 100]"),
    ("0%", "a percentage must lie in (0, 100]"),
    ("12XB", "not a size, fraction or percentage"),
    ([1], "unsupported type list"),
])
def test_parse_budget_error_says_why(value, why):
    with pytest.raises(ValueError, match="invalid budget") as excinfo:
        config.parse_budget(value)
    assert why in str(excinfo.value)


def test_budget_forms_name_every_form():
    for form in ("'12GB'", "'512MiB'", "'1.5GiB'", "(0, 1]", "'50%'", "None"):
        assert form in config.BUDGET_FORMS


@pytest.mark.parametrize("value", ["1e400", "1e400GB"])
def test_parse_budget_huge_number_raises_value_error(value):
    with pytest.raises(ValueError, match="invalid budget"):
        config.parse_budget(value)


def test_parse_budget_error_names_the_string_received():
    with pytest.raises(ValueError) as excinfo:
        config.parse_budget("1.5")
    assert "invalid budget '1.5'" in str(excinfo.value)


# --------------------------------------------------------------------------
# parse_size
# --------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    (1, 1), ("1", 1), ("12GB", 12 * GB), ("512 MiB", 512 * MiB), ("7b", 7),
    ("2.5KB", 2500), ("1m", 10**6), ("1t", 10**12),
])
def test_parse_size(value, expected):
    assert config.parse_size(value) == expected


@pytest.mark.parametrize("value", [0, -3, True, 1.5, None, "x", "12XB", "0",
                                   "-1MB", ""], ids=repr)
def test_parse_size_rejects_naming_argument(value):
    with pytest.raises(ValueError) as excinfo:
        config.parse_size(value, "host_pool_limit")
    assert f"invalid host_pool_limit {value!r}" in str(excinfo.value)


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
    assert Budget(bytes=12).describe() == "12 bytes"
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


@pytest.mark.parametrize("value", [0, 0.0, 0.08, 0.49])
def test_budget_margin_accepted(value):
    assert config.parse_options({"budget_margin": value}).budget_margin == value


@pytest.mark.parametrize("value", [-0.1, 0.5, 1, float("nan"), "0.1", True, None])
def test_budget_margin_rejected(value):
    with pytest.raises(ValueError) as excinfo:
        config.parse_options({"budget_margin": value})
    assert str(excinfo.value) == ("sntf: budget_margin must be a number in [0, 0.5), "
                                  f"got {value!r}")


def test_cpu_device_memory_is_ram():
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    from sntf.runtime import environment

    assert environment.device_memory_bytes() == ram


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
                                   "budget_margin")


def test_parse_options_values():
    options = config.parse_options({"identity_rewrite": True, "batch_size": 32,
                                    "host_pool_limit": "1GiB", "max_reports": 5})
    assert options == config.Options(identity_rewrite=True, batch_size=32,
                                     host_pool_limit=GiB, max_reports=5)
    assert config.parse_options({"host_pool_limit": 4096}).host_pool_limit == 4096
    assert config.parse_options({"batch_size": None}).batch_size is None
    assert config.parse_options({"host_pool_limit": None}).host_pool_limit is None


def test_parse_options_unknown_key():
    with pytest.raises(TypeError) as excinfo:
        config.parse_options({"zeta": 1, "identity_rewrite": True, "alpha": 2})
    assert str(excinfo.value) == (
        "sntf.enable() got unknown option(s) ['alpha', 'zeta']; accepted "
        "options: identity_rewrite, batch_size, host_pool_limit, max_reports, "
        "keep_graphs, recompute_mode, swap_min_bytes, link_bandwidth, "
        "budget_behaviour, budget_margin")


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
    ({"host_pool_limit": 1.5}, "invalid host_pool_limit 1.5"),
    ({"max_reports": 0}, "max_reports must be a positive int, got 0"),
    ({"max_reports": None}, "max_reports must be a positive int, got None"),
    ({"max_reports": False}, "max_reports must be a positive int, got False"),
    ({"max_reports": 2.0}, "max_reports must be a positive int, got 2.0"),
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
