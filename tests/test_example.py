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


@pytest.mark.slow
def test_out_of_memory_example_trains_under_the_limit_tensorflow_fails(fresh_python):
    """The story a GPU user meets, under a hard CPU allocator limit: TensorFlow
    alone runs out of memory, the same script with sntf.enable() trains with
    identical losses and weights. (0.65 of TensorFlow's peak leaves the
    default inter-op pool's timing some room; the example's default is 0.6.)"""
    script = os.path.join(REPO, "examples", "out_of_memory.py")
    run = fresh_python(args=[script, "--fraction", "0.65", "--steps", "2"], timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    alone = next(line for line in lines if "TensorFlow alone, limit" in line)
    with_sntf = next(line for line in lines if "with sntf.enable()" in line)
    assert "out of memory (ResourceExhaustedError)" in alone, run.stdout
    assert ": trains, device peak" in with_sntf, run.stdout + run.stderr[-2000:]
    assert "identical losses and weights    : True" in run.stdout, run.stdout
