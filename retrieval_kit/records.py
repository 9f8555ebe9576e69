"""Read and validate what a run trains on: training records in any of the field's formats
(formats.py), the --train-mix file, and a run's training and validation files at once.

A record is one JSON object per line:
    {"query": "...", "pos_doc": ["..."], "neg_doc": ["...", "..."]}          NeMo inline
    {"query": "...", "pos": [...], "neg": [...], "pos_scores": [...], ...}   FlagEmbedding
    {"anchor": "...", "positive": "...", "negative_1": "...", ...}          sentence-transformers
    {"query": "...", "positive_passages": [{"docid", "title", "text"}], ...}  Tevatron
Docs may be ids into a BEIR corpus (--corpus). Records are held as ids into one store of passage
texts (textstore.py), each text once.

Every bad line is reported as `file:line: problem`, all of them at once, before training starts
(a DataError; rundir.exit_on_data_error turns it into one message and exit status 1).
"""

import os
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from .data import TrainFile, mixture_quotas, steps_per_epoch
from .formats import (DataError, detect_format, file_digest, gc_paused, json_type, jsonl_objects, raise_problems,
                      read_corpus, unread_fields)
from .textstore import Records, TextStore, digest


@dataclass
class Record:
    """A record built by hand (tests, small tools): texts in lists. read_records gives RecordViews."""
    query: str
    pos: list
    neg: list = field(default_factory=list)
    where: str = ""  # "file:line", for messages


RESOLVE_EVERY = 4096  # records whose corpus ids are looked up together


def read_records(path, n_passages=None, corpus=None, fill=None, cache=None):
    """Read and validate a training JSONL file (any format in formats.py) into textstore.Records.
    Raises DataError listing every bad line. Returns (records, warnings); `records.summary` is one
    line saying what was read (the format, counts, scores, prompts, fields not read).

    corpus: a textstore.Corpus (formats.read_corpus) that docs given by id refer to; its texts are
    the passage store. With `n_passages`, checks each record can form a group of 1 positive +
    (n_passages - 1) negatives: a record without negatives is an error unless `fill` is "random"
    (missing negatives drawn from all passages; sample_group); a record with too few samples them
    with replacement (a warning) unless `fill` fills them. cache: where the parsed records are kept
    (datacache.entry_path: "auto", "off"/None, or a folder).
    """
    records, fmt, unread, one_word = parse_records_cached(path, corpus, cache)
    # the pool is fixed here: a store shared with a file read later (--corpus) grows, and a
    # training record must not draw from the validation file's passages
    records.fill, records.pool = fill, len(records.passages)
    warnings = check_groups(records, n_passages, fill)
    if corpus is None and one_word[1] >= 10 and one_word[0] >= 0.9 * one_word[1]:
        warnings.append(f"{path}: {one_word[0]} of its {one_word[1]} distinct passages are one word each: if they "
                        "are ids into a corpus, pass --corpus (without it a string doc is the passage text)")
    records.summary = _summary(records, fmt, unread)
    return records, warnings


def parse_records_cached(path, corpus, cache):
    """parse_records through a data cache (datacache.cached): the records' arrays mapped from the
    cache, parsed only when it is missing, stale or damaged. The same returns, and the records also
    carry their file's content digest (`records.digest`) and distinct passage count."""
    from . import datacache

    if cache in (None, "off"):
        return parse_records(path, corpus)
    n0 = len(corpus.texts) if corpus is not None else 0  # inline texts of the file go after the corpus's
    key = {"what": "records", "corpus": datacache.fingerprint(corpus.path) if corpus is not None else None,
           "corpus_texts": n0}
    built = []

    def build():
        parsed = parse_records(path, corpus)
        built.append(parsed)
        return parsed[0].to_arrays(n0), {"format": parsed[1], "unread": dict(parsed[2]), "one_word": parsed[3],
                                         "prompts": parsed[0].prompts, "digest": datacache.fingerprint(path)["content"],
                                         "distinct": distinct_passages(parsed[0])}
    arrays, info, state = datacache.cached(path, cache, key, build, path)
    if state is None:
        return built[0]
    records = Records.mapped(path, corpus.texts if corpus is not None else None, arrays, info["prompts"])
    if state == "hit" and corpus is not None:  # (a build added them while parsing)
        extra = TextStore.mapped(arrays["passages_buf"], arrays["passages_ends"])
        for j in range(len(extra)):
            corpus.texts.add(extra[j])
    records.digest, records.distinct = info["digest"], info["distinct"]
    return records, info["format"], Counter(info["unread"]), tuple(info["one_word"])


