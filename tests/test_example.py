"""The README's first command runs examples/cnn_memory.py: it must train
twice, print both peaks, and find the losses identical."""

import os

import pytest

from conftest import REPO

EXAMPLE = os.path.join(REPO, "examples", "cnn_memory.py")


@pytest.mark.slow
def test_main_example_trains_with_and_without_sntf(fresh_python):
    run = fresh_python(args=[EXAMPLE, "--batch", "16", "--steps", "2"])
    assert run.returncode == 0, run.stderr[-3000:]
    lines = {line.split(":")[0].strip(): line for line in run.stdout.splitlines()}
    assert "TensorFlow alone" in lines and "with sntf" in lines, run.stdout
    assert "identical loss   : True" in run.stdout, run.stdout
    assert "actions: rewritten" in run.stdout, run.stdout


def test_main_example_refuses_a_fraction_outside_its_range(fresh_python):
    run = fresh_python(args=[EXAMPLE, "--fraction", "2"])
    assert run.returncode != 0
    assert "--fraction=2" in run.stderr and "range" in run.stderr, run.stderr[-2000:]
