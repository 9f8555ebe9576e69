"""retrieval_kit/mine.py: the mining window, the false-negative filter and the entry point."""

import json
import os
import subprocess
import sys

import pytest
import torch

from retrieval_kit.mine import mine_hard_negatives
from tests.conftest import python_run, read_jsonl, ROOT, run_module


def test_mining_window_and_false_negative_filter():
    q = torch.tensor([[1.0, 0.0]])
    p = torch.tensor([[1.0, 0.0], [0.99, 0.14], [0.9, 0.43], [0.8, 0.6], [0.5, 0.87], [1.0, 0.0]])
    texts = ["pos", "near-dup", "b", "c", "d", "pos"]  # index 5 is the positive's exact text again
    assert mine_hard_negatives(q, p, [[0]], k=3, max_score_ratio=None, p_texts=texts) == [[1, 2, 3]]
    assert mine_hard_negatives(q, p, [[0]], k=3, max_score_ratio=0.95, p_texts=texts) == [[2, 3, 4]]
    assert mine_hard_negatives(q, p, [[0]], k=2, skip_top=1, max_score_ratio=None, p_texts=texts) == [[2, 3]]


def test_the_candidate_pool_reads_and_finds_texts_as_a_list_and_a_dict_would(tmp_path):
    """mine's CandidatePool (the corpora's stores, no string per passage) against the plain lists
    it replaced: the same text at every position, a positive at its last position among the corpora
    (a dict of text -> position built in order keeps the last), texts found nowhere added once at
    the end, and equal keys exactly where the texts are equal (the duplicate filter's test)."""
    from retrieval_kit.formats import read_corpus
    from retrieval_kit.mine import CandidatePool

    def corpus(name, texts):
        with open(tmp_path / name, "w") as f:
            f.writelines(json.dumps({"_id": f"{name}{i}", "text": t}) + "\n" for i, t in enumerate(texts))
        return read_corpus(str(tmp_path / name))
    a, b = ["one", "two", "one", "three", "é accent"], ["two", "four", "one"]
    pool = CandidatePool([corpus("a", a), corpus("b", b)])
    texts = a + b
    index = {t: i for i, t in enumerate(texts)}
    asked = ["one", "five", "two", "five", "six", "é accent", "four"]
    want = []
    for t in asked:
        if t not in index:
            index[t] = len(texts)
            texts.append(t)
        want.append(index[t])
    assert pool.positions(asked) == want == [7, 8, 5, 8, 9, 4, 6]
    assert len(pool) == len(texts) and [pool[j] for j in range(len(pool))] == texts
    assert len(pool.keys) == len(texts)
    assert all((pool.keys[i] == pool.keys[j]) == (texts[i] == texts[j]) for i in range(len(texts))
               for j in range(len(texts)))


@pytest.mark.slow
def test_mine_entry_point(tiny_model_dir, small_beir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line for line in open(os.path.join(ROOT, "data", "val.jsonl")).readlines()[:5]))
    out = tmp_path / "mined.jsonl"
    run_module(["-m", "retrieval_kit.mine", "--input", src, "--candidates", os.path.join(small_beir, "corpus.jsonl"),
                "--out", out, "--model", tiny_model_dir, "--k", 4, "--max-score-ratio", 0])
    rows = read_jsonl(out)
    assert len(rows) == 5
    for r in rows:
        pos = [d["text"] if isinstance(d, dict) else d for d in r["pos_doc"]]
        assert len(r["neg_doc"]) == 4 and not set(r["neg_doc"]) & set(pos)


@pytest.mark.slow
def test_mine_leaves_out_queries_with_no_negative(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line for line in open(os.path.join(ROOT, "data", "val.jsonl")).readlines()[:3]))
    out = tmp_path / "sub" / "mined.jsonl"  # the folder does not exist yet
    # a score ratio far below any candidate's: every candidate is dropped as a likely false negative
    proc = run_module(["-m", "retrieval_kit.mine", "--input", src, "--out", out, "--model", tiny_model_dir,
                       "--k", 2, "--max-score-ratio", 1e-6])
    assert read_jsonl(out) == []
    assert "3 left out" in proc.stdout


@pytest.mark.slow
def test_docs_by_id_in_every_style_mine_as_the_same_records_inline(tiny_model_dir, small_beir, tmp_path):
    """--corpus resolves ids in --input as training does (NeMo strings, {"id"} objects, Tevatron
    docids); the mined file equals the one mined from the same records written with their texts."""
    corpus = os.path.join(small_beir, "corpus.jsonl")
    docs = read_jsonl(corpus)
    text = {d["_id"]: (d.get("title", "") + " " + d["text"]).strip() for d in docs}
    picks = [(f"what is {docs[i]['text'][:30]}", docs[i]["_id"]) for i in range(0, 40, 8)]
    styles = {"inline": [{"query": q, "pos_doc": [text[d]]} for q, d in picks],
              "nemo ids": [{"query": q, "pos_doc": [d]} for q, d in picks],
              "id objects": [{"query": q, "pos_doc": [{"id": d}]} for q, d in picks],
              "tevatron": [{"query": q, "positive_passages": [{"docid": d}]} for q, d in picks]}
    mined = {}
    for name, rows in styles.items():
        src, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.mined.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        pool = ["--candidates", corpus] if name == "inline" else ["--corpus", corpus]
        run_module(["-m", "retrieval_kit.mine", "--input", src, *pool, "--out", out, "--model", tiny_model_dir,
                    "--k", 3, "--max-score-ratio", 0])
        mined[name] = read_jsonl(out)
    assert len(mined["inline"]) == len(picks) and all(len(r["neg_doc"]) == 3 for r in mined["inline"])
    for name in styles:
        assert mined[name] == mined["inline"], name


