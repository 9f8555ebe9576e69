"""Losses: contrastive InfoNCE for bi-encoders over a head's scores (Matryoshka as a wrapper around
it); listwise CE and pointwise BCE for rerankers; the KL distillation term for either, from teacher
scores; and each script's step loss composed from them (biencoder_loss, reranker_loss), by keyword.
Pure maths: the gathers across ranks are the caller's (dist's, passed in), a head's scores and
regularizer too (retrieval_kit/heads/).

Layout: q is (B, H); p is (B * n_passages, H) query-major, so the positive of query i is row
i * n_passages and rows i * n_passages + 1 .. are its hard negatives. With in-batch negatives
every query is scored against every passage in p (its own group plus everyone else's); without,
only against its own group.

When p holds passages gathered from all ranks, this rank's queries start at global query index
`rank * B`: pass `label_offset = rank * B * n_passages`.
"""

import torch
import torch.nn.functional as F

from .metrics import top1


def contrastive_scores(q, p, n_passages, in_batch=True):
    """Inner-product similarity logits in fp32, whatever the embeddings' dtype and any autocast around
    the call (bf16 scores near cos 0.9 step by 0.004, a logit step of 0.08 at temperature 0.05):
    (B, P) with in-batch negatives, (B, n_passages) without. The `scores` of one-vector and sparse
    heads; another head passes its own (heads/multi_vector.scores: MaxSim)."""
    with torch.autocast(q.device.type, enabled=False):
        q, p = q.float(), p.float()
        if in_batch:
            return q @ p.T  # (B, P)
        groups = p.view(q.shape[0], n_passages, -1)  # (B, n, H)
        return torch.einsum("bh,bnh->bn", q, groups)  # (B, n)


def duplicate_mask(p_keys, n_passages, in_batch=True, label_offset=0, all_keys=None):
    """(B, P) (or (B, n) without in-batch negatives) True where a candidate is the query's own
    positive again - the same text in another row: another query's positive or hard negative, or
    one of its own negatives - but not the positive's own row. `p_keys` are this rank's passage
    keys (collate.text_keys, query-major); `all_keys` every candidate's (gathered over ranks)."""
    b = p_keys.shape[0] // n_passages
    pos = p_keys.view(b, n_passages)[:, 0]  # (B,)
    if not in_batch:
        mask = p_keys.view(b, n_passages) == pos[:, None]
        mask[:, 0] = False
        return mask
    cand = p_keys if all_keys is None else all_keys
    mask = cand[None, :] == pos[:, None]  # (B, P)
    mask[torch.arange(b, device=mask.device), torch.arange(b, device=mask.device) * n_passages + label_offset] = False
    return mask


def contrastive_loss(q, p, n_passages, temperature=0.05, in_batch=True, label_offset=0, mask=None,
                     scores=contrastive_scores):
    """Mean InfoNCE over the B queries in q; see the module docstring for the layout. `mask`
    (duplicate_mask): candidates left out of each query's softmax; `scores`: the head's
    (contrastive_scores, the inner product, unless the head scores otherwise)."""
    scores = scores(q, p, n_passages, in_batch) / temperature
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
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


def distill_kl(student, teacher, temperature, teacher_temperature):
    """Distillation term: KL(teacher || student) between softmaxes over each query's group, mean over
    the queries that have teacher scores.

    student: (Q, n) similarity scores (or logits) of each query's own group, positive first;
    teacher: (Q, n) teacher scores of the same passages, NaN where a passage has none (a filled
    negative): it is left out of both softmaxes. The student's softmax is taken at the training
    `temperature` (its InfoNCE temperature; 1 for reranker logits), the teacher's at
    `teacher_temperature`. A teacher equal to the student (same temperature) gives 0 and a zero
    gradient. Not scaled by temperature^2."""
    student = student.float() / temperature
    teacher = teacher.to(student.device, torch.float32) / teacher_temperature
    missing = torch.isnan(teacher)
    neg_inf = torch.finfo(torch.float32).min  # not -inf: a row with every score missing stays finite
    log_s = F.log_softmax(student.masked_fill(missing, neg_inf), dim=-1)
    log_t = F.log_softmax(teacher.masked_fill(missing, neg_inf), dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).masked_fill(missing, 0.0).sum(-1)  # (Q,)
    scored = (~missing).any(-1)
    return (kl * scored).sum() / scored.sum().clamp(min=1)


def matryoshka(loss, dims, weights, normalize=True):
    """Matryoshka representation learning (Kusupati et al., 2022) as a wrapper around any loss of
    (q, p, ...) embeddings: the weighted sum over `dims` of `loss` on the first d dimensions of
    every embedding, re-normalized when the model normalizes (a unit vector's prefix is not one).
    Other arguments pass through to `loss` unchanged."""

    def loss_over_prefixes(q, p, *args, **kwargs):
        total = 0.0
        for d, w in zip(dims, weights):
            qd, pd = q[:, :d], p[:, :d]
            if normalize:
                qd, pd = F.normalize(qd.float(), dim=-1), F.normalize(pd.float(), dim=-1)
            total = total + w * loss(qd, pd, *args, **kwargs)
        return total

    return loss_over_prefixes


