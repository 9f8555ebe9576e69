"""The benchmark scripts still run: each on the tiny model for a step or two, through its own
entry point, so a change that breaks one fails here (bench_peer.py crashed for a session before
this test). Their numbers are not checked: they are measured by hand (docs/benchmarks.md)."""

import os

import pytest

from tests.conftest import python_run, ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script,args,says", [
    ("bench_peer.py", ["--steps", 1, "--warmup", 1], "kit / sentence-transformers:"),
    ("bench_train_step.py", ["--steps", 1, "--warmup", 1, "--workers", 0], "overhead ratio kit/bare:"),
])
def test_bench_script_runs_on_the_tiny_model(script, args, says, tiny_model_dir, small_train_file):
    out = python_run([os.path.join(ROOT, "bench", script), "--model", tiny_model_dir, "--train-file", small_train_file,
                      "--batch-size", 4, "--passage-max-length", 32, *args],
                     env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert says in out.stdout, out.stdout[-2000:]
