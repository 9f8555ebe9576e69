"""bench/parity.py's smoke (issue 51, quick tier): for each kind, the kit's script and sentence-transformers'
own trainer one step each on the tiny models, both saving a model dir the kit then evaluates. The
numbers of the real comparison are measured by hand (docs/benchmarks.md, "Parity")."""

import json
import os

import pytest

from tests.conftest import ROOT, python_run

KINDS = ["single-vector", "multi-vector", "sparse", "classifier", "lm", "decoder-embedder"]


@pytest.mark.parametrize("kind", KINDS)
def test_parity_runs_each_kind_one_step_on_both_sides(kind, tiny_model_dir, tiny_decoder_dir, small_train_file,
                                                     tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    out = python_run([os.path.join(ROOT, "bench", "parity.py"), "--smoke", "--kind", kind, "--tiny-encoder",
                      tiny_model_dir, "--tiny-decoder", tiny_decoder_dir, "--train-file", small_train_file,
                      "--work", tmp_path], env=env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [json.loads(x[len("PARITY "):]) for x in out.stdout.splitlines() if x.startswith("PARITY ")]
    assert [(x["kind"], x["side"]) for x in lines] == [(kind, "kit"), (kind, "peer")]
    for side in ("kit", "peer"):
        assert os.path.isfile(os.path.join(tmp_path, f"{kind}_{side}", "final", "config.json"))


def test_parity_pooling_avg_gives_both_sides_mean_pooling_without_eos(tiny_model_dir, tiny_decoder_dir,
                                                                       small_train_file, tmp_path):
    """`--pooling avg` (issue 51's decoder-embedder recipe) reaches both sides: each saved dir mean-pools and
    neither tokenizer appends EOS (the kit appends it for last-token pooling only), read back by
    sentence-transformers, the consumer of both dirs."""
    from sentence_transformers import SentenceTransformer

    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    out = python_run([os.path.join(ROOT, "bench", "parity.py"), "--smoke", "--kind", "decoder-embedder", "--pooling",
                      "avg", "--tiny-encoder", tiny_model_dir, "--tiny-decoder", tiny_decoder_dir, "--train-file",
                      small_train_file, "--work", tmp_path], env=env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    for side in ("kit", "peer"):
        model = SentenceTransformer(os.path.join(tmp_path, f"decoder-embedder_{side}", "final"), device="cpu")
        pooling = next(m for m in model if type(m).__name__ == "Pooling")
        assert pooling.pooling_mode in ("mean", ("mean",)), side
        ids = model.tokenizer("a short text")["input_ids"]
        assert ids[-1] != model.tokenizer.eos_token_id, side
