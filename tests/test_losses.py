"""retrieval_kit/losses.py against naive loops."""

import math

import pytest
import torch
import torch.nn.functional as F

from retrieval_kit.losses import contrastive_loss, listwise_loss, pointwise_bce_loss


def naive_infonce(q, p, n, temperature, in_batch, offset=0):
    total = 0.0
    for i in range(q.shape[0]):
        cands = range(p.shape[0]) if in_batch else range(i * n + offset, i * n + offset + n)
        logits = [float(q[i] @ p[j]) / temperature for j in cands]
        target = (i * n + offset) if in_batch else 0
        total += -logits[target] + math.log(sum(math.exp(x) for x in logits))
    return total / q.shape[0]


@pytest.mark.parametrize("in_batch", [True, False])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_contrastive_loss_matches_naive_loop(in_batch, n):
    torch.manual_seed(n)
    q = F.normalize(torch.randn(5, 8, dtype=torch.float64), dim=-1)
    p = F.normalize(torch.randn(5 * n, 8, dtype=torch.float64), dim=-1)
    got = contrastive_loss(q, p, n, temperature=0.05, in_batch=in_batch).item()
    assert got == pytest.approx(naive_infonce(q, p, n, 0.05, in_batch), rel=1e-6)


def test_contrastive_loss_label_offset_for_gathered_passages():
    torch.manual_seed(0)
    q = F.normalize(torch.randn(3, 8, dtype=torch.float64), dim=-1)
    p = F.normalize(torch.randn(2 * 3 * 2, 8, dtype=torch.float64), dim=-1)  # 2 ranks x 3 queries x 2
    offset = 1 * 3 * 2  # this rank is rank 1
    got = contrastive_loss(q, p, 2, 0.1, in_batch=True, label_offset=offset).item()
    assert got == pytest.approx(naive_infonce(q, p, 2, 0.1, True, offset), rel=1e-6)


def naive_listwise(logits, n):
    total = 0.0
    rows = logits.view(-1, n).tolist()
    for row in rows:
        total += -row[0] + math.log(sum(math.exp(x) for x in row))
    return total / len(rows)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_listwise_loss_matches_naive_loop(n):
    torch.manual_seed(n)
    logits = torch.randn(3 * n, dtype=torch.float64)
    assert listwise_loss(logits, n).item() == pytest.approx(naive_listwise(logits, n), rel=1e-6)
    with pytest.raises(ValueError, match="groups of"):
        listwise_loss(torch.randn(7), 2)


def test_pointwise_bce_matches_naive_loop():
    torch.manual_seed(0)
    logits = torch.randn(12, dtype=torch.float64)
    n = 4
    total = 0.0
    for i, x in enumerate(logits.tolist()):
        y = 1.0 if i % n == 0 else 0.0
        p = 1 / (1 + math.exp(-x))
        total += -(y * math.log(p) + (1 - y) * math.log(1 - p))
    assert pointwise_bce_loss(logits, n).item() == pytest.approx(total / len(logits), rel=1e-6)  # computed in fp32
