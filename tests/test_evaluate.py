"""Retrieval metrics against hand-computed values, chunked search, the evaluate and mine entry points."""

import json

import pytest
import torch

from retrieval_kit.export import export_model
from retrieval_kit.heads.classifier import load as load_reranker
from tests.conftest import needs_cpu_bf16, python_run, run_module






@pytest.mark.slow
@needs_cpu_bf16
def test_evaluate_entry_point_two_stages_and_ranks(tiny_model_dir, tokenizer, small_beir, tmp_path):
    torch.manual_seed(0)
    rr_dir = export_model(str(tmp_path / "rr"), load_reranker(tiny_model_dir), tokenizer, {
        "kind": "reranker", "pooling": "avg", "prompt_template": "Q: {query} P: {passage}",
        "rerank_max_length": 64, "append_eos": False, "padding_side": "right", "pad_to_multiple_of": 8})
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"m{nproc}.json"
        run_module(["-m", "retrieval_kit.evaluate", "--model", tiny_model_dir, "--beir", small_beir, "--k", 20,
                    "--reranker", rr_dir, "--rerank-top-k", 5, "--output", out], nproc)  # torchrun -m too
        results[nproc] = json.loads(out.read_text())
    for stage in ("biencoder", "biencoder+reranker@5"):
        m1, m2 = results[1][stage], results[2][stage]
        assert set(m1) == {"ndcg@10", "mrr@10", "recall@10", "recall@100", "map@100"}
        assert all(0.0 <= v <= 1.0 for v in m1.values())
        for k in m1:  # the corpus split over 2 ranks gives the same ranking as one process
            assert m1[k] == pytest.approx(m2[k], abs=1e-6), (stage, k)
    # the reranker only reorders the top 5: recall@10 and recall@100 cannot change
    assert results[1]["biencoder+reranker@5"]["recall@100"] == results[1]["biencoder"]["recall@100"]
    bf16 = tmp_path / "bf16.json"  # both stages' forwards under bf16 autocast (test_precision: that they are)
    run_module(["-m", "retrieval_kit.evaluate", "--model", tiny_model_dir, "--beir", small_beir, "--k", 20,
                "--reranker", rr_dir, "--rerank-top-k", 5, "--output", bf16, "--compute-dtype", "bf16"])
    got = json.loads(bf16.read_text())  # which docs reach the top 20 may round differently from fp32: no comparison
    assert all(got[stage].keys() == results[1][stage].keys() for stage in ("biencoder", "biencoder+reranker@5"))
    assert got["biencoder+reranker@5"]["recall@100"] == got["biencoder"]["recall@100"]


def test_fuse_scores_standardises_each_stage():
    from retrieval_kit.evaluate import fuse_scores

    rr, bi = torch.tensor([4.0, 0.0, 2.0]), torch.tensor([0.70, 0.90, 0.80])
    assert torch.equal(fuse_scores(rr, bi, 1.0), rr)  # reranker alone
    assert fuse_scores(rr, bi, 0.0).argsort(descending=True).tolist() == [1, 2, 0]  # bi-encoder order
    # by hand: z(rr) = (1, -1, 0), z(bi) = (-1, 1, 0) (sample std 2 and 0.1); w = 0.75 -> (0.5, -0.5, 0)
    assert fuse_scores(rr, bi, 0.75).tolist() == pytest.approx([0.5, -0.5, 0.0], abs=1e-6)  # fp32 inputs


@pytest.mark.parametrize("args,message", [
    (["--rerank-weight", "2"], "argument --rerank-weight: must be between 0 and 1, got 2"),
    (["--rerank-top-k", "0"], "argument --rerank-top-k: must be a positive integer, got 0"),
    (["--reranker", "/nonexistent"], "--reranker /nonexistent: no such folder"),
])
@pytest.mark.slow
def test_evaluate_bad_flags_are_one_message(args, message):
    out = python_run(["-m", "retrieval_kit.evaluate", "--beir", "data/ood", *args], timeout=120)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
