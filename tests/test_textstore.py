"""textstore: texts in one buffer, lookups by id digest, records as ids - against plain Python lists
and dicts holding the same things."""

import random

from retrieval_kit.textstore import Corpus, DigestIndex, Records, TextStore, digest


def test_text_store_gives_back_every_text():
    rng = random.Random(0)
    texts = ["", "a", "漢字 かな", "emoji 😀 and \x00 inside", "x" * 10_000] + \
        ["".join(rng.choice("abc é€\n") for _ in range(rng.randrange(50))) for _ in range(200)]
    store = TextStore()
    ids = [store.add(t) for t in texts]
    assert ids == list(range(len(texts))) and len(store) == len(texts)
    assert [store[i] for i in ids] == texts
    assert store.nbytes() == sum(len(t.encode()) for t in texts) + 8 * len(texts)


def test_digest_index_finds_what_a_dict_finds():
    rng = random.Random(1)
    keys = list({f"doc-{rng.randrange(10**9)}" for _ in range(5000)})
    index = DigestIndex(b"".join(digest(k) for k in keys))
    ref = {k: i for i, k in enumerate(keys)}
    probes = rng.sample(keys, 300) + [f"missing-{i}" for i in range(50)]
    assert index.find(b"".join(digest(k) for k in probes)).tolist() == [ref.get(k, -1) for k in probes]
    assert index.duplicates() == []
    dup = DigestIndex(b"".join(digest(k) for k in ["a", "b", "a", "c", "b"]))
    assert sorted(dup.duplicates()) == [(0, 2), (1, 4)]


def test_digest_index_finds_first_and_last_where_keys_share_their_first_8_bytes():
    """find() searches the keys' first 8 bytes, then the whole key where a prefix is shared: keys
    built to share prefixes (and to repeat) are found at the position a loop over them finds."""
    rng = random.Random(2)
    prefixes = [bytes(rng.randrange(256) for _ in range(8)) for _ in range(20)] + [b"\x00" * 8, b"\xff" * 8]
    keys = [rng.choice(prefixes) + bytes([rng.randrange(3)]) + b"\x00" * 7 for _ in range(600)]  # (trailing NULs too)
    index = DigestIndex(b"".join(keys))
    probes = rng.sample(keys, 200) + [rng.choice(prefixes) + bytes([rng.randrange(3, 6)]) + b"\x00" * 7
                                      for _ in range(60)] + [bytes(rng.randrange(256) for _ in range(16))
                                                             for _ in range(20)]
    rng.shuffle(probes)
    first = [keys.index(k) if k in keys else -1 for k in probes]
    last = [len(keys) - 1 - keys[::-1].index(k) if k in keys else -1 for k in probes]
    assert index.find(b"".join(probes)).tolist() == first
    assert index.find(b"".join(probes), last=True).tolist() == last
    assert first != last and -1 in first  # repeated keys and absent ones were probed
    assert DigestIndex().find(b"".join(probes[:3])).tolist() == [-1] * 3 and index.find(b"").tolist() == []


def test_corpus_lookup_and_duplicate_lines():
    corpus = Corpus("c.jsonl")
    for line, (i, t) in enumerate([("d1", "one"), ("d2", "two"), ("d1", "again")], start=1):
        corpus.add(i, t, line)
    assert corpus.finish() == [(1, 3, "d1")]
    assert corpus.find(["d2", "zz"]).tolist() == [1, -1]


def test_record_views_read_what_was_added():
    passages = TextStore()
    for t in ("p0", "p1", "p2", "p3"):
        passages.add(t)
    recs = Records("t.jsonl", passages)
    recs.add(3, "q0", [0], [1, 2])
    recs.add(4, "q1", [3], [], pos_scores=[0.5], neg_scores=[], prompt="P: ")
    recs.add(9, "q2", [1, 2], [0])
    assert len(recs) == 3
    assert [(r.query, list(r.pos), list(r.neg), r.where) for r in recs[:]] == [
        ("q0", ["p0"], ["p1", "p2"], "t.jsonl:3"), ("P: q1", ["p3"], [], "t.jsonl:4"),
        ("q2", ["p1", "p2"], ["p0"], "t.jsonl:9")]
    scores = [(r.pos_scores, r.neg_scores) for r in recs]
    assert scores[1] == ([0.5], []) and all(x != x for x in scores[0][0] + scores[0][1] + scores[2][0] + scores[2][1])
    assert recs[-1].pos == ["p1", "p2"] and recs[0].neg[1:] == ["p2"]
    assert recs[2].fill_pool == 0
    recs.fill, recs.pool = "random", 4
    assert recs[2].fill_pool == 4
