"""retrieval_kit/metrics.py against hand-computed values: group metrics (ties against the positive), the
windowed loss, and the trec_eval retrieval metrics."""

import math

import pytest
import torch

from retrieval_kit.metrics import (group_metric_sums, positive_ranks, query_metrics, rank_docs, retrieval_metrics, top1,
                                   WindowedAverage)


L2 = math.log2


def test_group_metrics_hand_computed():
    scores = torch.tensor([
        [0.9, 0.1, 0.2],  # rank 1
        [0.5, 0.7, 0.1],  # rank 2
        [0.1, 0.3, 0.2],  # rank 3
        [0.4, 0.4, 0.0],  # tie counts against the positive: rank 2
    ])
    assert positive_ranks(scores).tolist() == [1, 2, 3, 2]
    assert top1(scores, 0).tolist() == [1.0, 0.0, 0.0, 0.0]  # the training accuracy: the same tie rule
    assert group_metric_sums(scores) == pytest.approx((1, 1 + 1 / 2 + 1 / 3 + 1 / 2, 4))


def test_top1_per_row_target_and_ties_against_it():
    scores = torch.tensor([[0.2, 0.9, 0.1, 0.0], [0.5, 0.5, 0.5, 0.1], [0.0, 0.1, 0.2, 0.3]])
    assert top1(scores, torch.tensor([1, 2, 3])).tolist() == [1.0, 0.0, 1.0]  # row 1: a three-way tie
    # the naive rule: the target is strictly above every other column
    naive = [float(all(row[t] > v for j, v in enumerate(row) if j != t)) for row, t in zip(scores.tolist(), [1, 2, 3])]
    assert top1(scores, torch.tensor([1, 2, 3])).tolist() == naive


def test_windowed_average():
    w = WindowedAverage(3)
    assert math.isnan(w.value)
    assert [w.update(x) for x in [1, 2, 3, 4]] == [1, 1.5, 2, 3]
    w2 = WindowedAverage(10)
    w2.load_state_dict(w.state_dict())
    assert w2.update(5) == pytest.approx(4)


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
