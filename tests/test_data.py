import json
import os
import random

import pytest

from retrieval_kit import data
from retrieval_kit.formats import DataError
from retrieval_kit.records import Record, read_records
from tests.conftest import python_run, ROOT


def write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_aliases_and_doc_objects(tmp_path):
    path = write(tmp_path, [
        json.dumps({"query": "q1", "pos_doc": ["p1"], "neg_doc": ["n1", {"id": 7, "text": "n2"}]}),
        json.dumps({"question": "q2", "pos": [{"text": "p2"}], "neg": ["n3"]}),
    ])
    recs, warnings = read_records(path)
    assert [(r.query, r.pos, r.neg) for r in recs] == [("q1", ["p1"], ["n1", "n2"]), ("q2", ["p2"], ["n3"])]
    assert recs[1].where == f"{path}:2"
    assert warnings == []


def test_every_bad_line_reported_with_file_and_line(tmp_path):
    good = json.dumps({"query": "q", "pos_doc": ["p"], "neg_doc": ["n"]})
    path = write(tmp_path, [
        good,
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"pos_doc": ["p"]}),
        json.dumps({"query": "  ", "pos_doc": ["p"]}),
        json.dumps({"query": "q", "pos_doc": []}),
        json.dumps({"query": "q", "pos_doc": [3]}),
        json.dumps({"query": "q", "question": "q", "pos_doc": ["p"]}),
        json.dumps({"query": "q", "pos_doc": ["p"], "neg_doc": [{"id": 1}]}),
        json.dumps({"query": "q"}),
    ])
    with pytest.raises(DataError) as e:
        read_records(path)
    msg = str(e.value)
    expected = {2: "invalid JSON", 3: "expected a JSON object", 4: "missing field 'query'",
                5: "is empty or only spaces", 6: "at least one positive", 7: "pos_doc[0] must be a string",
                8: "both 'query' and 'question'", 9: "neg_doc[0] is an object without", 10: "missing field 'pos_doc'"}
    for line, text in expected.items():
        hits = [m for m in msg.splitlines() if m.startswith(f"{path}:{line}: ")]
        assert hits, f"line {line} not reported:\n{msg}"
        assert any(text in h for h in hits), (line, hits)
    assert f"{path}:1:" not in msg


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(DataError, match="cannot open"):
        read_records(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="empty"):
        read_records(write(tmp_path, [""]))


def test_negatives_needed_for_groups(tmp_path):
    path = write(tmp_path, [
        json.dumps({"query": "q", "pos_doc": ["p"], "neg_doc": ["n"]}),
        json.dumps({"query": "q", "pos_doc": ["p"]}),
    ])
    with pytest.raises(DataError, match=rf"1 of 2 record\(s\) have no negatives, but --n-passages 3 needs 2 "
                                             rf"per group \(first: {path}:2\); pass --fill-negatives random"):
        read_records(path, n_passages=3)
    recs, warnings = read_records(write(tmp_path, [json.dumps({"query": "q", "pos_doc": ["p"], "neg_doc": ["n"]})],
                                             "ok.jsonl"), n_passages=3)
    assert len(warnings) == 1 and "with replacement" in warnings[0] and "ok.jsonl:1" in warnings[0]


def test_sample_group_without_then_with_replacement():
    rec = Record("q", ["p"], ["a", "b", "c", "d"])
    for seed in range(20):
        g = data.sample_group(rec, 4, random.Random(seed))
        assert g[0] == "p" and len(set(g[1:])) == 3 and set(g[1:]) <= set(rec.neg)
    small = Record("q", ["p"], ["a"])
    assert data.sample_group(small, 3, random.Random(0)) == ["p", "a", "a"]


def test_negatives_resampled_each_epoch():
    rec = Record("q", ["p"], [f"n{i}" for i in range(10)])
    draws = {tuple(data.sample_group(rec, 3, data.group_rng(1, epoch, 5))) for epoch in range(10)}
    assert len(draws) > 1
    assert data.sample_group(rec, 3, data.group_rng(1, 2, 5)) == data.sample_group(rec, 3, data.group_rng(1, 2, 5))


def test_rank_batches_partition_the_global_batch():
    order = data.epoch_order(100, seed=3, epoch=0)
    assert sorted(order) == list(range(100))
    assert order != data.epoch_order(100, seed=3, epoch=1)
    for step in range(data.steps_per_epoch(100, 4, 3)):
        parts = [data.rank_batch(order, step, 4, r, 3) for r in range(3)]
        assert sum(parts, []) == data.rank_batch(order, step, 12, 0, 1)  # world 1, same global batch


def test_shard_covers_everything_once():
    items = list(range(11))
    assert sum((data.shard(items, r, 3) for r in range(3)), []) == items


def _first_lines(n):
    with open(os.path.join(ROOT, "data", "train.jsonl"), "rb") as f:
        return [next(f) for _ in range(n)]


