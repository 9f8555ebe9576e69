"""retrieval_kit/mine.py: the mining window, the false-negative filter and the entry point."""

import os

import pytest
import torch

from retrieval_kit.mine import mine_hard_negatives
from tests.conftest import ROOT, read_jsonl, run_module


def test_mining_window_and_false_negative_filter():
    q = torch.tensor([[1.0, 0.0]])
    p = torch.tensor([[1.0, 0.0], [0.99, 0.14], [0.9, 0.43], [0.8, 0.6], [0.5, 0.87], [1.0, 0.0]])
    texts = ["pos", "near-dup", "b", "c", "d", "pos"]  # index 5 is the positive's exact text again
    assert mine_hard_negatives(q, p, [[0]], k=3, max_score_ratio=None, p_texts=texts) == [[1, 2, 3]]
    assert mine_hard_negatives(q, p, [[0]], k=3, max_score_ratio=0.95, p_texts=texts) == [[2, 3, 4]]
    assert mine_hard_negatives(q, p, [[0]], k=2, skip_top=1, max_score_ratio=None, p_texts=texts) == [[2, 3]]


@pytest.mark.slow
def test_mine_entry_point(tiny_model_dir, small_beir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line for line in open(os.path.join(ROOT, "data", "val.jsonl")).readlines()[:5]))
    out = tmp_path / "mined.jsonl"
    run_module(["-m", "retrieval_kit.mine", "--input", src, "--corpus", os.path.join(small_beir, "corpus.jsonl"),
                "--out", out, "--model", tiny_model_dir, "--k", 4, "--max-score-ratio", 0])
    rows = read_jsonl(out)
    assert len(rows) == 5
    for r in rows:
        pos = [d["text"] if isinstance(d, dict) else d for d in r["pos_doc"]]
        assert len(r["neg_doc"]) == 4 and not set(r["neg_doc"]) & set(pos)


@pytest.mark.slow
def test_mine_leaves_out_queries_with_no_negative(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line for line in open(os.path.join(ROOT, "data", "val.jsonl")).readlines()[:3]))
    out = tmp_path / "sub" / "mined.jsonl"  # the folder does not exist yet
    # a score ratio far below any candidate's: every candidate is dropped as a likely false negative
    proc = run_module(["-m", "retrieval_kit.mine", "--input", src, "--out", out, "--model", tiny_model_dir,
                       "--k", 2, "--max-score-ratio", 1e-6])
    assert read_jsonl(out) == []
    assert "3 left out" in proc.stdout
