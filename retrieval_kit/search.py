"""Exact nearest-neighbour search by inner product over embedding matrices."""

import torch


def exact_topk(q_emb, p_emb, k, query_chunk=256, corpus_chunk=8192):
    """Exact top-k by inner product, never building the full (Q, P) score matrix.

    Scores are computed for query_chunk x corpus_chunk blocks and merged into a running top-k.
    Returns (scores (Q, k'), indices (Q, k')) with k' = min(k, P), best first.
    """
    k = min(k, p_emb.shape[0])
    all_scores, all_idx = [], []
    for qs in range(0, q_emb.shape[0], query_chunk):
        q = q_emb[qs:qs + query_chunk]
        best_s = torch.full((q.shape[0], 0), float("-inf"))
        best_i = torch.zeros((q.shape[0], 0), dtype=torch.long)
        for ps in range(0, p_emb.shape[0], corpus_chunk):
            s = q @ p_emb[ps:ps + corpus_chunk].T  # (q, c)
            cand_s = torch.cat([best_s, s], dim=1)
            cand_i = torch.cat([best_i, torch.arange(ps, ps + s.shape[1]).expand(q.shape[0], -1)], dim=1)
            top = cand_s.topk(min(k, cand_s.shape[1]), dim=1)
            best_s, best_i = top.values, cand_i.gather(1, top.indices)
        all_scores.append(best_s)
        all_idx.append(best_i)
    return torch.cat(all_scores), torch.cat(all_idx)