def test_mine_refuses_to_overwrite_its_out_or_its_input(tmp_path):
    src, old = tmp_path / "in.jsonl", tmp_path / "old.jsonl"
    src.write_text(open(os.path.join(ROOT, "data", "val.jsonl")).readline())
    old.write_text("keep me\n")
    for extra, says in ((["--out", src, "--overwrite"], f"--out {src} is the command's input (--input"),  # even so
                        (["--out", old], f"--out {old} exists: pass --overwrite to replace it")):
        out = python_run(["-m", "retrieval_kit.mine", "--input", src, *extra])
        assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert old.read_text() == "keep me\n" and src.read_text().startswith("{")


KILLED_AFTER_TWO_BLOCKS = """
import os, signal, sys
from retrieval_kit import encode, mine
real, calls = encode.encode_texts, []
def killing(*a, **k):
    calls.append(1)
    if len(calls) == 3:  # two blocks of passages saved, the third being encoded
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
encode.encode_texts = killing
mine.main(sys.argv[1:])
"""

KILLED_AFTER_TWO_ROUNDS = """
import os, signal, sys
from retrieval_kit import mine
real, calls = mine.save_negatives, []
def killing(*a, **k):
    calls.append(1)
    if len(calls) == 3:  # two search rounds' negatives saved, the third about to be
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
mine.save_negatives = killing
mine.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_mining_killed_then_resumed_on_two_ranks_writes_the_one_rank_file(tiny_model_dir, small_beir, tmp_path):
    """A one-rank run killed after 2 of its blocks, resumed on one rank and killed after 2 search rounds
    (4 queries' negatives saved), resumed on 2 ranks: each rank reads or encodes its blocks of the 69
    candidates and searches them for the queries left, 2 per rank a round (the 9
    queries are one block of 9, on rank 0: rank 1 has none to send, and searches for rank 0's); the file
    equals a one-rank run's in one go, line for line (batches of one text, so both worlds embed every
    text bitwise alike), with the false-negative filter on, whose best positive score may come from the
    other rank's candidates. A resume with other settings is refused."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line for line in open(os.path.join(ROOT, "data", "val.jsonl")).readlines()[:9]))
    args = ["--input", src, "--candidates", os.path.join(small_beir, "corpus.jsonl"), "--model", tiny_model_dir,
            "--k", 5, "--max-score-ratio", 1, "--depth", 30, "--batch-size", 1, "--query-block", 2,
            "--block-size", 9]
    one = run_module(["-m", "retrieval_kit.mine", *args, "--out", tmp_path / "one.jsonl"])
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_TWO_BLOCKS, *map(str, args), "--out",
                             str(tmp_path / "two.jsonl")], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    assert killed.returncode == -9, killed.stderr[-2000:]
    parts = tmp_path / "two.jsonl.parts"
    assert sorted(p.name for p in parts.glob("*.pt")) == ["passages_000000.pt", "passages_000001.pt"]
    other = python_run(["-m", "retrieval_kit.mine", *args[:-1], 8, "--out", tmp_path / "two.jsonl"])
    assert other.returncode == 1 and "block_size: 9 then, 8 now" in other.stderr, other.stderr[-2000:]
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_TWO_ROUNDS, *map(str, args), "--out",
                             str(tmp_path / "two.jsonl")], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    assert killed.returncode == -9, killed.stderr[-2000:]  # the encoding finished, two rounds of 2 queries saved
    assert sorted(p.name for p in parts.glob("negatives_*.json")) == ["negatives_000000000.json",
                                                                     "negatives_000000002.json"]
    other = python_run(["-m", "retrieval_kit.mine", *args[:7], 4, *args[8:], "--out", tmp_path / "two.jsonl"])
    assert other.returncode == 1 and "'k': 5" in other.stderr and "'k': 4" in other.stderr, other.stderr[-2000:]
    two = run_module(["-m", "retrieval_kit.mine", *args, "--out", tmp_path / "two.jsonl"], nproc=2)
    assert "(1 rank" in one.stdout and "(2 ranks" in two.stdout, two.stdout
    assert "the negatives of 4 of the 9 queries were saved" in two.stdout, two.stdout
    assert read_jsonl(tmp_path / "two.jsonl") == read_jsonl(tmp_path / "one.jsonl")
    assert not parts.exists() and not (tmp_path / "one.jsonl.parts").exists()
    rows = read_jsonl(tmp_path / "one.jsonl")
    assert 5 <= len(rows) < 9 or any(len(r["neg_doc"]) < 5 for r in rows)  # records kept, and the filter at work
