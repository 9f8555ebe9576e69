"""The field's training formats, docs by corpus id, --fill-negatives, and the validators (formats.py,
textstore.py, records.read_records), each against the bundled data written out by hand in that format."""

import gzip
import json
import os
import random

import pytest

from retrieval_kit import data, formats
from retrieval_kit.formats import DataError
from retrieval_kit.records import read_records
from tests.conftest import ROOT


def bundled(n=12):
    with open(os.path.join(ROOT, "data", "train.jsonl")) as f:
        return [json.loads(next(f)) for _ in range(n)]


def write_jsonl(path, objs, packed=False):
    blob = "".join(json.dumps(o) + "\n" for o in objs).encode()
    path.write_bytes(gzip.compress(blob) if packed else blob)
    return str(path)


def as_tuples(records):
    return [(r.query, list(r.pos), list(r.neg)) for r in records]


def nemo_text(recs):
    return [{"query": r["query"], "pos_doc": [d["text"] for d in r["pos_doc"]],
             "neg_doc": [d["text"] for d in r["neg_doc"]]} for r in recs]


def formats_of(recs):
    """The same records in each format: {case: (records, needs the corpus)}; FORMAT_OF says which
    format read_records must tell for each case."""
    docs = lambda r, k: [d["text"] for d in r[k]]  # noqa: E731
    ids = lambda r, k: [d["id"] for d in r[k]]  # noqa: E731
    return {
        "NeMo inline": ([{"query": r["query"], "pos_doc": docs(r, "pos_doc"), "neg_doc": docs(r, "neg_doc")}
                         for r in recs], False),
        "NeMo objects": (recs, False),
        "FlagEmbedding": ([{"query": r["query"], "pos": docs(r, "pos_doc"), "neg": docs(r, "neg_doc")} for r in recs],
                          False),
        "sentence-transformers columns": (
            [{"anchor": r["query"], "positive": docs(r, "pos_doc")[0],
              **{f"negative_{i + 1}": t for i, t in enumerate(docs(r, "neg_doc"))}} for r in recs], False),
        "Tevatron": ([{"query_id": str(i), "query": r["query"],
                       "positive_passages": [{"docid": d["id"], "title": "", "text": d["text"]} for d in r["pos_doc"]],
                       "negative_passages": [{"docid": d["id"], "title": "", "text": d["text"]} for d in r["neg_doc"]]}
                      for i, r in enumerate(recs)], False),
        "NeMo ids": ([{"query": r["query"], "pos_doc": ids(r, "pos_doc"), "neg_doc": ids(r, "neg_doc")} for r in recs],
                     True),
        "NeMo id objects": ([{"query": r["query"], "pos_doc": [{"id": i} for i in ids(r, "pos_doc")],
                              "neg_doc": [{"id": i} for i in ids(r, "neg_doc")]} for r in recs], True),
        "Tevatron docids": ([{"query": r["query"], "positive_passages": [{"docid": i} for i in ids(r, "pos_doc")],
                              "negative_passages": [{"docid": i} for i in ids(r, "neg_doc")]} for r in recs], True),
    }


FORMAT_OF = {"NeMo inline": "NeMo inline", "NeMo objects": "NeMo inline", "FlagEmbedding": "FlagEmbedding",
             "sentence-transformers columns": "sentence-transformers columns", "Tevatron": "Tevatron",
             "NeMo ids": "NeMo inline", "NeMo id objects": "NeMo inline", "Tevatron docids": "Tevatron"}


def write_corpus(path, recs, packed=False):
    seen = {}
    for r in recs:
        for d in r["pos_doc"] + r["neg_doc"]:
            seen.setdefault(d["id"], d["text"])
    return write_jsonl(path, [{"_id": i, "title": "", "text": t} for i, t in seen.items()], packed), len(seen)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "gzip"])
