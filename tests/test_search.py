"""retrieval_kit/search.py: blockwise exact top-k equals the full score matrix."""

import torch

from retrieval_kit.search import exact_topk


def test_chunked_search_equals_the_full_matrix():
    torch.manual_seed(0)
    q, p = torch.randn(7, 16), torch.randn(1000, 16)
    full = (q @ p.T).topk(50, dim=1)
    for qc, pc in ((3, 64), (7, 1000), (1, 333)):
        s, i = exact_topk(q, p, 50, query_chunk=qc, corpus_chunk=pc)
        assert torch.equal(i, full.indices) and torch.allclose(s, full.values)
    s, i = exact_topk(q, p[:20], 50)  # k larger than the corpus
    assert s.shape == (7, 20)
