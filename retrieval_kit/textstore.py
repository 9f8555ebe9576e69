"""Training data in bounded memory: every text stored once, records as integer ids.

A `TextStore` keeps its texts as one UTF-8 buffer and an array of end offsets (8 bytes per text
over the text itself), so there is no Python object per text and nothing for DataLoader workers
to copy on write. `Records` keeps each record's query, positives and negatives as ids into stores
(4 bytes per passage reference), with optional teacher scores and prompts; `records[i]` is a small
view whose `.query`, `.pos`, `.neg` read the texts only when asked. `Corpus` is a BEIR corpus
(ids and texts) looked up by id through a sorted array of 16-byte digests, not a dict.
"""

import hashlib
from array import array
from collections.abc import Sequence

import numpy as np


class TextStore:
    """Append-only texts: `add(text) -> id`, `store[id] -> text`. `TextStore.mapped(buf, ends)` starts
    from texts already laid out (a data cache's mapped arrays); texts added later go after them."""

    def __init__(self):
        self._base, self._base_ends, self._n0 = None, None, 0
        self._buf = bytearray()
        self._ends = array("q")

    @classmethod
    def mapped(cls, buf, ends):
        store = cls()
        store._base, store._base_ends, store._n0 = buf, ends, len(ends)
        return store

    def add(self, text):
        self._buf += text.encode("utf-8")
        self._ends.append(len(self._buf))
        return self._n0 + len(self._ends) - 1

    def __len__(self):
        return self._n0 + len(self._ends)

    def __getitem__(self, i):
        if i < self._n0:
            start = self._base_ends[i - 1] if i > 0 else 0
            return self._base[start:self._base_ends[i]].tobytes().decode("utf-8")
        i -= self._n0
        start = self._ends[i - 1] if i > 0 else 0
        return self._buf[start:self._ends[i]].decode("utf-8")

    def nbytes(self):
        """Bytes held: the text and its offsets."""
        base = 0 if self._base is None else self._base.nbytes + self._base_ends.nbytes
        return base + len(self._buf) + self._ends.itemsize * len(self._ends)

    def arrays(self, start=0):
        """(buffer as uint8, end offsets as int64) of texts start.. (for a data cache)."""
        if start < self._n0:
            raise ValueError("the mapped texts of a store are in a cache already")
        start -= self._n0
        ends = np.frombuffer(self._ends, dtype=np.int64)[start:]
        offset = int(self._ends[start - 1]) if start > 0 else 0
        return np.frombuffer(self._buf, dtype=np.uint8)[offset:], ends - offset  # views: add nothing meanwhile


def digest(text):
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


class DigestIndex:
    """Position of a key among `n` keys given by their digests (16 bytes each, in order): a sorted
    array and binary search; 24 bytes per key, no Python object per key."""

    def __init__(self, digests=b""):
        keys = np.frombuffer(bytes(digests), dtype="S16")
        self._order = np.argsort(keys, kind="stable")
        self._sorted = keys[self._order]
        self._prefix = None  # the first 8 bytes of each sorted key as an integer (find)

    @classmethod
    def mapped(cls, order, sorted_keys):
        index = cls()
        index._order, index._sorted = order, sorted_keys
        return index

    def duplicates(self):
        """[(first position, later position)] of keys given twice."""
        same = np.nonzero(self._sorted[1:] == self._sorted[:-1])[0]
        return [(int(self._order[i]), int(self._order[i + 1])) for i in same]

    def find(self, digests, last=False):
        """Positions of the keys with these digests (one bytes object, 16 per key); -1 where absent.
        A key given more than once: its first position (last=True: its last).

        The binary searches run over the keys' first 8 bytes as integers (in the order of the whole
        keys), with the wanted keys sorted first, so consecutive searches walk the index one way: at
        10M keys, against one bytes comparison per step in the wanted order, 5x fewer cache misses. A
        prefix that several keys share (about one pair in 10M at random) is searched by whole key."""
        n = len(digests) // 16
        if not n or not len(self._sorted):
            return np.full(n, -1, dtype=np.int64)
        want = np.frombuffer(bytes(digests), dtype="S16")
        if self._prefix is None:  # (built on the first search: a mapped index that is never searched stays cold)
            self._prefix = np.ascontiguousarray(self._sorted).view(">u8")[::2].astype(np.uint64)
        side, back = ("right", 1) if last else ("left", 0)
        want_prefix = want.view(">u8")[::2].astype(np.uint64)
        order = np.argsort(want_prefix, kind="stable")
        at = np.empty(n, dtype=np.int64)
        at[order] = np.searchsorted(self._prefix, want_prefix[order], side=side)
        at = (at - back).clip(0, len(self._sorted) - 1)
        found = self._sorted[at] == want
        shared = np.nonzero(~found & (self._prefix[at] == want_prefix))[0]
        if len(shared):
            again = (np.searchsorted(self._sorted, want[shared], side=side) - back).clip(0, len(self._sorted) - 1)
            at[shared], found[shared] = again, self._sorted[again] == want[shared]
        return np.where(found, self._order[at], -1)