def test_every_format_reads_the_same_records(tmp_path, packed):
    recs = bundled()
    want = as_tuples(read_records(write_jsonl(tmp_path / "ref.jsonl", nemo_text(recs)), 4)[0])
    assert len(want) == 12 and all(len(neg) == 3 for _, _, neg in want)
    corpus_path, n_docs = write_corpus(tmp_path / "corpus.jsonl", recs, packed)
    corpus = formats.read_corpus(corpus_path)
    assert len(corpus) == n_docs
    for name, (objs, by_id) in formats_of(recs).items():
        path = write_jsonl(tmp_path / f"{name.replace(' ', '_')}.jsonl{'.gz' if packed else ''}", objs, packed)
        got, warnings = read_records(path, 4, formats.read_corpus(corpus_path) if by_id else None)
        assert as_tuples(got) == want, name
        assert warnings == []
        assert f"{FORMAT_OF[name]} format" in got.summary, (name, got.summary)
        if by_id:
            assert len(got.passages) == n_docs  # the corpus's texts, each once, are the passage store


def test_each_passage_text_is_stored_once(tmp_path):
    recs = bundled(40)
    objs = nemo_text(recs) * 3  # every passage three times over
    got = read_records(write_jsonl(tmp_path / "t.jsonl", objs), 2)[0]
    distinct = {t for o in objs for t in o["pos_doc"] + o["neg_doc"]}
    assert len(got) == 120 and len(got.passages) == len(distinct)
    assert as_tuples(got[80:]) == as_tuples(got[:40])


def test_unread_fields_are_named_in_the_summary(tmp_path):
    objs = [dict(o, type="normal", pos_id=[1]) for o in nemo_text(bundled(3))]
    got = read_records(write_jsonl(tmp_path / "t.jsonl", objs))[0]
    assert "fields not read: type (3), pos_id (3)" in got.summary


def test_flagembedding_scores_travel_with_the_sampled_passages_and_prompts_are_prepended(tmp_path):
    rng = random.Random(0)
    objs = []
    for r in nemo_text(bundled(8)):
        objs.append({"query": r["query"], "pos": r["pos_doc"], "neg": r["neg_doc"], "prompt": "Find the package: ",
                     "pos_scores": [rng.random() for _ in r["pos_doc"]], "neg_scores": [rng.random() for _ in r["neg_doc"]]})
    records = read_records(write_jsonl(tmp_path / "flag.jsonl", objs), 3)[0]
    assert "teacher scores kept" in records.summary and "8 records with their own prompt" in records.summary
    for i, (r, o) in enumerate(zip(records, objs)):
        assert r.query == "Find the package: " + o["query"]
        score_of = dict(zip(o["pos"] + o["neg"], o["pos_scores"] + o["neg_scores"]))
        for epoch in range(3):
            texts, scores = data.sample_group_scored(r, 3, data.group_rng(5, epoch, i))
            assert texts == data.sample_group(r, 3, data.group_rng(5, epoch, i))
            assert scores == pytest.approx([score_of[t] for t in texts], abs=1e-6)  # float32 storage


def test_docs_missing_from_the_corpus_are_named(tmp_path):
    recs = bundled(3)
    corpus_path, _ = write_corpus(tmp_path / "corpus.jsonl", recs)
    objs = formats_of(recs)["NeMo ids"][0]
    objs[1]["neg_doc"][2] = "no-such-doc"
    path = write_jsonl(tmp_path / "t.jsonl", objs)
    with pytest.raises(DataError, match=rf"{path}:2: doc id 'no-such-doc' is not in {corpus_path}"):
        read_records(path, 2, formats.read_corpus(corpus_path))
    objs[1]["neg_doc"][2] = {"id": "x"}
    with pytest.raises(DataError, match=r"neg_doc\[2\] is an object without 'text' \(a doc given by id needs "):
        read_records(write_jsonl(tmp_path / "u.jsonl", objs), 2)


