"""datacache: a parsed file read back from its mapped cache equals the plain parse; a stale or
damaged entry is rebuilt with a warning, a killed build leaves nothing that looks complete, and two
processes reading at once build it once."""

import json
import os
import subprocess
import sys

import pytest
import torch

from retrieval_kit import datacache, formats, records as records_mod
from retrieval_kit.records import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_data(folder, n=40):
    """A corpus, a training file mixing corpus ids and inline texts (with scores and a prompt), and
    an inline-only file."""
    os.makedirs(folder, exist_ok=True)
    corpus, by_id, inline = (os.path.join(folder, f) for f in ("corpus.jsonl", "by_id.jsonl", "inline.jsonl"))
    with open(corpus, "w") as f:
        for i in range(n):
            f.write(json.dumps({"_id": f"d{i}", "title": f"t{i}", "text": f"passage {i} é {'x' * (i % 7)}"}) + "\n")
    with open(by_id, "w") as f:
        for i in range(n):
            f.write(json.dumps({"query": f"query {i}", "pos_doc": [{"id": f"d{i}"}],
                                "neg_doc": [{"id": f"d{(i + 1) % n}"}, {"text": f"inline negative {i % 5} 漢字"}]}) + "\n")
    with open(inline, "w") as f:
        for i in range(n):
            obj = {"query": f"q {i}", "pos": [f"pos {i}"], "neg": [f"neg {i}", f"neg {i + 1}", f"neg {i + 2}"],
                   "pos_scores": [1.0 + i], "neg_scores": [0.5, 0.25, 0.0]}
            if i % 3 == 0:
                obj["prompt"] = "Represent this: "
            f.write(json.dumps(obj) + "\n")
    return corpus, by_id, inline


def view(records):
    return [(r.query, list(r.pos), list(r.neg), r.pos_ids, r.neg_ids, r.pos_scores, r.neg_scores, r.where)
            for r in records]


def read_both(corpus_path, by_id, inline, cache):
    corpus = formats.read_corpus(corpus_path, cache)
    a, wa = read_records(by_id, 3, corpus, cache=cache)
    b, wb = read_records(inline, 3, cache=cache)
    return (corpus.find([f"d{i}" for i in range(45)]).tolist(), [corpus.texts[j] for j in range(len(corpus.texts))],
            [corpus.ids[j] for j in range(len(corpus.ids))], view(a), wa, a.summary, view(b), wb, b.summary,
            a.digest or formats.file_digest(by_id))


