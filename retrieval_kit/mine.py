"""Hard-negative mining from embeddings, with a false-negative filter.

For each query, candidates are ranked by score; the query's positives are removed, then
  - the first `skip_top` remaining candidates are skipped (they are often unlabelled positives),
  - candidates scoring above `max_score_ratio` x the best positive's score are dropped
    (likely false negatives; None turns this off), and so are exact text duplicates of a positive,
and up to `k` of the rest are kept, best first.
"""

import torch


def mine_hard_negatives(q_emb, p_emb, positives, k, skip_top=0, max_score_ratio=0.95,
                        p_texts=None, depth=None, chunk_size=1024):
    """Return a list (one per query) of up to k passage indices into p_emb.

    q_emb (Q, H), p_emb (P, H); positives[i] is a collection of passage indices for query i.
    Scores are computed in query chunks so the full (Q, P) matrix is never built.
    """
    depth = min(p_emb.shape[0], depth or (k + skip_top + 50))
    out = []
    for s in range(0, q_emb.shape[0], chunk_size):
        scores = q_emb[s:s + chunk_size] @ p_emb.T  # (C, P)
        top_scores, top_idx = scores.topk(depth, dim=1)
        for row in range(scores.shape[0]):
            i = s + row
            pos = set(positives[i])
            pos_texts = {p_texts[j] for j in pos} if p_texts is not None else set()
            limit = float("inf") if max_score_ratio is None else max_score_ratio * max(scores[row, j].item() for j in pos)
            negs, seen = [], 0
            for score, j in zip(top_scores[row].tolist(), top_idx[row].tolist()):
                if j in pos:
                    continue
                seen += 1
                if seen <= skip_top or score > limit:
                    continue
                if p_texts is not None and p_texts[j] in pos_texts:
                    continue
                negs.append(j)
                if len(negs) == k:
                    break
            out.append(negs)
    return out