def test_records_without_negatives_fail_by_default_and_fill_with_the_flag(tmp_path):
    objs = [{"query": f"query {i}", "pos_doc": [f"positive {i}"], "neg_doc": [] if i % 2 else [f"negative {i}"]}
            for i in range(6)]
    path = write_jsonl(tmp_path / "t.jsonl", objs)
    with pytest.raises(DataError, match=r"3 of 6 record\(s\) have no negatives, but --n-passages 4 needs 3 .*"
                                             r"--fill-negatives random"):
        read_records(path, 4)
    records, warnings = read_records(path, 4, fill="random")
    assert "6 record(s) have fewer than 3 negatives" in warnings[0]
    for i, r in enumerate(records):
        for epoch in range(30):
            group = data.sample_group(r, 4, data.group_rng(1, epoch, i))
            assert group[0] == f"positive {i}" and len(set(group)) == 4  # no repeats, never its own positive
            if i % 2 == 0:
                assert group[1] == f"negative {i}"  # its own negative first, the rest drawn
            assert group == data.sample_group(r, 4, data.group_rng(1, epoch, i))  # deterministic: exact resume
        assert len({tuple(data.sample_group(r, 4, data.group_rng(1, e, i))) for e in range(30)}) > 1
        fixed = data.fixed_group(r, 4)
        assert fixed == data.fixed_group(r, 4) and fixed[0] == f"positive {i}" and len(set(fixed)) == 4
    # with --corpus, a file read later adds its inline texts to the shared store: the pool stays put
    recs = bundled(3)
    corpus = formats.read_corpus(write_corpus(tmp_path / "corpus.jsonl", recs)[0])
    train = read_records(write_jsonl(tmp_path / "ids.jsonl", formats_of(recs)["NeMo ids"][0]), 2, corpus,
                              fill="random")[0]
    pool = train[0].fill_pool
    read_records(write_jsonl(tmp_path / "val.jsonl", bundled(20)[10:]), 2, corpus)  # inline {"id", "text"}
    assert len(corpus.texts) > pool == train[0].fill_pool
    too_few = write_jsonl(tmp_path / "small.jsonl", objs[:1])
    with pytest.raises(DataError, match="--fill-negatives random needs at least 3 passages"):
        read_records(too_few, 4, fill="random")


@pytest.mark.parametrize("line, problem", [
    ({"query": "q", "pos_doc": None}, "field 'pos_doc' is null; a record needs at least one positive"),
    ({"query": "q", "pos_doc": ["p"], "neg_doc": None}, "field 'neg_doc' is null; use [] for none"),
    ({"query": "\udc80", "pos_doc": ["p"]}, "field 'query' has an unpaired surrogate \\udc80"),
    ({"query": "q", "pos_doc": ["ok \ud800"]}, "pos_doc[0] has an unpaired surrogate \\ud800"),
    ({"query": "\x00", "pos_doc": ["p"]}, "field 'query' is empty or only spaces and control characters"),
    ({"query": "\u200b\u200b \ufeff", "pos_doc": ["p"]}, "field 'query' is empty or only spaces"),
    ({"query": 7, "pos_doc": ["p"]}, "field 'query' must be a string, got a number"),
    ({"query": "q", "pos_doc": [{"text": None}]}, "pos_doc[0].text must be a string, got null"),
    ({"query": "q", "pos": ["p"], "pos_scores": [1.0, 2.0]}, "field 'pos_scores' has 2 scores for 1 docs"),
    ({"query": "q", "pos": ["p"], "pos_scores": ["high"]}, "field 'pos_scores' must be a list of finite numbers"),
    ({"query": "q", "pos": ["p"], "prompt": 3}, "field 'prompt' must be a string"),
    ({"anchor": "q", "positive": None}, "field 'positive' must be a string, got null"),
    ({"anchor": "q", "positive": "p", "negative_1": "a", "negative_3": "b"}, "without gaps"),
    ({"query": "q", "positive_passages": [{"docid": "1", "title": "t", "text": None}]},
     "positive_passages[0].text must be a string, got null"),
    ({"query": "q", "positive_passages": []}, "field 'positive_passages' must be a list of passages with at least one"),
])
def test_validation_holes_are_closed(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "t.jsonl", [line])
    with pytest.raises(DataError) as e:
        read_records(path)
    assert f"{path}:1: " in str(e.value) and problem in str(e.value), str(e.value)


def beir_dir(tmp_path, corpus, queries, qrels):
    (tmp_path / "qrels").mkdir(exist_ok=True)
    write_jsonl(tmp_path / "corpus.jsonl", corpus)
    write_jsonl(tmp_path / "queries.jsonl", queries)
    (tmp_path / "qrels" / "test.tsv").write_text(qrels)
    return str(tmp_path)


