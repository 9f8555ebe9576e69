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


@pytest.mark.parametrize("bench,argv,says", [
    ("parity", ["--seeds", "abc"], "argument --seeds: must be an integer, got 'abc'"),
    ("parity", ["--kind", "sparse", "--lexical-head-bias", "nan"], "argument --lexical-head-bias: must be a finite"),
    ("parity", ["--smoke", "--kind", "sparse"], "--smoke: give --tiny-encoder and --tiny-decoder"),
    ("parity", ["--work", "{file}"], "is a file: give a folder"),
    ("parity", ["--train-file", "{train}", "--out", "{train}"], "is the command's input (--train-file"),
    ("parity", ["--out", "{file}"], "exists and is not this tool's output"),
    ("parity", ["--work", os.path.join(ROOT, "data")], "holds the command's input --train-file"),
    ("forgetting", ["--seeds", "abc"], "argument --seeds: must be an integer, got 'abc'"),
    ("forgetting", ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    ("forgetting", ["--ema-decay", "2"], "argument --ema-decay: must be above 0 and below 1, got 2"),
    ("forgetting", ["--val-every", "0"], "argument --val-every: must be a positive integer, got 0"),
    ("forgetting", ["--work", "{file}"], "is a file: give a folder"),
    ("forgetting", ["--work", os.path.join(ROOT, "data", "eval")], "lies inside the input folder the bundled data"),
])
def test_the_benches_check_their_arguments_before_any_work(bench, argv, says, small_train_file, tmp_path, monkeypatch,
                                                           capsys):
    """Issue 61: a bad number, a missing tiny model, an existing file as --work, the training file as --out: one
    sentence before any run starts (each was a run minutes long, a traceback, or the training file overwritten)."""
    import runpy
    import sys

    (tmp_path / "f.txt").write_text("mine")
    fill = {"{file}": str(tmp_path / "f.txt"), "{train}": small_train_file}
    monkeypatch.setattr(sys, "argv", [bench] + [fill.get(x, x) for x in argv])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, "bench", f"{bench}.py"), run_name="__main__")
    said = str(e.value.code) if isinstance(e.value.code, str) else capsys.readouterr().err
    assert e.value.code not in (0, None) and says in said, said
    assert (tmp_path / "f.txt").read_text() == "mine" and open(small_train_file).read().startswith("{")
