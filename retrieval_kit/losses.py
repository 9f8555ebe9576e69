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


# --loss-directions: the softmax terms of the contrastive loss (sentence-transformers' MNRL directions)
DIRECTIONS = {"q2p": "query_to_doc", "p2q": "doc_to_query", "q2q": "query_to_query", "p2p": "doc_to_doc"}


def direction_scores(q, p, n_passages, directions=("q2p",), scores=contrastive_scores, in_batch=True,
                     label_offset=0, q_all=None):
    """{direction: fp32 scores} of this rank's B queries (q) and their positives (rows label_offset +
    i * n_passages of p) against each direction's candidates: q2p each query against every passage in
    p (B, P) (without in-batch negatives its own group, (B, n)); p2q each positive against every query
    (q_all: every rank's, else q), (B, Q), as s(query, positive); q2q each query against every query
    (B, Q); p2p each positive against every passage (B, P), as s(passage, positive) - the orientation
    of sentence-transformers' MultipleNegativesRankingLoss(directions=...)."""
    out = {"q2p": scores(q, p, n_passages, in_batch)}
    if len(directions) == 1:
        return out
    q_all = q if q_all is None else q_all
    pos = p[label_offset + torch.arange(q.shape[0], device=p.device) * n_passages]
    if "p2q" in directions:
        out["p2q"] = scores(q_all, pos, 1).T
    if "q2q" in directions:
        out["q2q"] = scores(q, q_all, 1)
    if "p2p" in directions:
        out["p2p"] = scores(p, pos, 1).T
    return {d: out[d] for d in directions}


def own_columns(b, n_passages, directions, in_batch=True, label_offset=0, device=None):
    """{direction: (B,) column} of each row's own pair in its direction's scores: the positive in q2p
    (label_offset + i * n, or 0 without in-batch negatives), the query in p2q and q2q (this rank's
    query i among every rank's: label_offset / n + i); None for p2p (its own group: group_columns)."""
    rows = torch.arange(b, device=device)
    first = label_offset // n_passages + rows
    own = {"q2p": rows * n_passages + label_offset if in_batch else torch.zeros_like(rows), "p2q": first, "q2q": first}
    return {d: own.get(d) for d in directions}


def structure_masks(b, n_queries, n_cands, n_passages, directions, label_offset=0, duplicates=None, device=None):
    """{direction: (B, C) True where a candidate is left out whatever the scores} for `b` queries against
    `n_queries` queries and `n_cands` passages (every rank's): the duplicates of the query's positive
    (duplicate_mask) in q2p and p2p, the query itself in q2q, the positive's own group (itself and its
    query's hard negatives) in p2p; None where nothing is. Shapes only: no score is computed."""
    rows = torch.arange(b, device=device)
    first = label_offset // n_passages + rows  # this rank's queries among every rank's
    out = {}
    for d in directions:
        mask = duplicates if d in ("q2p", "p2p") else None
        if d == "q2q":
            mask = torch.zeros((b, n_queries), dtype=torch.bool, device=device)
            mask[rows, first] = True
        if d == "p2p":
            group = torch.arange(n_cands, device=device)[None, :] // n_passages == first[:, None]
            mask = group if mask is None else mask | group
        out[d] = mask
    return out


def score_masks(terms, n_passages, margin, relative=False, above=False, in_batch=True, label_offset=0):
    """{direction: (B, C) True where a candidate's score passes the row's positive score}: a false
    negative by score, the row's own pair never. `terms` (direction_scores, without a graph) are the
    model's own (Qwen3-Embedding's rule, `above`: a score above the positive's + margin, arXiv
    2506.05176) or a frozen guide's (GISTEmbed's: above the positive's - margin, or - |positive| x
    margin when `relative`)."""
    b = terms["q2p"].shape[0]
    own = own_columns(b, n_passages, terms, in_batch, label_offset, terms["q2p"].device)
    rows = torch.arange(b, device=terms["q2p"].device)
    pos = terms["q2p"][rows, own["q2p"]][:, None]  # (B, 1)
    bound = pos + margin if above else pos - (pos.abs() * margin if relative else margin)
    out = {}
    for d, t in terms.items():
        mask = t > bound
        if own[d] is not None and d != "q2q":
            mask[rows, own[d]] = False  # the positive stays
        out[d] = mask
    return out