GOOD_CORPUS = [{"_id": "d1", "title": "", "text": "one"}, {"_id": "d2", "title": "Two", "text": "two"}]
GOOD_QUERIES = [{"_id": "q1", "text": "first"}]
GOOD_QRELS = "query-id\tcorpus-id\tscore\nq1\td1\t1\n"


@pytest.mark.parametrize("part, value, problem", [
    ("corpus", [{"_id": "d1", "text": None}], "corpus.jsonl:1: field 'text' must be a string, got null"),
    ("corpus", [{"_id": "d1", "text": 5}], "corpus.jsonl:1: field 'text' must be a string, got a number"),
    ("corpus", [{"_id": None, "text": "a"}], "corpus.jsonl:1: field '_id' must be a string, got null"),
    ("corpus", GOOD_CORPUS + [{"_id": "d1", "text": "again"}], "corpus.jsonl:3: duplicate _id 'd1' (first at line 1)"),
    ("corpus", [], "corpus.jsonl: no documents (the file is empty)"),
    ("corpus", [{"_id": "d1", "title": "", "text": " "}], "corpus.jsonl:1: the document's title and text is an empty string"),
    ("queries", GOOD_QUERIES * 2, "queries.jsonl:2: duplicate _id 'q1' (first at line 1)"),
    ("queries", [{"_id": "q1", "text": None}], "queries.jsonl:1: field 'text' must be a string, got null"),
    ("qrels", "", "test.tsv: no judgments (the file is empty or only a header)"),
    ("qrels", "query-id\tcorpus-id\tscore\n", "test.tsv: no judgments"),
    ("qrels", "q1\td1\thigh\n", "test.tsv:1: expected 'query-id<TAB>corpus-id<TAB>integer score'"),
])
def test_beir_folders_are_validated(tmp_path, part, value, problem):
    from retrieval_kit.evaluate import load_beir

    parts = {"corpus": GOOD_CORPUS, "queries": GOOD_QUERIES, "qrels": GOOD_QRELS, part: value}
    folder = beir_dir(tmp_path, parts["corpus"], parts["queries"], parts["qrels"])
    with pytest.raises(DataError) as e:
        load_beir(folder)
    assert problem in str(e.value), str(e.value)


def test_a_good_beir_folder_reads(tmp_path):
    from retrieval_kit.evaluate import load_beir

    ids, texts, queries, qrels = load_beir(beir_dir(tmp_path, GOOD_CORPUS, GOOD_QUERIES, GOOD_QRELS))
    assert ids == ["d1", "d2"] and texts == ["one", "Two two"] and queries == {"q1": "first"}
    assert qrels == {"q1": {"d1": 1}}


# ----- fuzz ------------------------------------------------------------------------------------------

BAD_VALUES = [None, 3, 2.5, True, [], {}, "", "   ", "\x00", "\x01\x02", "\u200b\u200b", "\ufeff", "\udc80", "a\ud800b"]


def _set(obj, path, value):
    *head, last = path
    for k in head:
        obj = obj[k]
    obj[last] = value


def _text_paths(obj):
    paths = [("query",)]
    for k in ("pos_doc", "neg_doc"):
        paths += [(k, i, "text") for i in range(len(obj[k]))]
    return paths


