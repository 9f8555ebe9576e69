"""Records -> groups -> batches: sample each query's group, order the epochs, draw several files
by a seeded mixture, build a step's micro-batches indexed by the data position (StepBatches), and
shard evaluation batches over ranks. Reading and validating the files is records.py's.

Every draw is a pure function of the seed and the data position, so any rank count, any DataLoader
worker and any resume point sees the same groups.
"""

import random
from dataclasses import dataclass, field

import numpy as np
import torch


def group_rng(seed, epoch, index):
    """A per-record RNG: the group sampled for record `index` in `epoch` depends on nothing else,
    so any rank count and any resume point sees the same groups."""
    return random.Random(f"{seed}-{epoch}-{index}")


def sample_indices(record, n_passages, rng):
    """The draws of one group: (positive index, negative indices into record.neg, filled passage ids).
    The RNG calls are those of drawing from the lists themselves (choice, then sample, or choices
    with replacement when the pool is too small), so every data layout draws the same groups."""
    p = rng.choice(range(len(record.pos)))
    need, n_neg = n_passages - 1, len(record.neg)
    if need == 0:
        return p, [], []
    if n_neg >= need:
        return p, rng.sample(range(n_neg), need), []
    pool = getattr(record, "fill_pool", 0)
    if not pool:
        return p, rng.choices(range(n_neg), k=need), []  # pool too small: with replacement (warned at load)
    own = set(record.pos_ids) | set(record.neg_ids)  # --fill-negatives random: never the record's own
    negs, extra = rng.sample(range(n_neg), n_neg), []
    while len(extra) < need - n_neg:
        j = rng.randrange(pool)
        if j not in own:
            own.add(j)
            extra.append(j)
    return p, negs, extra


def sample_group(record, n_passages, rng):
    """Return [positive, negative_1, ..., negative_{n_passages-1}] for one record."""
    return sample_group_scored(record, n_passages, rng)[0]


def sample_group_scored(record, n_passages, rng):
    """(texts, scores): the group and the teacher score of each passage (NaN for one without, e.g. a
    filled negative), or None when the records have no scores."""
    p, negs, extra = sample_indices(record, n_passages, rng)
    texts = [record.pos[p]] + [record.neg[j] for j in negs] + [record.passage(j) for j in extra]
    pos_scores, neg_scores = getattr(record, "pos_scores", None), getattr(record, "neg_scores", None)
    if pos_scores is None:
        return texts, None
    return texts, [pos_scores[p]] + [neg_scores[j] for j in negs] + [float("nan")] * len(extra)


def fixed_group(record, n_passages):
    """Deterministic group for validation: first positive, first negatives (cycled if too few; with
    --fill-negatives random, a record short of them gets a fixed draw of its own)."""
    if len(record.neg) < n_passages - 1 and getattr(record, "fill_pool", 0):
        return sample_group(record, n_passages, random.Random(f"fixed-{record.where}"))
    negs = [record.neg[i % len(record.neg)] for i in range(n_passages - 1)] if record.neg else []
    return [record.pos[0]] + negs


