"""python -m retrieval_kit.embed and --teacher-embeddings (issue 64, item 4): a teacher's vectors written once,
each the teacher's own embedding of its text (one text a batch: no padding, the reference); a run distilled
from the file logs the losses of the same run distilled from the teacher model itself; a file that lacks a
training text, or belongs to a teacher of another size, and a missing input file, are one sentence."""

import os

import pytest
import torch

from tests.conftest import ROOT, python_run, read_jsonl, run_module, run_script

LENGTHS = ["--query-max-length", 16, "--passage-max-length", 32]


@pytest.fixture(scope="module")
def teacher_file(tiny_model_dir, small_train_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("embed") / "teacher.safetensors"
    run_module(["-m", "retrieval_kit.embed", "--model", tiny_model_dir, "--input", small_train_file, "--out", out,
                *LENGTHS])
    return str(out)


def test_the_file_holds_the_teachers_vector_of_every_training_text(teacher_file, tiny_model_dir, small_train_file):
    from safetensors.torch import load_file

    from retrieval_kit.collate import text_keys
    from retrieval_kit.evaluate import load_biencoder

    rows = read_jsonl(small_train_file)
    queries = list(dict.fromkeys(r["query"] for r in rows))
    docs = list(dict.fromkeys(d if isinstance(d, str) else d["text"] for r in rows
                              for d in r.get("pos_doc", []) + r.get("neg_doc", [])))
    got = load_file(teacher_file)
    assert set(got["query_keys"].tolist()) == set(text_keys(queries).tolist())
    assert set(text_keys(docs).tolist()) <= set(got["passage_keys"].tolist())
    model, tok, s, _ = load_biencoder(tiny_model_dir)
    for side, texts, length in (("query", queries[:3], 16), ("passage", docs[:3], 32)):
        index = {k: i for i, k in enumerate(got[f"{side}_keys"].tolist())}
        for text, key in zip(texts, text_keys(texts).tolist()):
            batch = tok([text], truncation=True, max_length=length, return_tensors="pt")
            with torch.no_grad():
                ref = model(q=batch)["q"][0]
            assert torch.allclose(got[side][index[key]], ref, atol=1e-6), (side, text)


def test_a_run_from_the_file_logs_the_losses_of_a_run_from_the_teacher_model(teacher_file, tiny_model_dir,
                                                                             small_train_file, tmp_path):
    common = ["--model", tiny_model_dir, "--init-layers", 1, "--train-file", small_train_file, "--val-file", "",
              "--batch-size", 4, "--max-steps", 3, "--distill-embeddings", "cosine", *LENGTHS]
    run_script("train_biencoder.py", common + ["--teacher-model", tiny_model_dir, "--output-dir", tmp_path / "model"])
    run_script("train_biencoder.py", common + ["--teacher-embeddings", teacher_file, "--output-dir", tmp_path / "file"])
    losses = [[r["loss"] for r in read_jsonl(tmp_path / d / "metrics.jsonl") if r["split"] == "train"]
              for d in ("model", "file")]
    assert len(losses[0]) == 3 and max(abs(a - b) for a, b in zip(*losses)) < 1e-5, losses
    card = open(tmp_path / "file" / "final" / "README.md").read()
    assert "teacher embeddings" in card


def test_a_file_missing_a_text_or_of_another_size_is_one_sentence(teacher_file, tiny_model_dir, small_train_file,
                                                                  tmp_path):
    five = tmp_path / "five.jsonl"
    five.write_text("".join(open(small_train_file).readlines()[:5]))
    part = tmp_path / "part.safetensors"
    run_module(["-m", "retrieval_kit.embed", "--model", tiny_model_dir, "--input", five, "--out", part, *LENGTHS])
    common = [os.path.join(ROOT, "train_biencoder.py"), "--model", tiny_model_dir, "--train-file", small_train_file,
              "--val-file", "", "--max-steps", 1, *LENGTHS]
    out = python_run(["-m", "retrieval_kit.embed", "--input", tmp_path / "none.jsonl", "--out", tmp_path / "x"])
    assert out.returncode == 1 and "none.jsonl: cannot open" in out.stderr and "Traceback" not in out.stderr
    out = python_run([*common, "--teacher-embeddings", part, "--output-dir", tmp_path / "a"])
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"--teacher-embeddings {part}: " in out.stderr and "query texts have no vector there" in out.stderr
    out = python_run([*common, "--teacher-embeddings", teacher_file, "--dense-dim", 8, "--output-dir", tmp_path / "b"])
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "the trained model a single-vector of 8; pass --dense-dim 32" in out.stderr, out.stderr[-2000:]
    out = python_run([*common, "--teacher-embeddings", teacher_file, "--teacher-model", tiny_model_dir,
                      "--output-dir", tmp_path / "c"])
    assert out.returncode != 0 and "--teacher-embeddings with --teacher-model" in out.stderr, out.stderr[-2000:]