def mutations(rng, lines):
    """(description, file bytes, bad line number or None for a file that must load)."""
    objs = [json.loads(l) for l in lines]
    blob = lambda os_: "".join(json.dumps(o) + "\n" for o in os_).encode()  # noqa: E731
    k = rng.randrange(len(objs))
    op = rng.randrange(14)
    o = json.loads(lines[k])
    if op == 0:  # a bad value where a text goes
        p, v = rng.choice(_text_paths(o)), rng.choice(BAD_VALUES)
        _set(o, p, v)
        return f"{p}={v!r}", blob(objs[:k] + [o] + objs[k + 1:]), k + 1
    if op == 1:  # a bad value where a list goes
        f, v = rng.choice(["pos_doc", "neg_doc"]), rng.choice([None, 3, "", {}, True, [None], [5], [{"id": None}]])
        o[f] = v
        return f"{f}={v!r}", blob(objs[:k] + [o] + objs[k + 1:]), k + 1
    if op == 2:  # a missing field
        f = rng.choice(["query", "pos_doc"])
        del o[f]
        return f"no {f}", blob(objs[:k] + [o] + objs[k + 1:]), k + 1
    if op == 3:  # truncated JSON
        raw = json.dumps(o).encode()
        cut = rng.randrange(1, len(raw) - 1)
        return f"cut at {cut}", blob(objs[:k]) + raw[:cut] + b"\n" + blob(objs[k + 1:]), k + 1
    if op == 4:  # bytes that are not UTF-8
        raw = json.dumps(o, ensure_ascii=False).encode()
        at = rng.randrange(len(raw))
        bad = rng.choice([b"\xff", b"\xe9", b"\xc3", b"\x80\x80", b"\xfe\xff"])
        return f"byte {bad!r} at {at}", blob(objs[:k]) + raw[:at] + bad + raw[at:] + b"\n" + blob(objs[k + 1:]), k + 1
    if op == 5:  # not an object
        v = rng.choice([[1, 2], "text", 5, None, True])
        return f"line {v!r}", blob(objs[:k]) + json.dumps(v).encode() + b"\n" + blob(objs[k + 1:]), k + 1
    if op == 6:  # an alias clash
        o["question"] = o["query"]
        return "query and question", blob(objs[:k] + [o] + objs[k + 1:]), k + 1
    if op == 7:  # nested too deeply for the JSON parser
        return "deep", blob(objs[:k]) + b"[" * 100_000 + b"]" * 100_000 + b"\n" + blob(objs[k + 1:]), k + 1
    if op == 8:  # a bad score list
        o = {"query": o["query"], "pos": [d["text"] for d in o["pos_doc"]], "neg": [d["text"] for d in o["neg_doc"]],
             "neg_scores": rng.choice([[1.0], ["x", 1, 2], [float("nan")] * 3, 5, [True] * 3])}
        return f"neg_scores={o['neg_scores']!r}", blob(objs[:k] + [o] + objs[k + 1:]), k + 1
    # files that must load
    if op == 9:
        return "BOM + CRLF", b"\xef\xbb\xbf" + blob(objs).replace(b"\n", b"\r\n"), None
    if op == 10:
        return "gzip", gzip.compress(blob(objs)), None
    if op == 11:  # a huge passage, control characters inside a visible text, other scripts
        p = rng.choice(_text_paths(o))
        _set(o, p, rng.choice(["x" * 200_000, "ab\x00c\x07d", "漢字かな 😀", "  padded  ", "tab\tinside"]))
        return f"{p} unusual but valid", blob(objs[:k] + [o] + objs[k + 1:]), None
    if op == 12:  # unknown fields and blank lines
        o["extra"] = {"nested": [1, 2]}
        return "extra field, blank lines", b"\n" + blob(objs[:k] + [o] + objs[k + 1:]) + b"\n  \n", None
    return "unchanged", blob(objs), None


def test_fuzz_mutated_files_load_or_name_their_line(tmp_path, tokenizer):
    from retrieval_kit.collate import collate_biencoder

    with open(os.path.join(ROOT, "data", "train.jsonl")) as f:
        pool = [l for _, l in zip(range(300), f)]
    rng = random.Random(2026)
    counts = {"raised": 0, "loaded": 0}
    for n in range(1100):
        lines = rng.sample(pool, 3)
        what, blob, bad_line = mutations(rng, lines)
        path = tmp_path / f"m{n}.jsonl"
        path.write_bytes(blob)
        try:
            records = read_records(str(path), 2)[0]
        except DataError as e:
            counts["raised"] += 1
            assert bad_line is not None, f"{what}: a valid file was refused:\n{e}"
            assert f"{path}:{bad_line}: " in str(e) or f"{path}: " in str(e), f"{what}: {e}"
            continue
        except Exception as e:  # noqa: BLE001 - the point: nothing but a DataError
            raise AssertionError(f"mutation {n} ({what}) raised {type(e).__name__}: {e}") from None
        counts["loaded"] += 1
        assert bad_line is None, f"mutation {n} ({what}) was accepted silently"
        queries = [r.query for r in records]
        groups = [data.sample_group(r, 2, data.group_rng(0, 0, i)) for i, r in enumerate(records)]
        q, p = collate_biencoder(tokenizer, queries, groups, 32, 48)
        assert q["input_ids"].shape[0] == len(records) and p["input_ids"].shape[0] == 2 * len(records)
    assert counts["raised"] > 500 and counts["loaded"] > 200, counts


