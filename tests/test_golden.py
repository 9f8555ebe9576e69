"""Every golden run (tests/golden.py) reproduces its recorded numbers - per-step train loss, grad
norm, accuracy, learning rate, validation metrics and the exported weights' hash - with batches
built in the training process (--num-workers 0) and in two DataLoader workers."""

import json

import pytest

from tests.golden import compare, CONFIGS, fingerprint, GOLDEN_FILE, run_config


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN_FILE) as f:
        return json.load(f)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", CONFIGS)
def test_golden_run(name, workers, golden, tiny_model_dir, small_train_file, tmp_path):
    got = run_config(name, tiny_model_dir, small_train_file, str(tmp_path / "run"), ["--num-workers", workers])
    bitwise = golden["fingerprint"] == fingerprint()
    if not bitwise:
        print(f"recorded on {golden['fingerprint']}, running on {fingerprint()}: "
              "compared within 1e-4, hash not compared")
    problems = compare(golden["runs"][name], got, bitwise)
    assert not problems, "\n".join(problems)
