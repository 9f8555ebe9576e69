"""Read and validate training data; sample groups; shard batches over ranks.

A record is one JSON object per line, in any of the field's formats (formats.py):
    {"query": "...", "pos_doc": ["..."], "neg_doc": ["...", "..."]}          NeMo inline
    {"query": "...", "pos": [...], "neg": [...], "pos_scores": [...], ...}   FlagEmbedding
    {"anchor": "...", "positive": "...", "negative_1": "...", ...}          sentence-transformers
    {"query": "...", "positive_passages": [{"docid", "title", "text"}], ...}  Tevatron
Docs may be ids into a BEIR corpus (--corpus). Records are held as ids into one store of passage
texts (textstore.py), each text once.

Every bad line is reported as `file:line: problem`, all of them at once, before training starts.
"""

import random
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from . import flags
from .formats import DataError, detect_format, jsonl_objects, raise_problems, read_corpus, unread_fields
from .textstore import Records, TextStore, digest


@dataclass
class Record:
    """A record built by hand (tests, small tools): texts in lists. read_records gives RecordViews."""
    query: str
    pos: list
    neg: list = field(default_factory=list)
    where: str = ""  # "file:line", for messages


def exit_on_data_error(main):
    """Run an entry point's main(): a DataError (a user's bad or missing file) ends the run with its
    message (printed once, by rank 0 under torchrun) and exit status 1, not a traceback."""
    from .dist import is_main

    try:
        return main()
    except DataError as e:
        raise SystemExit(str(e) if is_main() else 1) from None


RESOLVE_EVERY = 4096  # records whose corpus ids are looked up together


def read_records(path, n_passages=None, corpus=None, fill=None):
    """Read and validate a training JSONL file (any format in formats.py) into textstore.Records.
    Raises DataError listing every bad line. Returns (records, warnings); `records.summary` is one
    line saying what was read (the format, counts, scores, prompts, fields not read).

    corpus: a textstore.Corpus (formats.read_corpus) that docs given by id refer to; its texts are
    the passage store. With `n_passages`, checks each record can form a group of 1 positive +
    (n_passages - 1) negatives: a record without negatives is an error unless `fill` is "random"
    (missing negatives drawn from all passages; sample_group); a record with too few samples them
    with replacement (a warning) unless `fill` fills them.
    """
    problems, warnings = [], []
    passages = corpus.texts if corpus is not None else TextStore()
    records, stored, pending = Records(path, passages), {}, []
    fmt, unread, one_word = None, Counter(), [0]  # inline texts without a space: ids without --corpus?

    def resolve():
        wanted = [doc for _, parsed in pending for doc in parsed[2] + parsed[3] if doc[0] == "id"]
        found = iter(corpus.find([d for _, d in wanted]).tolist()) if wanted else None
        for lineno, (query, prompt, pos, neg, pos_scores, neg_scores) in pending:
            ids, missing = [], []
            for kind, value in pos + neg:
                if kind == "text":
                    key = digest(value)
                    j = stored.get(key)
                    if j is None:
                        j = stored[key] = passages.add(value)
                        one_word[0] += not any(c.isspace() for c in value.strip())
                else:
                    j = next(found)
                    if j < 0:
                        missing.append(value)
                ids.append(j)
            if missing:
                problems.append(f"{path}:{lineno}: doc id {missing[0]!r} is not in {corpus.path}" +
                                (f" (nor {len(missing) - 1} more of this record's ids)" if len(missing) > 1 else ""))
                continue
            records.add(lineno, query, ids[:len(pos)], ids[len(pos):], pos_scores, neg_scores, prompt)
        pending.clear()

    for lineno, obj in jsonl_objects(path, problems):
        if fmt is None:
            fmt = detect_format(obj)
        unread.update(unread_fields(obj, fmt[2]))
        parsed = fmt[1](obj, f"{path}:{lineno}", corpus is not None, problems)
        if parsed is not None:
            pending.append((lineno, parsed))
            if len(pending) >= RESOLVE_EVERY:
                resolve()
    resolve()
    if not len(records) and not problems:
        problems.append(f"{path}: no records (the file is empty)")
    raise_problems(path, problems)
    # the pool is fixed here: a store shared with a file read later (--corpus) grows, and a
    # training record must not draw from the validation file's passages
    records.fill, records.pool = fill, len(passages)
    if n_passages is not None and n_passages > 1:
        need = n_passages - 1
        n_neg = np.diff(np.frombuffer(records.neg_ends, dtype=np.int64), prepend=0)
        n_pos = np.diff(np.frombuffer(records.pos_ends, dtype=np.int64), prepend=0)
        none, short = np.nonzero(n_neg == 0)[0], np.nonzero((n_neg > 0) & (n_neg < need))[0]
        if fill == "random" and (len(none) or len(short)):
            if len(passages) - int(n_pos.max()) < need:
                raise DataError(f"{path}: --fill-negatives random needs at least {need} passages besides a record's "
                                f"positives; there are {len(passages)} passages in all")
            warnings.append(f"{len(none) + len(short)} record(s) have " +
                            ("no negatives" if not len(short) else f"fewer than {need} negatives") + " (first: "
                            f"{records[int(min(list(none[:1]) + list(short[:1])))].where}); the rest are drawn from "
                            f"random passages (--fill-negatives random)")
        elif len(none):
            first = ", ".join(records[int(i)].where for i in none[:3])
            raise DataError(f"{path}: {len(none)} of {len(records)} record(s) have no negatives, but --n-passages "
                            f"{n_passages} needs {need} per group (first: {first}); pass --fill-negatives random to "
                            "draw them from the other passages, or lower --n-passages")
        elif len(short):
            warnings.append(f"{len(short)} record(s) have fewer than {need} negatives (first: "
                            f"{records[int(short[0])].where}); their negatives are sampled with replacement "
                            "(or pass --fill-negatives random)")
    if corpus is None and len(stored) >= 10 and one_word[0] >= 0.9 * len(stored):
        warnings.append(f"{path}: {one_word[0]} of its {len(stored)} distinct passages are one word each: if they "
                        "are ids into a corpus, pass --corpus (without it a string doc is the passage text)")
    records.summary = _summary(records, fmt[0], unread)
    return records, warnings


