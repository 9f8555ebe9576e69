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
from .formats import DataError, detect_format, json_type, jsonl_objects, raise_problems, read_corpus, unread_fields
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


MIX_KEYS = ("file", "weight", "name")  # a --train-mix line's keys besides the script's prompt keys


def read_mix(path, prompt_keys):
    """--train-mix: a JSONL file, one training file per line: {"file": path (relative to the mix
    file's folder), "weight": its share (optional: all or none), "name": what its counts are logged
    as (optional; default the file's name), and the script's `prompt_keys` (optional)}.
    -> [dict]; every bad line reported as `file:line: problem` at once (DataError)."""
    import os

    problems, entries = [], []
    known = MIX_KEYS + tuple(prompt_keys)
    for lineno, obj in jsonl_objects(path, problems):
        where = f"{path}:{lineno}"
        unknown = sorted(set(obj) - set(known))
        if unknown:
            problems.append(f"{where}: unknown key {unknown[0]!r} (a line may hold: {', '.join(known)})")
        file, weight = obj.get("file"), obj.get("weight")
        if not isinstance(file, str) or not file:
            problems.append(f"{where}: \"file\" must be the path of a training file, got "
                            f"{'nothing' if file is None else json_type(file)}")
            continue
        full = os.path.join(os.path.dirname(path), os.path.expanduser(file))
        if not os.path.isfile(full):
            problems.append(f"{where}: no such file: {full}")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                   or not 0 < weight < float("inf")):
            problems.append(f"{where}: \"weight\" must be a positive number, got {weight!r}")
        for k in ("name", *prompt_keys):
            if k in obj and not isinstance(obj[k], str):
                problems.append(f"{where}: {k!r} must be a string, got {json_type(obj[k])}")
        entries.append({**obj, "file": full, "where": where})
    if not entries and not problems:
        problems.append(f"{path}: no training files listed (one JSON object per line, e.g. "
                        '{"file": "a.jsonl", "weight": 2})')
    given = [e for e in entries if e.get("weight") is not None]
    if given and len(given) < len(entries):
        first = next(e for e in entries if e.get("weight") is None)
        problems.append(f"{first['where']}: no \"weight\", while {given[0]['where']} has one: give every line "
                        "a weight, or none (each file's share is then its size)")
    raise_problems(path, problems)
    return entries


def _file_names(paths, names):
    """What each training file's counts are logged as: its given name, else its file name without
    .jsonl / .gz (numbered where two are alike)."""
    import os

    out = []
    for path, name in zip(paths, names):
        base = name or os.path.basename(path)
        for ext in (".gz", ".jsonl", ".json"):
            base = base[:-len(ext)] if not name and base.endswith(ext) else base
        out.append(base)
    return [n if out.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(out)]


def training_files(args, prompt_keys=()):
    """The run's training files from --train-file (repeatable) and --train-weights, or --train-mix
    (then args.train_file is set to []): [{"file", "weight", "name", prompt keys...}], checked (one
    sentence naming the flag, or each bad line of the mix file)."""
    weights = getattr(args, "train_weights", None)
    if getattr(args, "train_mix", None):
        if weights:
            raise SystemExit("--train-weights: not with --train-mix (each of its lines carries its weight)")
        entries = read_mix(args.train_mix, prompt_keys)
        args.train_file = []  # not the flag's default: the run header says what was read (train_mixture)
    else:
        paths = [args.train_file] if isinstance(args.train_file, str) else list(args.train_file)
        if weights and len(weights) != len(paths):
            raise SystemExit(f"--train-weights: {len(weights)} weight(s) for {len(paths)} --train-file(s): give one "
                             "per file, in the same order")
        entries = [{"file": p, "weight": w} for p, w in zip(paths, weights or [None] * len(paths))]
    names = _file_names([e["file"] for e in entries], [e.get("name") for e in entries])
    return [{**e, "name": n} for e, n in zip(entries, names)]