def contrastive_loss(q, p, n_passages, temperature=0.05, in_batch=True, label_offset=0, mask=None,
                     scores=contrastive_scores, directions=("q2p",), joint=True, q_all=None):
    """Mean InfoNCE over the B queries in q; see the module docstring for the layout. `mask`
    (duplicate_mask, or {direction: mask}: structure_masks | score_masks): candidates left out of each
    query's softmax; `scores`: the head's (contrastive_scores, the inner product, unless the head scores
    otherwise). `directions` (direction_scores; q2p first): the terms beside the queries' own, `q_all`
    every rank's queries; `joint`: one softmax over all terms, else one per term, their log-partitions
    averaged (sentence-transformers' partition_mode "joint" / "per_direction")."""
    terms = direction_scores(q, p, n_passages, directions, scores, in_batch, label_offset, q_all)
    masks = mask if isinstance(mask, dict) else {"q2p": mask}
    logits = []
    for d, t in terms.items():
        t = t / temperature
        logits.append(t.masked_fill(masks[d], float("-inf")) if masks.get(d) is not None else t)
    if in_batch:
        labels = torch.arange(q.shape[0], device=q.device) * n_passages + label_offset
    else:
        labels = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    if len(logits) == 1 or joint:  # (the positive is in the first term, q2p, at its label)
        return F.cross_entropy((logits[0] if len(logits) == 1 else torch.cat(logits, 1)).float(), labels)
    pos = logits[0].gather(1, labels[:, None])[:, 0]
    log_z = torch.stack([torch.logsumexp(t, 1) for t in logits]).mean(0)
    return (log_z - pos).mean()


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


def distill_margin_mse(student, teacher, temperature=None, teacher_temperature=None):
    """MarginMSE (Hofstätter et al., 2020): the mean squared difference between the student's and the
    teacher's margins - the positive's score minus each negative's - over each query's group, raw
    scores (no temperature: `temperature` and `teacher_temperature` are taken for distill_kl's call
    and not used). student, teacher: (Q, n) as for distill_kl, NaN where the teacher has no score
    (that margin left out). sentence-transformers' MarginMSELoss."""
    student = student.float()
    teacher = teacher.to(student.device, torch.float32)
    margins, target = student[:, :1] - student[:, 1:], teacher[:, :1] - teacher[:, 1:]  # (Q, n - 1)
    known = ~torch.isnan(target)
    return ((margins - target.nan_to_num()) ** 2 * known).sum() / known.sum().clamp(min=1)


DISTILL_LOSSES = {"kl": distill_kl, "margin-mse": distill_margin_mse}  # --distill-loss


def embedding_distill(q, p, teacher, metric="mse"):
    """Embedding distillation: the student's query and passage embeddings (q, p) regress a frozen
    teacher's of the same texts (`teacher`: {"q", "p"}), by the mean squared error over every number
    ("mse") or the mean of 1 - cosine over the texts ("cosine"), in fp32: sentence-transformers'
    MSELoss / EmbedDistillLoss(distance_metric="cosine") over the (query, passage, negatives) columns."""
    student = torch.cat([q.reshape(q.shape[0], -1), p.reshape(p.shape[0], -1)]).float()
    target = torch.cat([teacher["q"].reshape(q.shape[0], -1), teacher["p"].reshape(p.shape[0], -1)]).to(student)
    if metric == "mse":
        return F.mse_loss(student, target)
    return (1 - F.cosine_similarity(student, target, dim=-1)).mean()