def _summary(records, fmt, unread):
    used = np.unique(np.concatenate([np.frombuffer(records.pos_ids, dtype=np.int32),
                                     np.frombuffer(records.neg_ids, dtype=np.int32)]))
    parts = [f"{fmt} format", f"{len(records):,} records", f"{len(used):,} distinct passages"]
    if records.pos_scores is not None:
        parts.append("teacher scores kept")
    if records.prompt_ids is not None:
        n = sum(1 for p in records.prompt_ids if p >= 0)
        parts.append(f"{n:,} prompts prepended to their queries")
    if unread:
        parts.append("fields not read: " + ", ".join(f"{k} ({n:,})" for k, n in unread.most_common(6)))
    return f"{records.path}: " + "; ".join(parts)


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


class StepBatches(torch.utils.data.Dataset):
    """Micro-batch `i` of a run on this rank (i = step * grad_accum_steps + micro), sampled and
    collated: a map-style dataset indexed by the data position, so the batch depends on nothing but
    `i` - any DataLoader worker builds it, and a resumed run builds the same one.

    collate(queries, groups) -> the model's inputs (collate.biencoder_inputs / rerank_inputs).
    `scores`: the batch also holds "teacher", the (B, n_passages) teacher scores of the groups (NaN
    for a passage without one), for the loss (the model never sees it). The same groups either way.
    """

    def __init__(self, records, n_passages, batch_size, rank, world_size, seed, collate, scores=False):
        self.records, self.n, self.batch_size, self.rank, self.world = records, n_passages, batch_size, rank, world_size
        self.seed, self.collate, self.scores = seed, collate, scores
        self.steps_per_epoch = steps_per_epoch(len(records), batch_size, world_size)
        self._epoch, self._order = -1, None

    def __getitem__(self, i):
        epoch, pos = divmod(i, self.steps_per_epoch)
        if epoch != self._epoch:  # one permutation per epoch, kept by each worker
            self._epoch, self._order = epoch, epoch_order(len(self.records), self.seed, epoch)
        idx = rank_batch(self._order, pos, self.batch_size, self.rank, self.world)
        if not self.scores:
            groups = [sample_group(self.records[j], self.n, group_rng(self.seed, epoch, j)) for j in idx]
            return self.collate([self.records[j].query for j in idx], groups)
        drawn = [sample_group_scored(self.records[j], self.n, group_rng(self.seed, epoch, j)) for j in idx]
        batch = self.collate([self.records[j].query for j in idx], [g for g, _ in drawn])
        return {**batch, "teacher": torch.tensor([s for _, s in drawn], dtype=torch.float32)}


