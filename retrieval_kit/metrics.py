"""Ranking metrics within groups and a windowed loss average.

Group scores are (Q, n) with the positive in column 0. Ties are counted against the positive
(rank = 1 + number of other passages scoring >= the positive), so a model that scores
everything equally gets no credit.
"""

import math
from collections import deque

import torch


def positive_ranks(scores):
    """1-based rank of column 0 within each row of (Q, n) scores; ties count against it."""
    pos = scores[:, :1]
    return 1 + (scores[:, 1:] >= pos).sum(dim=1)


def top1(scores, target):
    """Per-row 1.0 where column `target` (an int or a (Q,) tensor) is strictly above every other
    column, else 0.0; on the device, no host read (the training accuracy)."""
    target = torch.as_tensor(target, device=scores.device).expand(scores.shape[0])
    own = scores.gather(1, target.view(-1, 1))
    return ((scores >= own).sum(dim=1) == 1).float()


def group_metric_sums(scores):
    """Sums (not means) so they can be added across batches and ranks: (acc@1 sum, RR sum, count)."""
    ranks = positive_ranks(scores).float()
    return (ranks == 1).sum().item(), (1.0 / ranks).sum().item(), float(scores.shape[0])


class WindowedAverage:
    """Mean of the last `window` values (the smoothed loss shown next to the raw one)."""

    def __init__(self, window=50):
        self.values = deque(maxlen=window)

    def update(self, value):
        self.values.append(float(value))
        return self.value

    @property
    def value(self):
        return sum(self.values) / len(self.values) if self.values else float("nan")

    def state_dict(self):
        return {"window": self.values.maxlen, "values": list(self.values)}

    def load_state_dict(self, state):
        self.values = deque(state["values"], maxlen=state["window"])


# ----- full-corpus retrieval metrics (trec_eval definitions) ------------------------------------

def rank_docs(scores):
    """Doc ids best first; ties broken by doc id, descending, as trec_eval does."""
    return [d for d, _ in sorted(scores.items(), key=lambda x: (x[1], x[0]), reverse=True)]


def query_metrics(ranked, rels, k_ndcg=10, k_mrr=10, recall_ks=(10, 100), k_map=100):
    """Metrics of one query: `ranked` doc ids best first, `rels` {doc id: graded relevance}.

    trec_eval definitions: nDCG@k with linear gain (rel / log2(rank + 1)) against the ideal
    ordering of all judged-relevant docs; MRR@k = 1 / rank of the first relevant doc in the top k;
    Recall@k = relevant docs in the top k / all relevant docs; MAP@k = sum of precision at each
    relevant doc in the top k / all relevant docs. A doc is relevant when rel > 0; relevant docs
    missing from the corpus still count in the denominators.
    """
    n_rel = sum(1 for r in rels.values() if r > 0)
    out = {}
    dcg = sum(rels.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranked[:k_ndcg]) if rels.get(d, 0) > 0)
    ideal = sorted((r for r in rels.values() if r > 0), reverse=True)[:k_ndcg]
    idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
    out[f"ndcg@{k_ndcg}"] = dcg / idcg if idcg > 0 else 0.0
    first = next((i for i, d in enumerate(ranked[:k_mrr]) if rels.get(d, 0) > 0), None)
    out[f"mrr@{k_mrr}"] = 0.0 if first is None else 1.0 / (first + 1)
    for k in recall_ks:
        hits = sum(1 for d in ranked[:k] if rels.get(d, 0) > 0)
        out[f"recall@{k}"] = hits / n_rel if n_rel else 0.0
    ap, hits = 0.0, 0
    for i, d in enumerate(ranked[:k_map]):
        if rels.get(d, 0) > 0:
            hits += 1
            ap += hits / (i + 1)
    out[f"map@{k_map}"] = ap / n_rel if n_rel else 0.0
    return out


def retrieval_metrics(run, qrels, per_query=None, **kw):
    """Mean over the queries that have qrels of `query_metrics`; `run` is {qid: {doc id: score}}.
    A judged query missing from the run scores 0 (it retrieved nothing). `per_query` (a dict): filled
    with each query's metrics, for the standard errors and paired tests below."""
    each = {qid: query_metrics(rank_docs(run.get(qid, {})), rels, **kw) for qid, rels in qrels.items()}
    if not each:
        raise ValueError("no query has qrels")
    if per_query is not None:
        per_query.update(each)
    keys = next(iter(each.values())).keys()
    return {k: sum(m[k] for m in each.values()) / len(each) for k in keys}


# ----- how far a dev number can be trusted ---------------------------------------------------------

BOOTSTRAP_SAMPLES = 2000
TEST_SAMPLES = 10000
EXACT_UP_TO = 16  # queries: the randomization test enumerates all 2**m sign patterns up to this many


def bootstrap_se(values, samples=BOOTSTRAP_SAMPLES, seed=0):
    """The standard error of the mean of `values` (one number per query) by the bootstrap over queries
    (Efron & Tibshirani 1993): the standard deviation of the means of `samples` resamples with
    replacement, from a generator seeded by `seed` (the same values give the same error)."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(samples, x.size))].mean(axis=1)
    return float(means.std(ddof=1))


def paired_p(better, worse, samples=TEST_SAMPLES, seed=0):
    """One-sided paired randomization test (Fisher's; for IR evaluation, Smucker, Allan & Carterette,
    CIKM 2007) over the same queries: the probability, were the two systems exchangeable on every query,
    of a mean difference `better - worse` at least the one observed. Each query's difference keeps or
    flips its sign: all 2**m patterns up to EXACT_UP_TO queries (exact), else `samples` seeded draws
    counted with the observed one ((1 + hits) / (1 + samples)). Small: `better` wins beyond noise."""
    import itertools

    import numpy as np

    d = np.asarray(better, dtype=np.float64) - np.asarray(worse, dtype=np.float64)
    if d.size == 0:
        return 1.0
    observed = d.mean() - 1e-12 * max(1.0, abs(d.mean()))  # (a flip equal to the observed counts, as >=)
    if d.size <= EXACT_UP_TO:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))
        return float(((signs * d).mean(axis=1) >= observed).mean())
    rng = np.random.default_rng(seed)
    signs = rng.integers(0, 2, size=(samples, d.size)) * 2.0 - 1.0
    return float((1 + ((signs * d).mean(axis=1) >= observed).sum()) / (1 + samples))


def deficit_bound(better, worse, level=0.05, samples=BOOTSTRAP_SAMPLES, seed=0):
    """How much worse `worse` may be than `better`, at most, over the same queries: the (1 - level) quantile of
    the mean difference `better - worse` over `samples` paired bootstrap resamples of the queries (seeded).
    Below a margin, the two are equivalent within it: the one-sided half of two one-sided tests (Schuirmann,
    J. Pharmacokinet. Biopharm. 1987), the other half being that `worse` is not significantly worse."""
    import numpy as np

    d = np.asarray(better, dtype=np.float64) - np.asarray(worse, dtype=np.float64)
    if d.size == 0:
        return 0.0
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(samples, d.size))].mean(axis=1)
    return float(np.quantile(means, 1.0 - level))
