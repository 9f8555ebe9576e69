"""Exact nearest-neighbour search in blocks (by inner product, or a head's score), and the per-shard top k
merged over ranks."""

import torch


def exact_topk(q_emb, p_emb, k, query_chunk=256, corpus_chunk=8192, score=None):
    """Exact top-k by inner product (or `score(q block, p block)` -> (q, c) scores), never building the
    full (Q, P) score matrix.

    Scores are computed for query_chunk x corpus_chunk blocks and merged into a running top-k.
    Returns (scores (Q, k'), indices (Q, k')) with k' = min(k, P), best first.
    """
    k = min(k, p_emb.shape[0])
    all_scores, all_idx = [], []
    for qs in range(0, q_emb.shape[0], query_chunk):
        q = q_emb[qs:qs + query_chunk]
        best_s = torch.full((q.shape[0], 0), float("-inf"), device=q.device)
        best_i = torch.zeros((q.shape[0], 0), dtype=torch.long, device=q.device)
        for ps in range(0, p_emb.shape[0], corpus_chunk):
            s = q @ p_emb[ps:ps + corpus_chunk].T if score is None else score(q, p_emb[ps:ps + corpus_chunk])  # (q, c)
            cand_s = torch.cat([best_s, s], dim=1)
            cand_i = torch.cat([best_i, torch.arange(ps, ps + s.shape[1], device=q.device).expand(q.shape[0], -1)],
                               dim=1)
            top = cand_s.topk(min(k, cand_s.shape[1]), dim=1)
            best_s, best_i = top.values, cand_i.gather(1, top.indices)
        all_scores.append(best_s)
        all_idx.append(best_i)
    return torch.cat(all_scores), torch.cat(all_idx)


def sharded_topk(q_emb, p_shard, offset, k, n_total, device="cpu", search=exact_topk):
    """Exact top-k by inner product over a corpus split over the ranks: each rank searches its own
    shard (`p_shard`: rows offset..offset+len of the corpus, or, with `offset` a LongTensor, the rows
    it lists) on `device`, then the (Q, k) candidates
    of every rank are all-gathered and merged. No rank holds more than its shard of the corpus;
    the result is `search`'s (exact_topk; a head's search: MaxSim for token vectors, an inverted index for
    sparse ones) over the whole corpus (up to the order of tied scores). Returns
    (scores, indices into the whole corpus), (Q, min(k, n_total)), best first, on the CPU."""
    import torch.distributed as tdist

    q = q_emb.to(device)
    if p_shard.shape[0]:
        s, i = search(q, p_shard.to(device), k)
    else:
        s = torch.empty((q.shape[0], 0), device=device)
        i = torch.empty((q.shape[0], 0), dtype=torch.long, device=device)
    i = i + offset if isinstance(offset, int) else offset.to(i.device)[i]
    from .dist import world_size

    world = world_size()
    if world == 1:
        return s.cpu(), i.cpu()
    pad = k - s.shape[1]  # a shard smaller than k: -inf candidates that never win
    s = torch.cat([s, torch.full((q.shape[0], pad), float("-inf"), device=device)], dim=1)
    i = torch.cat([i, torch.full((q.shape[0], pad), -1, dtype=torch.long, device=device)], dim=1)
    all_s, all_i = [torch.empty_like(s) for _ in range(world)], [torch.empty_like(i) for _ in range(world)]
    tdist.all_gather(all_s, s)
    tdist.all_gather(all_i, i)
    cand_s, cand_i = torch.cat(all_s, dim=1), torch.cat(all_i, dim=1)
    top = cand_s.topk(min(k, n_total), dim=1)
    return top.values.cpu(), cand_i.gather(1, top.indices).cpu()