class Corpus:
    """Documents by id: `ids` and `texts` stores, `lines` (each document's line in its file) and
    `find(ids)` -> positions (-1 where absent)."""

    def __init__(self, path):
        self.path, self.ids, self.texts, self.lines = path, TextStore(), TextStore(), array("i")
        self._digests, self._index = bytearray(), None
        self.digest = None  # the file's content digest, where a data cache keeps it

    def to_arrays(self):
        """{name: array} of a finished corpus, for a data cache (views: add nothing meanwhile)."""
        (ids_buf, ids_ends), (texts_buf, texts_ends) = self.ids.arrays(), self.texts.arrays()
        return {"ids_buf": ids_buf, "ids_ends": ids_ends, "texts_buf": texts_buf, "texts_ends": texts_ends,
                "lines": np.frombuffer(self.lines, dtype=np.int32), "order": self._index._order,
                "sorted": self._index._sorted}

    @classmethod
    def mapped(cls, path, arrays):
        corpus = cls(path)
        corpus.ids = TextStore.mapped(arrays["ids_buf"], arrays["ids_ends"])
        corpus.texts = TextStore.mapped(arrays["texts_buf"], arrays["texts_ends"])
        corpus.lines, corpus._index = arrays["lines"], DigestIndex.mapped(arrays["order"], arrays["sorted"])
        return corpus

    def add(self, doc_id, text, line):
        self._digests += digest(doc_id)
        self.ids.add(doc_id)
        self.lines.append(line)
        return self.texts.add(text)

    def finish(self):
        """Index the ids; returns [(first line, later line, id)] for ids given twice."""
        self._index = DigestIndex(self._digests)
        self._digests = bytearray()
        return [(self.lines[a], self.lines[b], self.ids[a]) for a, b in self._index.duplicates()]

    def find(self, doc_ids):
        return self._index.find(b"".join(digest(d) for d in doc_ids))

    def __len__(self):
        return len(self.ids)  # the texts may grow past the documents (inline texts of a training file)


class Texts(Sequence):
    """Some texts of a store, by id, read when indexed (what `record.pos` / `record.neg` are)."""

    def __init__(self, store, ids):
        self._store, self.ids = store, ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._store[j] for j in self.ids[i]]
        return self._store[self.ids[i]]

    def __eq__(self, other):
        return list(self) == list(other)

    def __repr__(self):
        return repr(list(self))


