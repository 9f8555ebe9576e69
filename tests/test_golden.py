"""Every golden run (tests/golden.py) reproduces its recorded numbers: per-step train loss, grad
norm, accuracy, learning rate, validation metrics and the exported weights' hash."""

import json
import os

import pytest

from tests.golden import CONFIGS, GOLDEN_FILE, compare, fingerprint, run_config


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN_FILE) as f:
        return json.load(f)


@pytest.mark.parametrize("name", CONFIGS)
def test_golden_run(name, golden, tiny_model_dir, small_train_file, tmp_path):
    got = run_config(name, tiny_model_dir, small_train_file, str(tmp_path / "run"))
    bitwise = golden["fingerprint"] == fingerprint()
    if not bitwise:
        print(f"recorded on {golden['fingerprint']}, running on {fingerprint()}: compared within 1e-4, hash not compared")
    problems = compare(golden["runs"][name], got, bitwise)
    assert not problems, "\n".join(problems)