@gc_paused()
def parse_records(path, corpus=None):
    """The parse phase of read_records: every line parsed by its format's parser and its docs
    resolved (ids through `corpus`), each distinct text stored once. Raises DataError listing every
    bad line. Returns (records, format name, Counter of fields not read, (one-word passages,
    distinct passages))."""
    problems = []
    passages = corpus.texts if corpus is not None else TextStore()
    records, stored, pending = Records(path, passages), {}, []
    fmt, unread, one_word = None, Counter(), [0]  # inline texts without a space: ids without --corpus?

    def resolve():
        wanted = [doc for _, parsed in pending for doc in parsed[2] + parsed[3] if doc[0] == "id"]
        found = corpus.find([d for _, d in wanted]).tolist() if wanted else None
        at = 0
        for lineno, (query, prompt, pos, neg, pos_scores, neg_scores) in pending:
            n = len(pos) + len(neg)
            if found is not None and n and all(kind == "id" for kind, _ in pos + neg) and min(found[at:at + n]) >= 0:
                ids, at = found[at:at + n], at + n  # every doc an id, every id found: the common case
                records.add(lineno, query, ids[:len(pos)], ids[len(pos):], pos_scores, neg_scores, prompt)
                continue
            ids, missing = [], []
            for kind, value in pos + neg:
                if kind == "text":
                    key = digest(value)
                    j = stored.get(key)
                    if j is None:
                        j = stored[key] = passages.add(value)
                        one_word[0] += not any(c.isspace() for c in value.strip())
                else:
                    j, at = found[at], at + 1
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
    return records, fmt[0], unread, (one_word[0], len(stored))


def check_groups(records, n_passages, fill=None):
    """The check phase of read_records: can every record form a group of 1 positive +
    (n_passages - 1) negatives? A record without negatives is a DataError unless `fill` is
    "random"; a record with too few is a warning. Returns the warnings."""
    warnings, path, passages = [], records.path, records.passages
    if n_passages is None or n_passages <= 1:
        return warnings
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
    return warnings


def distinct_passages(records):
    return len(np.unique(np.concatenate([np.frombuffer(records.pos_ids, dtype=np.int32),
                                         np.frombuffer(records.neg_ids, dtype=np.int32)])))


def _summary(records, fmt, unread):
    distinct = getattr(records, "distinct", None) or distinct_passages(records)
    parts = [f"{fmt} format", f"{len(records):,} records", f"{distinct:,} distinct passages"]
    if records.pos_scores is not None:
        parts.append("teacher scores kept")
    if records.prompt_ids is not None:
        n = int(np.count_nonzero(np.frombuffer(records.prompt_ids, dtype=np.int32) >= 0))
        parts.append(f"{n:,} records with their own prompt (it replaces the query prefix for them)")
    if unread:
        parts.append("fields not read: " + ", ".join(f"{k} ({n:,})" for k, n in unread.most_common(6)))
    return f"{records.path}: " + "; ".join(parts)



MIX_KEYS = ("file", "weight", "name")  # a --train-mix line's keys besides the script's prompt keys


def read_mix(path, prompt_keys):
    """--train-mix: a JSONL file, one training file per line: {"file": path (relative to the mix
    file's folder), "weight": its share (optional: all or none), "name": what its counts are logged
    as (optional; default the file's name), and the script's `prompt_keys` (optional)}.
    -> [dict]; every bad line reported as `file:line: problem` at once (DataError)."""
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
    out = []
    for path, name in zip(paths, names):
        base = name or os.path.basename(path)
        for ext in (".gz", ".jsonl", ".json"):
            base = base[:-len(ext)] if not name and base.endswith(ext) else base
        out.append(base)
    return [n if out.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(out)]


