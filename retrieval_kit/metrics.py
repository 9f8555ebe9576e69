"""Ranking metrics within groups and a windowed loss average.

Group scores are (Q, n) with the positive in column 0. Ties are counted against the positive
(rank = 1 + number of other passages scoring >= the positive), so a model that scores
everything equally gets no credit.
"""

from collections import deque

import torch


def positive_ranks(scores):
    """1-based rank of column 0 within each row of (Q, n) scores; ties count against it."""
    pos = scores[:, :1]
    return 1 + (scores[:, 1:] >= pos).sum(dim=1)


def accuracy_at_1(scores):
    return (positive_ranks(scores) == 1).float().mean().item()


def mrr(scores):
    return (1.0 / positive_ranks(scores).float()).mean().item()


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