def no_parse(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("parsed although the cache should have been read")
    monkeypatch.setattr(records_mod, "parse_records", fail)
    monkeypatch.setattr(formats, "_parse_corpus", fail)


def test_cached_reads_equal_the_plain_parse(tmp_path, monkeypatch):
    files = write_data(tmp_path / "data")
    plain = read_both(*files, None)
    cache = str(tmp_path / "cache")
    assert read_both(*files, cache) == plain  # built
    assert len(os.listdir(cache)) == 6  # 3 entries and their lock files
    no_parse(monkeypatch)
    assert read_both(*files, cache) == plain  # mapped
    assert plain[-1] == formats.file_digest(files[1])


def test_auto_caches_beside_large_files_only(tmp_path, monkeypatch):
    files = write_data(tmp_path / "data")
    plain = read_both(*files, None)
    assert read_both(*files, "auto") == plain
    assert not any(".rkcache" in n for n in os.listdir(tmp_path / "data"))  # small files: no cache
    monkeypatch.setattr(datacache, "AUTO_MIN_BYTES", 0)
    assert read_both(*files, "auto") == plain
    assert os.path.isfile(tmp_path / "data" / ".inline.jsonl.rkcache" / "meta.json")
    no_parse(monkeypatch)
    assert read_both(*files, "auto") == plain


def test_a_changed_source_is_rebuilt_with_a_warning(tmp_path, capsys):
    corpus, by_id, inline = write_data(tmp_path / "data")
    cache = str(tmp_path / "cache")
    read_both(corpus, by_id, inline, cache)
    capsys.readouterr()
    # same size, same mtime, other content: the hash of the content catches it
    st = os.stat(inline)
    text = open(inline).read().replace('"q 7"', '"q 8"')
    open(inline, "w").write(text)
    os.utime(inline, ns=(st.st_atime_ns, st.st_mtime_ns))
    got, _ = read_records(inline, 3, cache=cache)
    assert "stale" in capsys.readouterr().err
    assert got[7].bare_query == "q 8"
    # a mid-file edit, same size and mtime restored (issue 41: the head and tail hash missed it)
    big = 3 * (1 << 20) // len(text.splitlines()[0]) + 1  # lines enough for more than 2 MiB: an edit neither
    lines = [json.dumps({"query": f"q {i}", "pos": [f"pos {i}"], "neg": [f"neg {i}"]}) for i in range(big)]
    open(inline, "w").write("\n".join(lines) + "\n")  # in the first nor in the last MiB
    read_records(inline, 2, cache=cache)
    capsys.readouterr()
    st = os.stat(inline)
    middle = len(lines) // 2
    lines[middle] = lines[middle].replace(f'"q {middle}"', f'"Q {middle}"')
    open(inline, "w").write("\n".join(lines) + "\n")
    os.utime(inline, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(inline).st_size == st.st_size
    got, _ = read_records(inline, 2, cache=cache)
    assert "stale" in capsys.readouterr().err and got[middle].bare_query == f"Q {middle}"
    os.utime(inline)  # touched, not changed: the entry is still good
    read_records(inline, 2, cache=cache)
    assert "stale" not in capsys.readouterr().err
    # the corpus a training file's ids refer to changed: the training file's entry is stale too
    with open(corpus, "a") as f:
        f.write(json.dumps({"_id": "d_new", "text": "one more"}) + "\n")
    read_records(by_id, 3, formats.read_corpus(corpus, cache), cache=cache)
    assert capsys.readouterr().err.count("stale") == 2


def _damage(entry, how):
    if how == "truncated":
        path = os.path.join(entry, "passages_buf")
        os.truncate(path, os.path.getsize(path) - 3)
    elif how == "overwritten":
        path = os.path.join(entry, "passages_buf")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            f.write(b"#")
    elif how == "meta":
        with open(os.path.join(entry, "meta.json"), "w") as f:
            f.write('{"version": 1, "key": ')
    elif how == "missing":
        os.remove(os.path.join(entry, "neg_ids"))


@pytest.mark.parametrize("how", ["truncated", "overwritten", "meta", "missing"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(tmp_path, capsys, how):
    _, _, inline = write_data(tmp_path / "data")
    cache = str(tmp_path / "cache")
    plain = view(read_records(inline, 3)[0])
    read_records(inline, 3, cache=cache)
    _damage(datacache.entry_path(inline, cache), how)
    capsys.readouterr()
    assert view(read_records(inline, 3, cache=cache)[0]) == plain
    assert "is damaged" in capsys.readouterr().err
    assert view(read_records(inline, 3, cache=cache)[0]) == plain
    assert capsys.readouterr().err == ""  # rebuilt: read without a word


KILL_DURING_BUILD = """
import os, signal, sys
from retrieval_kit import datacache
from retrieval_kit.records import read_records
digest, calls = datacache._sample_digest, []
def killing(a):
    calls.append(1)
    if len(calls) == 4:  # in the middle of writing the arrays
        os.kill(os.getpid(), signal.SIGKILL)
    return digest(a)
datacache._sample_digest = killing
read_records(sys.argv[1], 3, cache=sys.argv[2])
"""


def test_a_build_killed_midway_leaves_nothing_that_looks_complete(tmp_path, capsys):
    _, _, inline = write_data(tmp_path / "data")
    cache = str(tmp_path / "cache")
    rc = subprocess.run([sys.executable, "-c", KILL_DURING_BUILD, inline, cache], cwd=ROOT).returncode
    assert rc == -9
    entry = datacache.entry_path(inline, cache)
    assert not os.path.exists(entry) and any(".tmp" in n for n in os.listdir(cache))
    assert view(read_records(inline, 3, cache=cache)[0]) == view(read_records(inline, 3)[0])
    assert os.path.isfile(os.path.join(entry, "meta.json"))
    assert not any(".tmp" in n for n in os.listdir(cache))  # the killed build's leftovers are cleared


CONCURRENT_READ = """
import sys, time
from retrieval_kit import records
parse = records.parse_records
def slow(*a, **k):
    print("parsed", flush=True)
    time.sleep(1.5)  # long enough that the other process asks meanwhile
    return parse(*a, **k)
records.parse_records = slow
got, _ = records.read_records(sys.argv[1], 3, cache=sys.argv[2])
print(len(got), got[5].query, list(got[5].neg), flush=True)
"""


def test_processes_reading_at_once_build_once(tmp_path):
    _, _, inline = write_data(tmp_path / "data")
    cache = str(tmp_path / "cache")
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_READ, inline, cache], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sum(o.count("parsed") for o in outs) == 1
    assert len({o.splitlines()[-1] for o in outs}) == 1


def test_an_unwritable_cache_place_reads_without_one(tmp_path, capsys):
    _, _, inline = write_data(tmp_path / "data")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    got = view(read_records(inline, 3, cache=str(blocker / "cache"))[0])
    assert got == view(read_records(inline, 3)[0])
    assert "cannot use the data cache" in capsys.readouterr().err


class _Views(torch.utils.data.Dataset):
    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        return r.query, list(r.pos), list(r.neg)


def _as_is(sample):
    return sample


def test_dataloader_workers_read_the_mapped_records(tmp_path):
    corpus, by_id, _ = write_data(tmp_path / "data")
    cache = str(tmp_path / "cache")
    read_records(by_id, 3, formats.read_corpus(corpus, cache), cache=cache)
    records, _ = read_records(by_id, 3, formats.read_corpus(corpus, cache), cache=cache)  # mapped
    loader = torch.utils.data.DataLoader(_Views(records), batch_size=None, num_workers=2, collate_fn=_as_is)
    plain, _ = read_records(by_id, 3, formats.read_corpus(corpus))
    assert list(loader) == [(r.query, list(r.pos), list(r.neg)) for r in plain]


def test_a_full_disk_while_writing_keeps_no_half_entry(tmp_path, capsys, monkeypatch):
    import errno

    _, _, inline = write_data(tmp_path / "data")
    cache = str(tmp_path / "cache")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(datacache.os, "fsync", full)
    assert view(read_records(inline, 3, cache=cache)[0]) == view(read_records(inline, 3)[0])
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(os.listdir(cache)) == [os.path.basename(datacache.entry_path(inline, cache)) + ".lock"]


def test_a_missing_file_is_the_parsers_message(tmp_path):
    with pytest.raises(formats.DataError, match="no_such.jsonl"):
        read_records(str(tmp_path / "no_such.jsonl"), 3, cache=str(tmp_path / "cache"))
    with pytest.raises(formats.DataError, match="no_corpus.jsonl"):
        formats.read_corpus(str(tmp_path / "no_corpus.jsonl"), "auto")


def hashing_counted(monkeypatch):
    """Forget this process's hashes (as a new process starts) and count the files hashed from here on."""
    hashed = []
    real = datacache.file_digest

    def counted(path, *a, **k):
        hashed.append(os.path.basename(path))
        return real(path, *a, **k)
    monkeypatch.setattr(datacache, "_digests", {})
    monkeypatch.setattr(datacache, "file_digest", counted)
    return hashed


def test_a_warm_load_hashes_nothing_until_the_source_changes_and_an_edit_behind_a_restored_mtime_is_caught(
        tmp_path, monkeypatch):
    """Issue 49: a warm load reads no byte of its source while the source's device, inode, size, mtime and
    ctime are those recorded beside its hash; a touch is hashed again once (and recorded), a same-size edit
    with its mtime set back, a copy and a move are hashed again and the edit rebuilds the entry."""
    corpus, by_id, inline = write_data(tmp_path / "data")
    cache = str(tmp_path / "cache")
    plain = read_both(corpus, by_id, inline, None)
    assert read_both(corpus, by_id, inline, cache) == plain  # built: each file hashed once
    hashed = hashing_counted(monkeypatch)
    assert read_both(corpus, by_id, inline, cache) == plain and hashed == []  # warm: no byte of a source read
    os.utime(inline)  # touch: the content is hashed again, matches, and the new stat is recorded
    assert read_both(corpus, by_id, inline, cache) == plain and hashed == ["inline.jsonl"]
    hashed = hashing_counted(monkeypatch)
    assert read_both(corpus, by_id, inline, cache) == plain and hashed == []

    st = os.stat(inline)  # the same size, an edit in the middle, the mtime set back: the ctime still moved
    with open(inline, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(b"7" if byte != b"7" else b"8")
    os.utime(inline, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(inline).st_mtime_ns == st.st_mtime_ns and os.stat(inline).st_size == st.st_size
    edited = read_records(inline, 3)[0]
    hashed = hashing_counted(monkeypatch)
    got = read_records(inline, 3, cache=cache)[0]
    assert hashed == ["inline.jsonl"] and view(got) == view(edited) and view(got) != plain[6]

    copy = str(tmp_path / "copy.jsonl")  # a copy put in its place (another inode, mtime kept): hashed again
    import shutil
    shutil.copy2(by_id, copy)
    os.replace(copy, by_id)
    hashed = hashing_counted(monkeypatch)
    assert read_both(corpus, by_id, inline, cache)[3] == plain[3] and "by_id.jsonl" in hashed
    moved = str(tmp_path / "moved.jsonl")  # moved away and back: the ctime moved, hashed again
    os.rename(by_id, moved)
    os.rename(moved, by_id)
    hashed = hashing_counted(monkeypatch)
    assert read_both(corpus, by_id, inline, cache)[3] == plain[3] and "by_id.jsonl" in hashed