def matryoshka(loss, dims, weights, normalize=True):
    """Matryoshka representation learning (Kusupati et al., 2022) as a wrapper around any loss of
    (q, p, ...) embeddings: the weighted sum over `dims` of `loss` on the first d dimensions of
    every embedding, re-normalized when the model normalizes (a unit vector's prefix is not one).
    Other arguments pass through to `loss` unchanged."""

    def loss_over_prefixes(q, p, *args, q_all=None, **kwargs):
        total = 0.0
        for d, w in zip(dims, weights):
            qd, pd = q[:, :d], p[:, :d]
            qd_all = None if q_all is None else q_all[:, :d]  # (every rank's queries, for p2q / q2q)
            if normalize:
                qd, pd = F.normalize(qd.float(), dim=-1), F.normalize(pd.float(), dim=-1)
                qd_all = None if qd_all is None else F.normalize(qd_all.float(), dim=-1)
            total = total + w * loss(qd, pd, *args, **({"q_all": qd_all} if qd_all is not None else {}), **kwargs)
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

def false_negative_masks(q, p, n_passages, directions, scores, in_batch, label_offset, q_all, duplicates,
                         false_negative_margin=None, guide=None, guide_scores=None, guide_margin=0.0,
                         guide_relative=False, gather=None):
    """({direction: mask} for contrastive_loss, the count of candidates left out as false negatives by
    score): structure_masks, with score_masks of the model's own scores (`false_negative_margin`) and of
    a frozen guide's (`guide`: its {"q", "p"} of this rank's batch, scored by `guide_scores`, gathered
    like the model's by `gather`), all computed without a graph."""
    with torch.no_grad():
        masks = structure_masks(q.shape[0], q.shape[0] if q_all is None else q_all.shape[0], p.shape[0], n_passages,
                                directions, label_offset, duplicates, q.device)
        by_score = []
        if false_negative_margin is not None:  # (the model's own scores, only for this rule)
            terms = direction_scores(q.detach(), p.detach(), n_passages, directions, scores, in_batch, label_offset,
                                     None if q_all is None else q_all.detach())
            by_score.append(score_masks(terms, n_passages, false_negative_margin, above=True, in_batch=in_batch,
                                        label_offset=label_offset))
        if guide is not None:
            gq, gp = guide["q"], guide["p"]
            gp_all = gather(gp) if gather is not None else gp
            gq_all = gather(gq) if gather is not None and len(directions) > 1 else gq
            g_terms = direction_scores(gq, gp_all, n_passages, directions, guide_scores or scores, in_batch,
                                       label_offset, gq_all)
            by_score.append(score_masks(g_terms, n_passages, guide_margin, guide_relative, in_batch=in_batch,
                                        label_offset=label_offset))
        count = torch.zeros((), device=q.device)
        for extra in by_score:
            for d, m in extra.items():
                new = m if masks[d] is None else m & ~masks[d]
                count = count + new.sum()
                masks[d] = m if masks[d] is None else masks[d] | m
        return masks, count