def read_train_val(args, world_size):
    """Read and validate the training and validation files (and --corpus) named by the data flags
    (add_data_args), before any model is loaded: (records, val_records); what was read and any
    warnings printed on rank 0. Fewer records than one global batch is an error."""
    from .dist import print0

    corpus = read_corpus(args.corpus) if args.corpus else None
    if corpus is not None:
        print0(f"corpus: {args.corpus}: {len(corpus):,} documents")
    records, warnings = read_records(args.train_file, args.n_passages, corpus, args.fill_negatives)
    print0(f"train: {records.summary}")
    val_records = []
    if args.val_file:
        val_records, val_warnings = read_records(args.val_file, args.val_n_passages, corpus, args.fill_negatives)
        print0(f"val: {val_records.summary}")
        warnings += val_warnings
        val_records = val_records[:args.val_max_groups or len(val_records)]
    if getattr(args, "distill_weight", 0) > 0 and records.pos_scores is None:
        raise SystemExit(f"--distill-weight {args.distill_weight}: {args.train_file} has no teacher scores "
                         "(pos_scores / neg_scores); write them with python -m retrieval_kit.score")
    if steps_per_epoch(len(records), args.batch_size, world_size) == 0:
        raise SystemExit(f"{args.train_file}: {len(records)} records are fewer than one global batch "
                         f"({args.batch_size} x {world_size} ranks)")
    for w in warnings:
        print0(f"warning: {w}")
    return records, val_records


CHUNK_TOKENS = 1024  # measured faster on the default model and data (README, Benchmark)


def add_data_args(parser, data_dir, n_passages, batch_size, unit="passages"):
    """The data flags both scripts share (each adds its own tokenization flags to the group)."""
    import os

    g = parser.add_argument_group("data")
    g.add_argument("--train-file", default=os.path.join(data_dir, "train.jsonl"),
                   help="training JSONL, plain or .gz: NeMo inline, FlagEmbedding, sentence-transformers columns or "
                        "Tevatron, told from its first record")
    g.add_argument("--corpus", default=None,
                   help="BEIR corpus.jsonl (plain or .gz) that docs given by id refer to (NeMo strings or {\"id\"}, "
                        "Tevatron passages without text); each passage text is then stored once")
    g.add_argument("--fill-negatives", choices=["random"], default=None,
                   help="records with fewer negatives than --n-passages needs: draw the rest from random passages "
                        "(never the record's own; the same draws on resume). Default: an error for records without "
                        "any, sampling with replacement for records with too few")
    g.add_argument("--val-file", default=os.path.join(data_dir, "val.jsonl"),
                   help="held-out JSONL for validation ('' to skip)")
    g.add_argument("--val-max-groups", type=flags.nonneg_int, default=0, help="validate on the first N groups (0 = all)")
    g.add_argument("--val-n-passages", type=flags.positive_int, default=4,
                   help=f"{unit} per validation group (1 positive + N-1 negatives)")
    g.add_argument("--n-passages", type=flags.positive_int, default=n_passages,
                   help=f"{unit} per query: 1 positive + N-1 hard negatives (default {n_passages})")
    g.add_argument("--batch-size", type=flags.positive_int, default=batch_size,
                   help=f"queries per rank per micro-batch (default {batch_size})")
    g.add_argument("--pad-to-multiple-of", type=flags.nonneg_int, default=8, help="round padded lengths up to this (0 = off)")
    g.add_argument("--chunk-tokens", type=flags.nonneg_int, default=None,
                   help="run each batch in length-sorted chunks of at most this many padded tokens, each "
                        "padded only to its own longest row; same loss and grads (0 = off; default "
                        f"{CHUNK_TOKENS} on CPU, measured; 8192 on CUDA)")
    g.add_argument("--grad-cache", action="store_true",
                   help="GradCache: compute the batch's outputs without a graph, then recompute chunk by chunk "
                        "(--chunk-tokens) backpropagating the cached output grads; same loss and grads, memory "
                        "flat in batch size")
    return g


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
