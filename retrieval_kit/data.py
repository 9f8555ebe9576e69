"""Read and validate training JSONL; sample groups; shard batches over ranks.

A record is one JSON object per line:
    {"query": "...", "pos_doc": ["..."], "neg_doc": ["...", "..."]}
`question` is accepted for `query`, `pos` for `pos_doc`, `neg` for `neg_doc`.
A doc is a string or {"id": ..., "text": "..."}.

Every bad line is reported as `file:line: problem`, all of them at once, before training starts.
"""

import json
import random
from dataclasses import dataclass, field

import torch

FIELD_ALIASES = {"query": ("query", "question"), "pos": ("pos_doc", "pos"), "neg": ("neg_doc", "neg")}


class DataError(ValueError):
    """Raised with one `file:line: problem` per bad line."""


@dataclass
class Record:
    query: str
    pos: list
    neg: list = field(default_factory=list)
    where: str = ""  # "file:line", for messages


def _doc_text(doc, where, fld, i, problems):
    if isinstance(doc, str):
        if not doc.strip():
            problems.append(f"{where}: {fld}[{i}] is an empty string")
            return None
        return doc
    if isinstance(doc, dict):
        text = doc.get("text")
        if not isinstance(text, str) or not text.strip():
            problems.append(f"{where}: {fld}[{i}] is an object without a non-empty string 'text'")
            return None
        return text
    problems.append(f"{where}: {fld}[{i}] must be a string or an object with 'text', got {type(doc).__name__}")
    return None


def _pick(obj, key, where, problems):
    """Return (field name used, value) for one of the aliases of `key`; report clashes."""
    names = [n for n in FIELD_ALIASES[key] if n in obj]
    if len(names) > 1:
        problems.append(f"{where}: both {names[0]!r} and {names[1]!r} given; use one")
        return names[0], None
    if not names:
        return FIELD_ALIASES[key][0], None
    return names[0], obj[names[0]]


def parse_line(line, where, problems):
    """Parse one JSONL line into a Record, appending any problems; returns None if the line is bad."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        problems.append(f"{where}: invalid JSON ({e.msg} at column {e.colno})")
        return None
    if not isinstance(obj, dict):
        problems.append(f"{where}: expected a JSON object, got {type(obj).__name__}")
        return None
    n_before = len(problems)
    qname, query = _pick(obj, "query", where, problems)
    if query is None and len(problems) == n_before:
        problems.append(f"{where}: missing field 'query' (or 'question')")
    elif query is not None and (not isinstance(query, str) or not query.strip()):
        problems.append(f"{where}: field {qname!r} must be a non-empty string")
    docs = {}
    for key, required in (("pos", True), ("neg", False)):
        name, value = _pick(obj, key, where, problems)
        if value is None:
            if required and not any(n in obj for n in FIELD_ALIASES[key]):
                problems.append(f"{where}: missing field 'pos_doc' (or 'pos')")
            docs[key] = []
            continue
        if isinstance(value, (str, dict)):
            value = [value]
        if not isinstance(value, list):
            problems.append(f"{where}: field {name!r} must be a list of docs, got {type(value).__name__}")
            docs[key] = []
            continue
        if required and not value:
            problems.append(f"{where}: field {name!r} is empty; a record needs at least one positive")
        docs[key] = [_doc_text(d, where, name, i, problems) for i, d in enumerate(value)]
    if len(problems) > n_before:
        return None
    return Record(query=query, pos=docs["pos"], neg=docs["neg"], where=where)


def exit_on_data_error(main):
    """Run an entry point's main(): a DataError (a user's bad or missing file) ends the run with its
    message (printed once, by rank 0 under torchrun) and exit status 1, not a traceback."""
    from .dist import is_main

    try:
        return main()
    except DataError as e:
        raise SystemExit(str(e) if is_main() else 1) from None


def format_problems(problems, limit=50):
    shown = problems[:limit]
    more = f"\n... and {len(problems) - limit} more" if len(problems) > limit else ""
    return "\n".join(shown) + more


GZIP_MAGIC = b"\x1f\x8b"


def text_lines(path, problems):
    """Yield (lineno, text) for every line of a UTF-8 text file, plain or gzip-compressed (told by
    its first bytes, whatever its name). A line that is not valid UTF-8 is reported in `problems`
    as `path:line` and skipped, so every bad line of the file is reported at once; a byte-order
    mark at the start is dropped. A file that cannot be opened, or a truncated or corrupt gzip
    stream, is a DataError naming the file."""
    import gzip
    import zlib

    try:
        with open(path, "rb") as f:
            compressed = f.read(2) == GZIP_MAGIC
        f = gzip.open(path, "rb") if compressed else open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})") from None
    lineno = 0
    with f:
        try:
            for lineno, raw in enumerate(f, start=1):
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    problems.append(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
                                    "of the line); re-encode the file as UTF-8")
        except (EOFError, OSError, zlib.error) as e:
            raise DataError(f"{path}: the gzip stream is truncated or corrupt after line {lineno} ({e})") from None


def jsonl_lines(path, problems):
    """Yield ("path:line", text) for each non-blank line of a JSONL file (.jsonl or .jsonl.gz);
    undecodable lines go to `problems` (text_lines)."""
    for lineno, line in text_lines(path, problems):
        if line.strip():
            yield f"{path}:{lineno}", line


def read_records(path, n_passages=None):
    """Read and validate a training JSONL file. Raises DataError listing every bad line.

    With `n_passages`, also checks each record can form a group of 1 positive + (n_passages - 1)
    negatives; returns (records, warnings) where warnings say which pools are too small (those
    groups sample negatives with replacement).
    """
    records, problems = [], []
    for where, line in jsonl_lines(path, problems):
        rec = parse_line(line, where, problems)
        if rec is not None:
            records.append(rec)
    if not records and not problems:
        problems.append(f"{path}: no records (the file is empty)")
    warnings = []
    if n_passages is not None and n_passages > 1:
        need = n_passages - 1
        short = [r for r in records if 0 < len(r.neg) < need]
        for r in records:
            if not r.neg:
                problems.append(f"{r.where}: no negatives, but --n-passages {n_passages} needs {need} per group")
        if short:
            warnings.append(
                f"{len(short)} record(s) have fewer than {need} negatives (first: {short[0].where}); "
                "their negatives are sampled with replacement")
    if problems:
        raise DataError(f"{len(problems)} problem(s) in {path}:\n" + format_problems(problems))
    return records, warnings


def group_rng(seed, epoch, index):
    """A per-record RNG: the group sampled for record `index` in `epoch` depends on nothing else,
    so any rank count and any resume point sees the same groups."""
    return random.Random(f"{seed}-{epoch}-{index}")


def sample_group(record, n_passages, rng):
    """Return [positive, negative_1, ..., negative_{n_passages-1}] for one record."""
    pos = rng.choice(record.pos)
    need = n_passages - 1
    if need == 0:
        return [pos]
    if len(record.neg) >= need:
        negs = rng.sample(record.neg, need)
    else:
        negs = rng.choices(record.neg, k=need)  # pool too small: with replacement (warned at load)
    return [pos] + negs


def fixed_group(record, n_passages):
    """Deterministic group for validation: first positive, first negatives (cycled if too few)."""
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
    """

    def __init__(self, records, n_passages, batch_size, rank, world_size, seed, collate):
        self.records, self.n, self.batch_size, self.rank, self.world = records, n_passages, batch_size, rank, world_size
        self.seed, self.collate = seed, collate
        self.steps_per_epoch = steps_per_epoch(len(records), batch_size, world_size)
        self._epoch, self._order = -1, None

    def __getitem__(self, i):
        epoch, pos = divmod(i, self.steps_per_epoch)
        if epoch != self._epoch:  # one permutation per epoch, kept by each worker
            self._epoch, self._order = epoch, epoch_order(len(self.records), self.seed, epoch)
        idx = rank_batch(self._order, pos, self.batch_size, self.rank, self.world)
        groups = [sample_group(self.records[j], self.n, group_rng(self.seed, epoch, j)) for j in idx]
        return self.collate([self.records[j].query for j in idx], groups)