def training_files(spec):
    """The run's training files from --train-file (repeatable) and --train-weights, or --train-mix:
    [{"file", "weight", "name", prompt keys...}], checked (each bad line of the mix file)."""
    if spec.train_mix:
        entries = read_mix(spec.train_mix, spec.prompt_keys)
    else:
        weights = spec.train_weights or [None] * len(spec.train_files)
        entries = [{"file": p, "weight": w} for p, w in zip(spec.train_files, weights)]
    names = _file_names([e["file"] for e in entries], [e.get("name") for e in entries])
    return [{**e, "name": n} for e, n in zip(entries, names)]


@dataclass
class DataSpec:
    """What to read for a run (cli.data_spec builds it from the data flags)."""
    train_files: list = field(default_factory=list)
    train_weights: list = None
    train_mix: str = None  # a --train-mix file, instead of train_files
    prompt_keys: tuple = ()  # what a mix line may set for its file
    corpus: str = None
    fill_negatives: str = None
    n_passages: int = 2
    batch_size: int = 1
    val_file: str = ""
    val_n_passages: int = 4
    val_max_groups: int = 0
    need_scores: bool = False  # distillation: every training file must carry teacher scores
    dev_queries: int = 0  # --dev-queries: training records held out as a retrieval dev set (hold_out_dev)
    dev_corpus_size: int = 10000
    seed: int = 0
    data_cache: str = None  # --data-cache: where parsed files are kept and mapped (datacache.entry_path)


class Subset:
    """Records `base` without some: len and indexing over the kept ones; anything else is the base's."""

    def __init__(self, base, keep):
        self.base, self.keep = base, keep

    def __len__(self):
        return len(self.keep)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.base[j] for j in self.keep[i]]
        return self.base[self.keep[i]]

    def __getattr__(self, name):  # (not for dunders nor its own fields: unpickling in a DataLoader worker asks)
        if name.startswith("__") or name in ("base", "keep"):
            raise AttributeError(name)
        return getattr(self.base, name)


def hold_out_dev(files, n, corpus_size, seed):
    """--dev-queries: draw `n` training records (seeded by `seed` and keyed by query text: a resume, and
    another file with the same queries, hold out the same ones), take them out of training (each
    file's records become a Subset), and return them as a BEIR-style dev set
    (ids, texts, queries, qrels) for evaluate.beir_metrics: their queries; as corpus their positives
    and every passage of their groups, plus a seeded sample of other training passages up to
    `corpus_size` (0: all); relevant = each query's positives. Returns (files, dev, summary)."""
    import hashlib
    import heapq
    import random

    total = sum(len(f.records) for f in files)
    if n >= total:
        raise SystemExit(f"--dev-queries {n}: the training files hold {total} records; hold out fewer")
    rng = random.Random(f"dev-{seed}")
    # keyed by the query's text, not its line: the same seed holds out the same queries in every file
    # of a pipeline (the bi-encoder's data, the negatives mined from it, the reranker's), so a later
    # stage's dev set is one the earlier stage never trained on
    keys = [(hashlib.blake2b(f"{seed}\0{r.query}".encode(), digest_size=8).digest(), i)
            for i, r in enumerate(r for f in files for r in f.records)]
    chosen = sorted(i for _, i in heapq.nsmallest(n, keys))
    held, out, start = [], [], 0
    for f in files:
        mine = {i - start for i in chosen if start <= i < start + len(f.records)}
        held += [f.records[i] for i in sorted(mine)]
        out.append(replace(f, records=Subset(f.records, [i for i in range(len(f.records)) if i not in mine])))
        start += len(f.records)
    ids, texts, index = [], [], {}

    def add(text):
        if text not in index:
            index[text] = f"d{len(texts)}"
            ids.append(index[text])
            texts.append(text)
        return index[text]
    queries, qrels = {}, {}
    for k, r in enumerate(held):
        qid = f"q{k}"
        queries[qid] = r.query
        qrels[qid] = {add(p): 1 for p in r.pos}
        for p in r.neg:
            add(p)
    stores = list({id(f.records.passages): f.records.passages for f in files}.values())  # a shared corpus once
    pool = sum(len(st) for st in stores)
    target = pool + len(texts) if corpus_size <= 0 else corpus_size
    for j in rng.sample(range(pool), min(pool, max(0, target - len(texts)) + len(texts))):  # room for repeats
        if len(texts) >= target:
            break
        for st in stores:
            if j < len(st):
                add(st[j])
                break
            j -= len(st)
    summary = (f"dev: {n} training records held out (seed {seed}): {n} queries over {len(texts):,} passages "
               f"(their groups + a sample of the training passages)")
    return out, (ids, texts, queries, qrels), summary