def biencoder_loss(out, *, n_passages, temperature=0.05, in_batch=True, gather=None, gather_with_grad=None,
                   label_offset=0, contrastive=contrastive_loss, scores=contrastive_scores, mask_duplicates=True,
                   distill_weight=0.0, teacher_temperature=1.0, teacher=None, p_keys=None, regularizer=None,
                   distill=distill_kl, directions=("q2p",), joint=True, false_negative_margin=None, guide=None,
                   guide_scores=None, guide_margin=0.0, guide_relative=False, teacher_embeddings=None,
                   embedding_weight=1.0, embedding_metric="mse", q_keys=None):
    """The bi-encoder's step loss: `contrastive` (InfoNCE, or matryoshka(contrastive_loss, ...)) over the
    head's `scores` of this rank's queries against its passages - every rank's when the caller passes
    the gathers (`gather_with_grad`, keeping the graph, and `gather`, without: dist's; then pass
    `label_offset` = rank * B * n_passages) - each query's own positive left out of its negatives
    wherever its text appears again (`mask_duplicates`, from the batch's `p_keys`); plus
    distill_weight x `distill` over each query's own group (in-batch negatives have no teacher score):
    KL(teacher || model), the teacher at `teacher_temperature`, the model at `temperature`, or
    distill_margin_mse; plus the head's `regularizer` (sparse: FLOPS) of every rank's queries and
    passages. `directions` and `joint`: the
    terms of contrastive_loss (the queries and positives of every rank when gathered); the false
    negatives by score left out of every term (false_negative_masks: `false_negative_margin`, the
    model's own scores; `guide`, a frozen guide's embeddings of the batch); plus embedding_weight x
    embedding_distill toward a frozen teacher's embeddings of the batch (`teacher_embeddings`; `q_keys`, the
    queries' text keys, served its lookup in a teacher file: loop.with_guide).
    Returns (loss, each query's top-1 accuracy (ties count against the positive),
    {"duplicates_masked": candidates left out, "false_negatives_masked" when a rule is on, and the
    regularizer's counts})."""
    q, p = out["q"], out["p"]
    gathered = gather_with_grad is not None
    p_all = gather_with_grad(p) if gathered else p  # (W*B*n, H); grads flow back to each rank
    q_all = gather_with_grad(q) if gathered and len(directions) > 1 else None  # (W*B, H) for p2q, q2q
    mask = None
    if mask_duplicates and p_keys is not None:
        mask = duplicate_mask(p_keys, n_passages, in_batch, label_offset,
                              gather(p_keys) if gathered and in_batch else None)
    masked, counts = mask, {}
    if len(directions) > 1 or false_negative_margin is not None or guide is not None:
        masked, counts["false_negatives_masked"] = false_negative_masks(
            q, p_all, n_passages, directions, scores, in_batch, label_offset, q_all, mask, false_negative_margin,
            guide, guide_scores, guide_margin, guide_relative, gather if gathered else None)
        if false_negative_margin is None and guide is None:
            del counts["false_negatives_masked"]
    extra_terms = {"directions": directions, "joint": joint, "q_all": q_all} if len(directions) > 1 else {}
    loss = contrastive(q, p_all, n_passages, temperature, in_batch, label_offset, masked, scores=scores,
                       **extra_terms)
    if teacher is not None and distill_weight > 0:
        own = scores(q, p, n_passages, in_batch=False)  # (B, n)
        loss = loss + distill_weight * distill(own, teacher, temperature, teacher_temperature)
    if teacher_embeddings is not None and embedding_weight > 0:  # each rank's own texts: DDP's mean is the global one
        loss = loss + embedding_weight * embedding_distill(q, p, teacher_embeddings, embedding_metric)
    extra = {}
    if regularizer is not None:
        reg, extra = regularizer(q_all if q_all is not None else gather_with_grad(q) if gathered else q, p_all)
        loss = loss + reg
    with torch.no_grad():
        logits = scores(q, p_all, n_passages, in_batch)
        q2p = masked["q2p"] if isinstance(masked, dict) else masked
        if q2p is not None:
            logits = logits.masked_fill(q2p, float("-inf"))
        target = label_offset + torch.arange(len(q), device=logits.device) * n_passages if in_batch else 0
        dups = mask.sum() if mask is not None else torch.zeros((), device=logits.device)
        return loss, top1(logits, target), {"duplicates_masked": dups, **counts, **extra}


def reranker_loss(out, *, n_passages, loss=listwise_loss, distill_weight=0.0, teacher_temperature=1.0, teacher=None,
                  distill=distill_kl):
    """The reranker's step loss: `loss` (listwise_loss or pointwise_bce_loss) over query-major
    groups of n_passages pairs, positive first, plus distill_weight x `distill` of each group: the
    listwise KL(teacher || logits), the teacher at `teacher_temperature`, or distill_margin_mse.
    Returns (loss, each query's top-1 accuracy (ties count against the positive))."""
    logits = out["pairs"]  # (B * n,)
    value = loss(logits, n_passages)
    if teacher is not None and distill_weight > 0:
        value = value + distill_weight * distill(logits.view(-1, n_passages), teacher, 1.0, teacher_temperature)
    return value, top1(logits.detach().view(-1, n_passages), 0)