def read_train_val(train_file, n_passages, val_file, val_n_passages, val_max_groups, batch_size, world_size):
    """Read and validate the training and validation files, before any model is loaded:
    (records, val_records); warnings printed on rank 0. Fewer records than one global batch is an error."""
    from .dist import print0

    records, warnings = read_records(train_file, n_passages)
    val_records = read_records(val_file, val_n_passages)[0] if val_file else []
    if val_max_groups:
        val_records = val_records[:val_max_groups]
    if steps_per_epoch(len(records), batch_size, world_size) == 0:
        raise SystemExit(f"{train_file}: {len(records)} records are fewer than one global batch "
                         f"({batch_size} x {world_size} ranks)")
    for w in warnings:
        print0(f"warning: {train_file}: {w}")
    return records, val_records


CHUNK_TOKENS = 1024  # measured faster on the default model and data (README, Benchmark)


def add_data_args(parser, data_dir, n_passages, batch_size, unit="passages"):
    """The data flags both scripts share (each adds its own tokenization flags to the group)."""
    import os

    g = parser.add_argument_group("data")
    g.add_argument("--train-file", default=os.path.join(data_dir, "train.jsonl"), help="training JSONL")
    g.add_argument("--val-file", default=os.path.join(data_dir, "val.jsonl"),
                   help="held-out JSONL for validation ('' to skip)")
    g.add_argument("--val-max-groups", type=int, default=0, help="validate on the first N groups (0 = all)")
    g.add_argument("--val-n-passages", type=int, default=4,
                   help=f"{unit} per validation group (1 positive + N-1 negatives)")
    g.add_argument("--n-passages", type=int, default=n_passages,
                   help=f"{unit} per query: 1 positive + N-1 hard negatives (default {n_passages})")
    g.add_argument("--batch-size", type=int, default=batch_size,
                   help=f"queries per rank per micro-batch (default {batch_size})")
    g.add_argument("--pad-to-multiple-of", type=int, default=8, help="round padded lengths up to this (0 = off)")
    g.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS,
                   help="run each batch in length-sorted chunks of at most this many padded tokens, each "
                        f"padded only to its own longest row; same loss and grads (0 = off; default {CHUNK_TOKENS})")
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
