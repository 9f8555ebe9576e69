"""Retrieval metrics against hand-computed values, chunked search, the evaluate and mine entry points."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from retrieval_kit import ckpt
from retrieval_kit.encode import exact_topk
from retrieval_kit.metrics import query_metrics, rank_docs, retrieval_metrics
from retrieval_kit.mine import mine_hard_negatives
from retrieval_kit.models import load_reranker
from tests.conftest import ROOT, read_jsonl

L2 = math.log2


def test_binary_relevance_two_relevant_docs():
    m = query_metrics(["a", "b", "c", "d"], {"b": 1, "d": 1})
    assert m["ndcg@10"] == pytest.approx((1 / L2(3) + 1 / L2(5)) / (1 + 1 / L2(3)))
    assert m["mrr@10"] == pytest.approx(1 / 2)
    assert m["recall@10"] == 1.0 and m["recall@100"] == 1.0
    assert m["map@100"] == pytest.approx((1 / 2 + 2 / 4) / 2)


def test_graded_relevance_and_a_relevant_doc_missing_from_the_corpus():
    m = query_metrics(["c", "a", "b"], {"a": 2, "c": 1, "x": 3})  # x was never retrieved
    assert m["ndcg@10"] == pytest.approx((1 / L2(2) + 2 / L2(3)) / (3 / L2(2) + 2 / L2(3) + 1 / L2(4)))
    assert m["mrr@10"] == 1.0
    assert m["recall@10"] == pytest.approx(2 / 3)
    assert m["map@100"] == pytest.approx((1 / 1 + 2 / 2) / 3)


def test_cutoffs():
    ranked = [f"d{i}" for i in range(150)]
    m = query_metrics(ranked, {"d10": 1, "d120": 1})  # ranks 11 and 121
    assert m["mrr@10"] == 0.0 and m["ndcg@10"] == 0.0 and m["recall@10"] == 0.0
    assert m["recall@100"] == 0.5 and m["map@100"] == pytest.approx((1 / 11) / 2)


def test_ties_are_broken_by_doc_id_descending_like_trec_eval():
    assert rank_docs({"a": 1.0, "b": 1.0, "c": 2.0}) == ["c", "b", "a"]
    m = retrieval_metrics({"q": {"a": 1.0, "b": 1.0}}, {"q": {"a": 1}})
    assert m["mrr@10"] == 0.5


def test_queries_without_relevant_docs_and_queries_missing_from_the_run():
    m = query_metrics(["a", "b"], {"a": 0})
    assert all(v == 0.0 for v in m.values())
    avg = retrieval_metrics({"q1": {"a": 1.0}}, {"q1": {"a": 1}, "q2": {"z": 1}})  # q2 retrieved nothing
    assert avg["mrr@10"] == 0.5 and avg["recall@100"] == 0.5


def test_chunked_search_equals_the_full_matrix():
    torch.manual_seed(0)
    q, p = torch.randn(7, 16), torch.randn(1000, 16)
    full = (q @ p.T).topk(50, dim=1)
    for qc, pc in ((3, 64), (7, 1000), (1, 333)):
        s, i = exact_topk(q, p, 50, query_chunk=qc, corpus_chunk=pc)
        assert torch.equal(i, full.indices) and torch.allclose(s, full.values)
    s, i = exact_topk(q, p[:20], 50)  # k larger than the corpus
    assert s.shape == (7, 20)


def test_mining_window_and_false_negative_filter():
    q = torch.tensor([[1.0, 0.0]])
    p = torch.tensor([[1.0, 0.0], [0.99, 0.14], [0.9, 0.43], [0.8, 0.6], [0.5, 0.87], [1.0, 0.0]])
    texts = ["pos", "near-dup", "b", "c", "d", "pos"]  # index 5 is the positive's exact text again
    assert mine_hard_negatives(q, p, [[0]], k=3, max_score_ratio=None, p_texts=texts) == [[1, 2, 3]]
    assert mine_hard_negatives(q, p, [[0]], k=3, max_score_ratio=0.95, p_texts=texts) == [[2, 3, 4]]
    assert mine_hard_negatives(q, p, [[0]], k=2, skip_top=1, max_score_ratio=None, p_texts=texts) == [[2, 3]]


@pytest.fixture(scope="module")
def small_beir(tmp_path_factory):
    """The first 60 docs of the bundled eval corpus and the queries judged on them."""
    out = tmp_path_factory.mktemp("beir")
    docs = read_jsonl(os.path.join(ROOT, "data", "eval", "corpus.jsonl"))[:60]
    ids = {d["_id"] for d in docs}
    qrels = [line.split("\t") for line in open(os.path.join(ROOT, "data", "eval", "qrels", "test.tsv")).read().splitlines()[1:]]
    qrels = [r for r in qrels if r[1] in ids]
    qids = {r[0] for r in qrels}
    queries = [q for q in read_jsonl(os.path.join(ROOT, "data", "eval", "queries.jsonl")) if q["_id"] in qids]
    (out / "qrels").mkdir()
    (out / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (out / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (out / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join("\t".join(r) + "\n" for r in qrels))
    assert len(queries) >= 3
    return str(out)


def run_module(args, nproc=1):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    out = subprocess.run(launcher + [str(a) for a in args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def test_evaluate_entry_point_two_stages_and_ranks(tiny_model_dir, tokenizer, small_beir, tmp_path):
    torch.manual_seed(0)
    rr_dir = ckpt.export_model(str(tmp_path / "rr"), load_reranker(tiny_model_dir), tokenizer, {
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


def test_fuse_scores_standardises_each_stage():
    from retrieval_kit.evaluate import fuse_scores

    rr, bi = torch.tensor([4.0, 0.0, 2.0]), torch.tensor([0.70, 0.90, 0.80])
    assert torch.equal(fuse_scores(rr, bi, 1.0), rr)  # reranker alone
    assert fuse_scores(rr, bi, 0.0).argsort(descending=True).tolist() == [1, 2, 0]  # bi-encoder order
    # by hand: z(rr) = (1, -1, 0), z(bi) = (-1, 1, 0) (sample std 2 and 0.1); w = 0.75 -> (0.5, -0.5, 0)
    assert fuse_scores(rr, bi, 0.75).tolist() == pytest.approx([0.5, -0.5, 0.0], abs=1e-6)  # fp32 inputs


def test_mine_leaves_out_queries_with_no_negative(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line for line in open(os.path.join(ROOT, "data", "val.jsonl")).readlines()[:3]))
    out = tmp_path / "sub" / "mined.jsonl"  # the folder does not exist yet
    # a score ratio far below any candidate's: every candidate is dropped as a likely false negative
    proc = run_module(["-m", "retrieval_kit.mine", "--input", src, "--out", out, "--model", tiny_model_dir,
                       "--k", 2, "--max-score-ratio", 1e-6])
    assert read_jsonl(out) == []
    assert "3 left out" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--rerank-weight", "2"], "--rerank-weight must be between 0 and 1"),
    (["--rerank-top-k", "0"], "--rerank-top-k must be at least 1"),
    (["--reranker", "/nonexistent"], "--reranker /nonexistent: no such folder"),
])
def test_evaluate_bad_flags_are_one_message(args, message):
    out = subprocess.run([sys.executable, "-m", "retrieval_kit.evaluate", "--beir", "data/ood", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