def test_fuzz_mutated_corpora_load_or_name_their_line(tmp_path):
    rng = random.Random(7)
    docs = [{"_id": f"d{i}", "title": rng.choice(["", "Title"]), "text": f"passage number {i}"} for i in range(5)]
    raised = 0
    for n in range(200):
        objs = [dict(d) for d in docs]
        k = rng.randrange(len(objs))
        field, value = rng.choice([("_id", v) for v in BAD_VALUES + ["d0", "d1"]] + [("text", v) for v in BAD_VALUES]
                                  + [("title", v) for v in (3, [], {}, None, "")])
        objs[k][field] = value
        if field == "_id":  # every bad value, and an id another document has
            bad = value != f"d{k}"
        elif field == "title":
            bad = value is not None and not isinstance(value, str)
        else:  # a text may be blank when the title is not; never a non-string or invalid Unicode
            bad = not isinstance(value, str) or "\ud800" in value or "\udc80" in value or \
                (not objs[k]["title"] and formats.text_problem(value) is not None)
        path = write_jsonl(tmp_path / f"c{n}.jsonl", objs)
        try:
            corpus = formats.read_corpus(path)
        except DataError as e:
            raised += 1
            assert bad and (f"{path}:{k + 1}: " in str(e) or f"(first at line {k + 1})" in str(e)), (field, value, str(e))
            continue
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"{field}={value!r} raised {type(e).__name__}: {e}") from None
        assert not bad, (field, value)
        assert len(corpus) == 5 and all(formats.text_problem(corpus.texts[i]) is None for i in range(5))
    assert raised > 100


def _outcome(read, path):
    """What reading `path` gives: the error's text, or every record's (or document's) contents."""
    try:
        got = read(path)
    except DataError as e:
        return "error", str(e)
    if isinstance(got, tuple):  # read_records: (records, warnings)
        records = got[0]
        return "records", [repr((r.where, r.query, r.pos, r.neg, r.prompt, r.pos_scores, r.neg_scores))  # (NaN scores)
                           for r in records]
    return "corpus", [(got.ids[i], got.texts[i], got.lines[i]) for i in range(len(got))]