class Records:
    """Training records as ids: queries (with an optional prompt each), positives and negatives
    (ids into `passages`, with optional teacher scores; NaN where a passage has none), and the line
    each record came from. `records[i]` (or a slice) gives RecordView(s)."""

    def __init__(self, path, passages):
        self.path, self.passages, self.queries = path, passages, TextStore()
        self.lines, self.pos_ends, self.pos_ids = array("i"), array("q"), array("i")
        self.neg_ends, self.neg_ids = array("q"), array("i")
        self.pos_scores = self.neg_scores = None  # array("f") once a record has scores
        self.prompts, self.prompt_ids, self._prompt_index = [], None, {}
        self.fill = None  # "random": draw missing negatives from the first `pool` passages (records.read_records)
        self.pool = 0
        self.summary = ""  # what was read, in a line (records.read_records)
        self.digest = None  # the file's content digest, where a data cache keeps it

    ARRAYS = ("lines", "pos_ends", "pos_ids", "neg_ends", "neg_ids", "pos_scores", "neg_scores", "prompt_ids")

    def to_arrays(self, passages_from=0):
        """{name: array} of the records, their queries and the passages they added to their store
        from id `passages_from` on, for a data cache (views: add nothing meanwhile)."""
        out = {n: np.frombuffer(getattr(self, n), dtype=getattr(self, n).typecode)
               for n in self.ARRAYS if getattr(self, n) is not None}
        out["queries_buf"], out["queries_ends"] = self.queries.arrays()
        out["passages_buf"], out["passages_ends"] = self.passages.arrays(passages_from)
        return out

    @classmethod
    def mapped(cls, path, passages, arrays, prompts):
        """Records over a data cache's arrays; their passages are `passages` (None: the arrays' own)."""
        if passages is None:
            passages = TextStore.mapped(arrays["passages_buf"], arrays["passages_ends"])
        records = cls(path, passages)
        records.queries = TextStore.mapped(arrays["queries_buf"], arrays["queries_ends"])
        for n in cls.ARRAYS:
            setattr(records, n, arrays.get(n))
        records.prompts, records._prompt_index = list(prompts), {p: i for i, p in enumerate(prompts)}
        return records

    def add(self, line, query, pos_ids, neg_ids, pos_scores=None, neg_scores=None, prompt=None):
        n = len(self.lines)
        self.lines.append(line)
        self.queries.add(query)
        self.pos_ids.extend(pos_ids)
        self.pos_ends.append(len(self.pos_ids))
        self.neg_ids.extend(neg_ids)
        self.neg_ends.append(len(self.neg_ids))
        if (pos_scores is not None or neg_scores is not None) and self.pos_scores is None:
            self.pos_scores = array("f", [float("nan")] * (len(self.pos_ids) - len(pos_ids)))
            self.neg_scores = array("f", [float("nan")] * (len(self.neg_ids) - len(neg_ids)))
        if self.pos_scores is not None:
            self.pos_scores.extend(pos_scores if pos_scores is not None else [float("nan")] * len(pos_ids))
            self.neg_scores.extend(neg_scores if neg_scores is not None else [float("nan")] * len(neg_ids))
        if prompt is not None and self.prompt_ids is None:
            self.prompt_ids = array("i", [-1] * n)
        if self.prompt_ids is not None:
            if prompt is not None and prompt not in self._prompt_index:
                self._prompt_index[prompt] = len(self.prompts)
                self.prompts.append(prompt)
            self.prompt_ids.append(self._prompt_index[prompt] if prompt is not None else -1)

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [RecordView(self, j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return RecordView(self, i)

    def span(self, ends, i):
        return (ends[i - 1] if i > 0 else 0), ends[i]

    def nbytes(self):
        """Bytes held by the records and their texts."""
        arrays = [self.lines, self.pos_ends, self.pos_ids, self.neg_ends, self.neg_ids, self.pos_scores,
                  self.neg_scores, self.prompt_ids]
        return self.passages.nbytes() + self.queries.nbytes() + sum(a.itemsize * len(a) for a in arrays if a is not None)


class PromptedQuery(str):
    """A query that carries its own instruction (a record's prompt): tokenized without the run's
    --query-prefix, as FlagEmbedding uses a record's prompt instead of the default instruction."""

    prompted = True


class RecordView:
    """One record of a Records: .query (its prompt prepended), .pos / .neg (Texts), .pos_ids /
    .neg_ids, .pos_scores / .neg_scores (lists, or None), .where ("file:line")."""

    __slots__ = ("_r", "_i")

    def __init__(self, records, i):
        self._r, self._i = records, i

    @property
    def query(self):
        """The query as the model reads it: a record's own prompt (FlagEmbedding's "prompt") comes
        first and replaces the run's query prefix (a PromptedQuery, which collate leaves as is)."""
        prompt = self.prompt
        return PromptedQuery(prompt + self.bare_query) if prompt else self.bare_query

    @property
    def bare_query(self):
        """The query as the file wrote it, without its prompt."""
        return self._r.queries[self._i]

    @property
    def prompt(self):
        r, i = self._r, self._i
        return r.prompts[r.prompt_ids[i]] if r.prompt_ids is not None and r.prompt_ids[i] >= 0 else ""

    @property
    def pos_ids(self):
        a, b = self._r.span(self._r.pos_ends, self._i)
        return self._r.pos_ids[a:b].tolist()

    @property
    def neg_ids(self):
        a, b = self._r.span(self._r.neg_ends, self._i)
        return self._r.neg_ids[a:b].tolist()

    @property
    def pos(self):
        return Texts(self._r.passages, self.pos_ids)

    @property
    def neg(self):
        return Texts(self._r.passages, self.neg_ids)

    @property
    def pos_scores(self):
        if self._r.pos_scores is None:
            return None
        return self._r.pos_scores[slice(*self._r.span(self._r.pos_ends, self._i))].tolist()

    @property
    def neg_scores(self):
        if self._r.neg_scores is None:
            return None
        return self._r.neg_scores[slice(*self._r.span(self._r.neg_ends, self._i))].tolist()

    @property
    def fill_pool(self):
        """Passages to draw missing negatives from (their count), or 0 when filling is off."""
        return self._r.pool if self._r.fill == "random" else 0

    def passage(self, j):
        return self._r.passages[j]

    @property
    def where(self):
        return f"{self._r.path}:{self._r.lines[self._i]}"