def passage_pool(files):
    """Every distinct passage of the training files' stores (a store shared by several files once): the pool a
    dev query's neighbours are mined from (evaluate.add_neighbours)."""
    stores = list({id(f.records.passages): f.records.passages for f in files}.values())
    return list(dict.fromkeys(st[j] for st in stores for j in range(len(st))))


def read_train_val(spec, world_size):
    """Read and validate the training files (training_files) and the validation file (and the
    corpus) of a DataSpec, before any model is loaded. Returns ([TrainFile], val_records, mixture, dev):
    `mixture` says what the files are (name, path, records, weight, batches per round, prompts) -
    a script keeps it with its args, so a resume on other data is refused as a changed arg. What
    was read and any warnings are printed on rank 0. A file with fewer records than one global
    batch is an error. `dev`: the --dev-queries set (hold_out_dev), else None."""
    from .dist import print0

    entries = training_files(spec)
    corpus = read_corpus(spec.corpus, spec.data_cache) if spec.corpus else None
    dev = None
    if corpus is not None:
        print0(f"corpus: {spec.corpus}: {len(corpus):,} documents")
    files, warnings = [], []
    for e in entries:
        records, file_warnings = read_records(e["file"], spec.n_passages, corpus, spec.fill_negatives,
                                              spec.data_cache)
        print0(f"train: {records.summary}")
        warnings += file_warnings
        files.append(TrainFile(records, e.get("weight"), e["name"], {k: e[k] for k in spec.prompt_keys if k in e},
                               e["file"]))
    val_records = []
    if spec.val_file:
        val_records, val_warnings = read_records(spec.val_file, spec.val_n_passages, corpus, spec.fill_negatives,
                                                 spec.data_cache)
        print0(f"val: {val_records.summary}")
        warnings += val_warnings
        val_records = val_records[:spec.val_max_groups or len(val_records)]
    for f in files:
        if spec.need_scores and f.records.pos_scores is None:
            raise SystemExit(f"--distill-weight: {f.path} has no teacher scores "
                             "(pos_scores / neg_scores); write them with python -m retrieval_kit.score")
        if steps_per_epoch(len(f.records), spec.batch_size, world_size) == 0:
            raise SystemExit(f"{f.path}: {len(f.records)} records are fewer than one global batch "
                             f"({spec.batch_size} x {world_size} ranks)")
    if spec.dev_queries:
        files, dev, said = hold_out_dev(files, spec.dev_queries, spec.dev_corpus_size, spec.seed)
        print0(said)
    quotas = mixture_quotas([steps_per_epoch(len(f.records), spec.batch_size, world_size) for f in files],
                            [f.weight for f in files])
    corpus_digest = {"corpus_digest": corpus.digest or file_digest(spec.corpus)} if spec.corpus else {}
    mixture = [{"name": f.name, "file": f.path, "records": len(f.records), "weight": f.weight,
                "batches_per_round": q, **f.prompts, "digest": f.records.digest or file_digest(f.path),
                **corpus_digest}
               for f, q in zip(files, quotas)]  # digests: a resume on regenerated data is refused
    if len(files) > 1:
        print0("train mixture, micro-batches per round: " + ", ".join(
            f"{f.name} {q} ({q / sum(quotas):.1%})" for f, q in zip(files, quotas)))
    for w in warnings:
        print0(f"warning: {w}")
    return files, val_records, mixture, dev