def matryoshka_loss(q, p, n_passages, dims, weights, normalize, temperature=0.05, in_batch=True, label_offset=0,
                    mask=None, scores=contrastive_scores):
    """contrastive_loss summed over Matryoshka prefixes (matryoshka(contrastive_loss, ...))."""
    return matryoshka(contrastive_loss, dims, weights, normalize)(q, p, n_passages, temperature, in_batch,
                                                                  label_offset, mask, scores)


def matryoshka_plan(dims, weights, hidden_size):
    """(dims, weights) of --matryoshka-dims / --matryoshka-weights checked against the model's
    embedding size (one sentence naming the flag otherwise); ([], []) when off."""
    if not dims:
        if weights:
            raise SystemExit("--matryoshka-weights needs --matryoshka-dims")
        return [], []
    too_big = [d for d in dims if d > hidden_size]
    if too_big:
        raise SystemExit(f"--matryoshka-dims {','.join(map(str, dims))}: {too_big} exceed the model's embedding "
                         f"size {hidden_size}")
    weights = weights or [1.0] * len(dims)
    if len(weights) != len(dims):
        raise SystemExit(f"--matryoshka-weights has {len(weights)} values for {len(dims)} --matryoshka-dims")
    return dims, weights


# ----- the loss_fn of a training step: (model outputs, **targets) -> (loss, top-1 accuracy, counts) ---

def biencoder_loss(out, *, n_passages, temperature=0.05, in_batch=True, gather=None, gather_with_grad=None,
                   label_offset=0, contrastive=contrastive_loss, scores=contrastive_scores, mask_duplicates=True,
                   distill_weight=0.0, teacher_temperature=1.0, teacher=None, p_keys=None, regularizer=None):
    """The bi-encoder's step loss: `contrastive` (InfoNCE, or matryoshka(contrastive_loss, ...)) over the
    head's `scores` of this rank's queries against its passages - every rank's when the caller passes
    the gathers (`gather_with_grad`, keeping the graph, and `gather`, without: dist's; then pass
    `label_offset` = rank * B * n_passages) - each query's own positive left out of its negatives
    wherever its text appears again (`mask_duplicates`, from the batch's `p_keys`); plus
    distill_weight x KL(teacher || model) over each query's own group (in-batch negatives have no
    teacher score), the teacher at `teacher_temperature`, the model at `temperature`; plus the head's
    `regularizer` (sparse: FLOPS) of every rank's queries and passages.
    Returns (loss, each query's top-1 accuracy (ties count against the positive),
    {"duplicates_masked": candidates left out, and the regularizer's counts})."""
    q, p = out["q"], out["p"]
    gathered = gather_with_grad is not None
    p_all = gather_with_grad(p) if gathered else p  # (W*B*n, H); grads flow back to each rank
    mask = None
    if mask_duplicates and p_keys is not None:
        mask = duplicate_mask(p_keys, n_passages, in_batch, label_offset,
                              gather(p_keys) if gathered and in_batch else None)
    loss = contrastive(q, p_all, n_passages, temperature, in_batch, label_offset, mask, scores=scores)
    if teacher is not None and distill_weight > 0:
        own = scores(q, p, n_passages, in_batch=False)  # (B, n)
        loss = loss + distill_weight * distill_kl(own, teacher, temperature, teacher_temperature)
    extra = {}
    if regularizer is not None:
        reg, extra = regularizer(gather_with_grad(q) if gathered else q, p_all)
        loss = loss + reg
    with torch.no_grad():
        logits = scores(q, p_all, n_passages, in_batch)
        if mask is not None:
            logits = logits.masked_fill(mask, float("-inf"))
        target = label_offset + torch.arange(len(q), device=logits.device) * n_passages if in_batch else 0
        masked = mask.sum() if mask is not None else torch.zeros((), device=logits.device)
        return loss, top1(logits, target), {"duplicates_masked": masked, **extra}


def reranker_loss(out, *, n_passages, loss=listwise_loss, distill_weight=0.0, teacher_temperature=1.0, teacher=None):
    """The reranker's step loss: `loss` (listwise_loss or pointwise_bce_loss) over query-major
    groups of n_passages pairs, positive first, plus distill_weight x the listwise
    KL(teacher || logits) of each group, the teacher at `teacher_temperature`. Returns (loss, each
    query's top-1 accuracy (ties count against the positive))."""
    logits = out["pairs"]  # (B * n,)
    value = loss(logits, n_passages)
    if teacher is not None and distill_weight > 0:
        value = value + distill_weight * distill_kl(logits.view(-1, n_passages), teacher, 1.0, teacher_temperature)
    return value, top1(logits.detach().view(-1, n_passages), 0)