def test_the_plain_record_fast_path_reads_what_the_full_checks_read(tmp_path, monkeypatch):
    """A plain record or document (lists of ASCII strings that start with a letter or digit, nothing
    optional) skips the per-field checks; every mutated file must read the same, record for record
    and message for message, as with that path switched off. The glance's premise: no character
    Python calls alphanumeric is a control, format or space character (category C or Z)."""
    import sys
    import unicodedata

    assert not [c for c in range(sys.maxunicode + 1) if chr(c).isalnum() and unicodedata.category(chr(c))[0] in "CZ"]
    with open(os.path.join(ROOT, "data", "train.jsonl")) as f:
        pool = [l for _, l in zip(range(300), f)]
    rng = random.Random(29)
    cases = []
    for n in range(400):
        what, blob, _ = mutations(rng, rng.sample(pool, 3))
        path = tmp_path / f"m{n}.jsonl"
        path.write_bytes(blob)
        cases.append((lambda p: read_records(p, 2), str(path)))
    base = {"query": "a query", "pos_doc": ["the positive"], "neg_doc": ["a negative", "another one"]}
    for n, change in enumerate([{}, {"prompt": "Represent: "}, {"prompt": None}, {"pos_scores": [1.0]},
                                {"pos_scores": [1.0], "neg_scores": [0.5, 0.2]}, {"neg_scores": None},
                                {"question": "q"}, {"pos": ["p"]}, {"neg": ["n"]}, {"pos_doc": "one string"},
                                {"pos_doc": []}, {"neg_doc": None}, {"neg_doc": []}, {"neg_doc": [{"text": "t"}]},
                                {"query": "trailing "}, {"query": "é"}, {"neg_doc": ["ok", " lead"]}]):
        obj = {**base, **change}
        flag = {"query": obj.pop("query"), "pos": obj.pop("pos_doc"), "neg": obj.pop("neg_doc"), **obj} \
            if "pos" not in change and "neg" not in change else None
        for k, o in enumerate([{**base, **change}, flag]):
            if o is not None:
                path = write_jsonl(tmp_path / f"r{n}_{k}.jsonl", [base, o])
                cases.append((lambda p: read_records(p, 2), path))
    for n, (title, text, doc_id) in enumerate([("", "plain text", "d1"), (None, "plain", "x"), ("T", "t", "d"),
                                               ("", " lead", "d"), ("", "text", " id"), ("", "é", "d"), (0, "t", "d"),
                                               ("", "t\ud800", "d"), ("", "t", "\u200b"), ("", "t", 5),
                                               ("", "trailing  ", "d")]):
        path = write_jsonl(tmp_path / f"c{n}.jsonl", [{"_id": "a", "text": "first doc"},
                                                      {"_id": doc_id, "title": title, "text": text}])
        cases.append((formats.read_corpus, path))
    fast = [_outcome(read, path) for read, path in cases]
    monkeypatch.setattr(formats, "plain_text", lambda value: False)
    slow = [_outcome(read, path) for read, path in cases]
    assert fast == slow
    kinds = [o[0] for o in fast]
    assert kinds.count("error") > 100 and kinds.count("records") > 100 and kinds.count("corpus") >= 3, kinds


@pytest.mark.parametrize("blob,says", [
    (b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00\x12\x00\x00" + b"\x00" * 40, "a Parquet file, not text"),
    (b'[{"query": "q", "pos_doc": ["p"], "neg_doc": ["n"]},\n {"query": "r", "pos_doc": ["p"]}]\n',
     "one JSON array, not JSON Lines"),
    (b"anchor,positive,negative\nwhat is a,a is,b is\n", "a CSV file (first line: anchor, positive, negative)"),
    (b"query\tpositive\nq\tp\n", "a TSV file (first line: query, positive)"),
])
def test_a_file_in_another_format_is_one_sentence_naming_it(tmp_path, blob, says):
    path = tmp_path / "train.jsonl"
    path.write_bytes(blob)
    with pytest.raises(DataError) as e:
        read_records(str(path), 2)
    assert str(e.value).startswith(f"{path}: {says}") and "\n" not in str(e.value), str(e.value)
    assert "convert it" in str(e.value) or "write it as JSON Lines" in str(e.value)


def test_a_records_prompt_replaces_the_query_prefix_as_flagembedding_builds_it(tmp_path, tokenizer):
    """FlagEmbedding: a record's "prompt" is the instruction for that query, instead of the default
    one (its query_instruction_format "{}{}": prompt + query); records without one get --query-prefix."""
    from retrieval_kit.collate import biencoder_inputs

    rows = nemo_text(bundled(2))
    objs = [{"query": rows[0]["query"], "pos": rows[0]["pos_doc"], "neg": rows[0]["neg_doc"], "prompt": "Find: "},
            {"query": rows[1]["query"], "pos": rows[1]["pos_doc"], "neg": rows[1]["neg_doc"]}]
    records = read_records(write_jsonl(tmp_path / "flag.jsonl", objs), 2)[0]
    batch = biencoder_inputs([r.query for r in records], [[r.pos[0], r.neg[0]] for r in records], tokenizer=tokenizer,
                             query_max_length=64, passage_max_length=64, query_prefix="query: ")
    ids = batch["q"].batch["input_ids"]  # unchunked: the rows in batch order
    want = [tokenizer("Find: " + objs[0]["query"])["input_ids"], tokenizer("query: " + objs[1]["query"])["input_ids"]]
    for row, w in zip(ids.tolist(), want):
        assert row[:len(w)] == w and not any(row[len(w):])  # the ids, then padding
