"""Every golden run (tests/golden.py) reproduces its recorded numbers - per-step train loss, grad
norm, accuracy, learning rate, validation metrics and the exported weights' hash - with batches
built in the training process (--num-workers 0), and for some modes in two DataLoader workers. Bitwise where this
machine's numeric fingerprint has a recording, within golden.TOLERANCE elsewhere; the run's
summary line says which (conftest.pytest_terminal_summary)."""

import copy
import math

import pytest
import torch

from tests.golden import (check, compare, comparison, CONFIGS, describe, fingerprint, load_recordings, run_config,
                          TOLERANCE)

# the batches of DataLoader workers are checked once per script here (the other modes change the step
# or the rank split - StepBatches, the same code with or without workers - and build the batches in
# the process); a run with 2 workers stopped and resumed, bitwise against an uninterrupted one, is
# test_ckpt's SIGTERM test
WORKER_MODES = ("plain",)
RUNS = [(name, w) for name in CONFIGS for w in (0, 2) if w == 0 or name.split("/")[1] in WORKER_MODES]


@pytest.fixture(scope="module")
def recordings():
    return load_recordings()


@pytest.mark.slow
@pytest.mark.parametrize("name,workers", RUNS)
def test_golden_run(name, workers, recordings, tiny_model_dir, tiny_decoder_dir, small_train_file, tmp_path):
    got = run_config(name, tiny_model_dir, small_train_file, str(tmp_path / "run"), ["--num-workers", workers],
                     decoder_dir=tiny_decoder_dir)
    problems = check(recordings, fingerprint(), got, name)
    assert not problems, describe(recordings, fingerprint()) + "\n" + "\n".join(problems)


@pytest.mark.slow
def test_other_kernels_are_compared_within_the_tolerance_and_pass(recordings, tiny_model_dir, small_train_file,
                                                                  tmp_path):
    """ATEN_CPU_CAPABILITY=default swaps torch's vectorized kernels for the plain ones on any
    machine: a fingerprint no recording has, so the tolerance path runs, and it must still pass."""
    env = {"ATEN_CPU_CAPABILITY": "default"}
    fp = fingerprint(env)
    against, bitwise = comparison(recordings, fp)
    assert not bitwise and len(against) == len(recordings)
    got = run_config("biencoder/grad_cache", tiny_model_dir, small_train_file, str(tmp_path / "run"), env=env)
    problems = check(recordings, fp, got, "biencoder/grad_cache")
    assert not problems, "\n".join(problems)


def test_the_comparison_fails_past_the_tolerance_and_bitwise_on_the_last_bit(recordings):
    want = recordings[0]["runs"]["reranker/plain"]
    near, far, last_bit = copy.deepcopy(want), copy.deepcopy(want), copy.deepcopy(want)
    loss = want["train"]["2"]["loss"]
    near["train"]["2"]["loss"] = loss * (1 + TOLERANCE / 2)
    far["train"]["2"]["loss"] = loss + 2 * TOLERANCE * max(1.0, abs(loss))
    last_bit["train"]["2"]["loss"] = math.nextafter(loss, math.inf)  # one ulp up
    assert compare(want, near, bitwise=False) == []
    assert len(compare(want, far, bitwise=False)) == 1
    assert compare(want, last_bit, bitwise=False) == [] and len(compare(want, last_bit, bitwise=True)) == 1
    assert compare(want, {**want, "weights": "0" * 64}, bitwise=False) == []  # the hash is bitwise only
    assert len(compare(want, {**want, "weights": "0" * 64}, bitwise=True)) == 1


def test_the_fingerprint_tells_machines_apart(recordings):
    fp = fingerprint()
    assert {"torch", "cpu_capability", "cpu", "cpu_flags", "mkl", "onednn", "threads"} <= set(fp)
    assert fingerprint({"ATEN_CPU_CAPABILITY": "default"})["cpu_capability"] == "DEFAULT"
    assert fingerprint({})["cpu_capability"] == torch.backends.cpu.get_cpu_capability().upper()
    other = [{"fingerprint": {**fp, "cpu": "another CPU"}, "runs": {}}]
    assert comparison(other, fp) == (other, False) and "within" in describe(other, fp)
    assert comparison(other + [{"fingerprint": fp, "runs": {}}], fp)[1]