def test_gzipped_file_reads_as_the_plain_one(tmp_path):
    import gzip

    lines = _first_lines(20)
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    plain.write_bytes(b"".join(lines))
    packed.write_bytes(gzip.compress(b"".join(lines)))
    misnamed = tmp_path / "t2.jsonl"  # compressed, named as plain: told by its first bytes
    misnamed.write_bytes(gzip.compress(b"".join(lines)))
    want = read_records(str(plain), 2)[0]
    for path in (packed, misnamed):
        got = read_records(str(path), 2)[0]
        assert [(r.query, r.pos, r.neg) for r in got] == [(r.query, r.pos, r.neg) for r in want]


def test_undecodable_lines_are_each_named_with_the_other_problems(tmp_path):
    lines = _first_lines(8)
    lines[2] = lines[2].replace(b"a", b"\xe9", 1)  # latin-1 byte
    lines[4] = b"{not json\n"
    lines[6] = b"\xff" + lines[6]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(lines))
    with pytest.raises(DataError) as e:
        read_records(str(path), 2)
    msg = str(e.value)
    assert msg.startswith("3 problem(s)")
    assert f"{path}:3: not UTF-8 text" in msg and f"{path}:7: not UTF-8 text (byte 0xff at byte 1" in msg
    assert f"{path}:5: invalid JSON" in msg


def test_bom_and_crlf_are_read(tmp_path):
    lines = [l.rstrip(b"\n") + b"\r\n" for l in _first_lines(4)]
    path = tmp_path / "win.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(lines))
    records = read_records(str(path), 2)[0]
    assert len(records) == 4 and not records[0].query.startswith("\ufeff")


def test_truncated_gzip_is_one_message(tmp_path):
    import gzip

    blob = gzip.compress(b"".join(_first_lines(200)))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(blob[:len(blob) // 2])
    with pytest.raises(DataError, match=f"{path}: the gzip stream is truncated or corrupt after line"):
        read_records(str(path), 2)


def test_gzipped_beir_folder(tmp_path):
    import gzip
    import shutil

    from retrieval_kit.evaluate import load_beir

    src = os.path.join(ROOT, "data", "eval")
    (tmp_path / "qrels").mkdir()
    for name in ("corpus.jsonl", "queries.jsonl", os.path.join("qrels", "test.tsv")):
        with open(os.path.join(src, name), "rb") as f, gzip.open(tmp_path / (name + ".gz"), "wb") as out:
            shutil.copyfileobj(f, out)
    assert load_beir(str(tmp_path)) == load_beir(src)


@pytest.mark.parametrize("entry", [["train_biencoder.py", "--train-file"], ["train_reranker.py", "--train-file"],
                                   ["-m", "retrieval_kit.mine", "--out", "unused.jsonl", "--input"]])
@pytest.mark.slow
def test_a_bad_file_is_one_message_not_a_traceback(tmp_path, entry):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff" + _first_lines(1)[0] + b"{nope\n")
    cmd = ([os.path.join(ROOT, entry[0])] + entry[1:] if entry[0] != "-m" else entry) + [str(bad)]
    out = python_run(cmd, cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"{bad}:1: not UTF-8 text" in out.stderr and f"{bad}:2: invalid JSON" in out.stderr


def test_dev_queries_are_held_out_of_training_by_a_seeded_draw(small_train_file):
    from retrieval_kit.data import TrainFile
    from retrieval_kit.records import Subset, hold_out_dev, read_records

    records, _ = read_records(small_train_file, 2)
    files, (ids, texts, queries, qrels), said = hold_out_dev([TrainFile(records)], 8, 100, seed=3)
    kept = [r.query for r in files[0].records]
    assert len(kept) == 56 and len(queries) == 8 and "8 training records held out (seed 3)" in said
    assert not set(queries.values()) & set(kept)  # (the 64 records' queries are distinct)
    by_text = dict(zip(ids, texts))
    for qid, rel in qrels.items():
        held = next(r for r in records if r.query == queries[qid])
        assert {by_text[d] for d in rel} == set(held.pos) and set(held.neg) <= set(texts)
    assert len(texts) == 100 and len(set(texts)) == 100  # the groups' passages + a sample, up to the size
    again = hold_out_dev([TrainFile(records)], 8, 100, seed=3)
    assert again[1][2] == queries and again[1][1] == texts  # a resume holds out the same
    assert hold_out_dev([TrainFile(records)], 8, 100, seed=4)[1][2] != queries
    # keyed by query text: the same queries in another order (a mined file of the same data) hold out the same
    shuffled = Subset(records, list(range(len(records) - 1, -1, -1)))
    assert set(hold_out_dev([TrainFile(shuffled)], 8, 100, seed=3)[1][2].values()) == set(queries.values())
    import pickle  # DataLoader workers get the kept records pickled

    copy = pickle.loads(pickle.dumps(files[0].records))
    assert [r.query for r in copy] == kept and copy.summary == records.summary
    with pytest.raises(SystemExit, match="--dev-queries 64: the training files hold 64 records"):
        hold_out_dev([TrainFile(records)], 64, 100, seed=3)