def epoch_order(n_records, seed, epoch):
    """Permutation of record indices for one epoch (same on every rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_records, generator=g).tolist()


def steps_per_epoch(n_records, batch_size, world_size):
    """Full global batches per epoch (the ragged tail is dropped so every rank has equal work)."""
    return n_records // (batch_size * world_size)


def rank_batch(order, step_in_epoch, batch_size, rank, world_size):
    """Indices of this rank's share of global batch `step_in_epoch` of an epoch's `order`."""
    start = (step_in_epoch * world_size + rank) * batch_size
    return order[start:start + batch_size]


@dataclass
class TrainFile:
    """One training file of a run: its records, its share of the micro-batches (`weight`; None for
    all files: each file's number of full batches, one pass over every file a round), the name its
    counts are logged under, and the prompts its batches are tokenized with (kept for the run header
    and resume; a script turns them into that file's collate)."""
    records: object
    weight: float = None
    name: str = "train"
    prompts: dict = field(default_factory=dict)
    path: str = ""


def mixture_quotas(batches, weights):
    """Micro-batches of each file in one round of a mixture. Without weights, each file's number of
    full global batches (`batches`): a round is one pass over every file. With weights, the round's
    sum(batches) micro-batches shared in proportion (largest remainders), at least 1 each."""
    if all(w is None for w in weights):
        return list(batches)
    total, w = sum(batches), np.asarray(weights, dtype=np.float64)
    raw = w / w.sum() * total
    quotas = np.floor(raw).astype(np.int64)
    quotas[np.argsort(quotas - raw, kind="stable")[:total - int(quotas.sum())]] += 1
    return [max(1, int(q)) for q in quotas]


class Mixture:
    """Which training file micro-batch `i` comes from, and which of that file's batches it is: a
    pure function of the seed and `i`, so every rank draws from the same file at the same step, any
    DataLoader worker builds any batch, and a resumed run goes on where it stopped.

    A round is quotas[f] micro-batches of each file f in an order shuffled from (seed, round); the
    k-th time file f comes up it gives that file's k-th batch (its epochs follow on, a permutation
    each). Over a round the shares are exact."""

    def __init__(self, quotas, seed):
        self.quotas, self.seed = [int(q) for q in quotas], seed
        self.round_len = sum(self.quotas)
        self._round, self._files, self._nth = -1, None, None

    def _load(self, r):
        if r == self._round:
            return
        files = [f for f, q in enumerate(self.quotas) for _ in range(q)]
        if len(self.quotas) > 1:
            random.Random(f"mix-{self.seed}-{r}").shuffle(files)
        files = np.asarray(files, dtype=np.int32)
        nth = np.empty(len(files), dtype=np.int64)
        for f in range(len(self.quotas)):  # the how-many-th batch of its file each position is
            at = np.nonzero(files == f)[0]
            nth[at] = np.arange(len(at))
        self._round, self._files, self._nth = r, files, nth

    def locate(self, i):
        """(file index, that file's batch number) of micro-batch i."""
        r, pos = divmod(i, self.round_len)
        self._load(r)
        f = int(self._files[pos])
        return f, r * self.quotas[f] + int(self._nth[pos])

    def drawn(self, i):
        """How many of micro-batches 0..i-1 each file gave."""
        r, pos = divmod(i, self.round_len)
        counts = np.asarray(self.quotas, dtype=np.int64) * r
        if pos:
            self._load(r)
            counts += np.bincount(self._files[:pos], minlength=len(self.quotas))
        return counts.tolist()


def file_seed(seed, f):
    """The data seed of a run's f-th training file (the run's own for the first: one file draws
    what it always drew)."""
    return seed + 100_003 * f


class StepBatches(torch.utils.data.Dataset):
    """Micro-batch `i` of a run on this rank (i = step * grad_accum_steps + micro), sampled and
    collated: a map-style dataset indexed by the data position, so the batch depends on nothing but
    `i` - any DataLoader worker builds it, and a resumed run builds the same one.

    records: one file's records, or a list of TrainFiles: then each micro-batch (on every rank) is
    drawn from one file, chosen by a Mixture of their weights.
    collate(queries, groups) -> the model's inputs (collate.biencoder_inputs / rerank_inputs); with
    several files, one collate or a list of one per file (its prompts).
    `scores`: the batch also holds "teacher", the (B, n_passages) teacher scores of the groups (NaN
    for a passage without one), for the loss (the model never sees it). The same groups either way.
    """

    def __init__(self, records, n_passages, batch_size, rank, world_size, seed, collate, scores=False):
        files = records if isinstance(records, list) and records and isinstance(records[0], TrainFile) \
            else [TrainFile(records)]
        self.files, self.n, self.batch_size, self.rank, self.world = files, n_passages, batch_size, rank, world_size
        self.seed, self.scores = seed, scores
        self.collates = collate if isinstance(collate, (list, tuple)) else [collate] * len(files)
        self.batches = [steps_per_epoch(len(f.records), batch_size, world_size) for f in files]
        self.mixture = Mixture(mixture_quotas(self.batches, [f.weight for f in files]), seed)
        self.steps_per_epoch = self.mixture.round_len  # micro-batches per round (one file: per epoch)
        self._orders = {}  # file -> (epoch, permutation), kept by each worker

    def __getitem__(self, i):
        f, k = self.mixture.locate(i)
        records, seed = self.files[f].records, file_seed(self.seed, f)
        epoch, pos = divmod(k, self.batches[f])
        if self._orders.get(f, (None,))[0] != epoch:  # one permutation per epoch of each file
            self._orders[f] = (epoch, epoch_order(len(records), seed, epoch))
        idx = rank_batch(self._orders[f][1], pos, self.batch_size, self.rank, self.world)
        if not self.scores:
            groups = [sample_group(records[j], self.n, group_rng(seed, epoch, j)) for j in idx]
            return self.collates[f]([records[j].query for j in idx], groups)
        drawn = [sample_group_scored(records[j], self.n, group_rng(seed, epoch, j)) for j in idx]
        batch = self.collates[f]([records[j].query for j in idx], [g for g, _ in drawn])
        return {**batch, "teacher": torch.tensor([s for _, s in drawn], dtype=torch.float32)}

    def drawn(self, i):
        """{"drawn/<file name>": how many of micro-batches 0..i-1 came from it} with several files,
        else {} (the per-file counts a run logs)."""
        if len(self.files) == 1:
            return {}
        return {f"drawn/{f.name}": n for f, n in zip(self.files, self.mixture.drawn(i))}


def describe_files(files):
    """'2975 train groups', or '5950 train groups in 2 files' (a run's summary line)."""
    n = sum(len(f.records) for f in files)
    return f"{n} train groups" + (f" in {len(files)} files" if len(files) > 1 else "")


def shard(items, rank, world_size):
    """Contiguous, near-equal shard of a list for evaluation (every item lands on exactly one rank)."""
    per = -(-len(items) // world_size)
    return items[rank * per:(rank + 1) * per]


def eval_batches(records, batch_size, rank, world_size):
    """This rank's evaluation batches as (records, counted), the same number on every rank.

    Sharded models run collectives in every forward, so a rank whose shard is exhausted runs a
    dummy batch (its results not counted) until every rank is done.
    """
    mine = shard(records, rank, world_size)
    per = -(-len(records) // world_size)
    for b in range(-(-per // batch_size)):
        recs = mine[b * batch_size:(b + 1) * batch_size]
        yield (recs, True) if recs else (records[:1], False)
