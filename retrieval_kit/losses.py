"""Losses: contrastive InfoNCE for bi-encoders; listwise CE and pointwise BCE for rerankers.

Layout: q is (B, H); p is (B * n_passages, H) query-major, so the positive of query i is row
i * n_passages and rows i * n_passages + 1 .. are its hard negatives. With in-batch negatives
every query is scored against every passage in p (its own group plus everyone else's); without,
only against its own group.

When p holds passages gathered from all ranks, this rank's queries start at global query index
`rank * B`: pass `label_offset = rank * B * n_passages`.
"""

import torch
import torch.nn.functional as F


def contrastive_scores(q, p, n_passages, in_batch=True):
    """Similarity logits in fp32, whatever the embeddings' dtype and any autocast around the call
    (bf16 scores near cos 0.9 step by 0.004, a logit step of 0.08 at temperature 0.05):
    (B, P) with in-batch negatives, (B, n_passages) without."""
    with torch.autocast(q.device.type, enabled=False):
        q, p = q.float(), p.float()
        if in_batch:
            return q @ p.T  # (B, P)
        groups = p.view(q.shape[0], n_passages, -1)  # (B, n, H)
        return torch.einsum("bh,bnh->bn", q, groups)  # (B, n)


def contrastive_loss(q, p, n_passages, temperature=0.05, in_batch=True, label_offset=0):
    """Mean InfoNCE over the B queries in q; see the module docstring for the layout."""
    scores = contrastive_scores(q, p, n_passages, in_batch) / temperature
    if in_batch:
        labels = torch.arange(q.shape[0], device=q.device) * n_passages + label_offset
    else:
        labels = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    return F.cross_entropy(scores.float(), labels)


def listwise_loss(logits, n_passages):
    """Cross-entropy over each group's logits, the positive at column 0.

    `logits` is (n_pairs,) or (n_pairs, 1), query-major; n_queries = n_pairs // n_passages comes
    from the batch itself, so any batch size and any n_passages give the right shapes.
    """
    logits = logits.reshape(-1)
    if logits.numel() % n_passages:
        raise ValueError(f"{logits.numel()} pairs do not split into groups of {n_passages}")
    scores = logits.view(-1, n_passages).float()  # (n_queries, n_passages)
    return F.cross_entropy(scores, torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device))


def pointwise_bce_loss(logits, n_passages):
    """Binary cross-entropy of each pair's logit against its label: 1 for the positive (column 0 of
    each query-major group of n_passages), 0 for the negatives; mean over all pairs."""
    logits = logits.reshape(-1)
    if logits.numel() % n_passages:
        raise ValueError(f"{logits.numel()} pairs do not split into groups of {n_passages}")
    scores = logits.view(-1, n_passages).float()  # (n_queries, n_passages)
    labels = torch.zeros_like(scores)
    labels[:, 0] = 1.0
    return F.binary_cross_entropy_with_logits(scores, labels)


RERANK_LOSSES = {"listwise": listwise_loss, "bce": pointwise_bce_loss}
