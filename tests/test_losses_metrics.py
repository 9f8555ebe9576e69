import math

import pytest
import torch
import torch.nn.functional as F

from retrieval_kit.losses import contrastive_loss
from retrieval_kit.metrics import WindowedAverage, accuracy_at_1, group_metric_sums, mrr, positive_ranks


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


def test_group_metrics_hand_computed():
    scores = torch.tensor([
        [0.9, 0.1, 0.2],  # rank 1
        [0.5, 0.7, 0.1],  # rank 2
        [0.1, 0.3, 0.2],  # rank 3
        [0.4, 0.4, 0.0],  # tie counts against the positive: rank 2
    ])
    assert positive_ranks(scores).tolist() == [1, 2, 3, 2]
    assert accuracy_at_1(scores) == pytest.approx(0.25)
    assert mrr(scores) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 2) / 4)
    assert group_metric_sums(scores) == pytest.approx((1, 1 + 1 / 2 + 1 / 3 + 1 / 2, 4))


def test_windowed_average():
    w = WindowedAverage(3)
    assert math.isnan(w.value)
    assert [w.update(x) for x in [1, 2, 3, 4]] == [1, 1.5, 2, 3]
    w2 = WindowedAverage(10)
    w2.load_state_dict(w.state_dict())
    assert w2.update(5) == pytest.approx(4)