def read_train_val(args, world_size, prompt_keys=()):
    """Read and validate the training files (training_files) and the validation file (and --corpus)
    named by the data flags (add_data_args), before any model is loaded: ([TrainFile],
    val_records); what was read and any warnings printed on rank 0. A file with fewer records than
    one global batch is an error. Sets args.train_mixture, what the files are (name, path, records,
    weight, batches per round, prompts), so a resume on other data is refused as a changed arg."""
    from .dist import print0

    entries = training_files(args, prompt_keys)
    corpus = read_corpus(args.corpus) if args.corpus else None
    if corpus is not None:
        print0(f"corpus: {args.corpus}: {len(corpus):,} documents")
    files, warnings = [], []
    for e in entries:
        records, file_warnings = read_records(e["file"], args.n_passages, corpus, args.fill_negatives)
        print0(f"train: {records.summary}")
        warnings += file_warnings
        files.append(TrainFile(records, e.get("weight"), e["name"], {k: e[k] for k in prompt_keys if k in e}, e["file"]))
    val_records = []
    if args.val_file:
        val_records, val_warnings = read_records(args.val_file, args.val_n_passages, corpus, args.fill_negatives)
        print0(f"val: {val_records.summary}")
        warnings += val_warnings
        val_records = val_records[:args.val_max_groups or len(val_records)]
    for f in files:
        if getattr(args, "distill_weight", 0) > 0 and f.records.pos_scores is None:
            raise SystemExit(f"--distill-weight {args.distill_weight}: {f.path} has no teacher scores "
                             "(pos_scores / neg_scores); write them with python -m retrieval_kit.score")
        if steps_per_epoch(len(f.records), args.batch_size, world_size) == 0:
            raise SystemExit(f"{f.path}: {len(f.records)} records are fewer than one global batch "
                             f"({args.batch_size} x {world_size} ranks)")
    quotas = mixture_quotas([steps_per_epoch(len(f.records), args.batch_size, world_size) for f in files],
                            [f.weight for f in files])
    args.train_mixture = [{"name": f.name, "file": f.path, "records": len(f.records), "weight": f.weight,
                           "batches_per_round": q, **f.prompts} for f, q in zip(files, quotas)]
    if len(files) > 1:
        print0("train mixture, micro-batches per round: " + ", ".join(
            f"{f.name} {q} ({q / sum(quotas):.1%})" for f, q in zip(files, quotas)))
    for w in warnings:
        print0(f"warning: {w}")
    return files, val_records


CHUNK_TOKENS = 1024  # measured faster on the default model and data (README, Benchmark)


def add_data_args(parser, data_dir, n_passages, batch_size, unit="passages", prompt_keys=()):
    """The data flags both scripts share (each adds its own tokenization flags to the group);
    `prompt_keys`: the flags a --train-mix line may set for its file (e.g. query_prefix)."""
    import os

    g = parser.add_argument_group("data")
    which = g.add_mutually_exclusive_group()
    which.add_argument("--train-file", action=flags.Repeatable, default=[os.path.join(data_dir, "train.jsonl")],
                       help="training JSONL, plain or .gz: NeMo inline, FlagEmbedding, sentence-transformers columns or "
                            "Tevatron, told from its first record. Repeat it to train on several files: each "
                            "micro-batch is drawn from one of them (default: the bundled data/train.jsonl)")
    which.add_argument("--train-mix", default=None,
                       help="a JSONL file listing the training files, one per line: {\"file\": path (relative to it), "
                            "\"weight\": share of the micro-batches, \"name\": logged as, and per-file prompts" +
                            (f" ({', '.join(chr(34) + k + chr(34) for k in prompt_keys)})" if prompt_keys else "") +
                            "}; instead of --train-file")
    g.add_argument("--train-weights", type=flags.listed(flags.positive_float), default=None,
                   help="one weight per --train-file: each file's share of the micro-batches (default: in proportion "
                        "to its size, every file once a round)")
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
