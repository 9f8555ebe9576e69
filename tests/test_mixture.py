"""Several training files in one run: each micro-batch from one file, shares by weight, the same
file on every rank, exact resume mid-mixture, per-file prompts, and the user's mistakes."""

import functools
import json
import os
import random

import pytest

from retrieval_kit import cli, data
from retrieval_kit.records import Record, read_mix, read_train_val
from retrieval_kit.data import StepBatches, TrainFile
from retrieval_kit.formats import DataError
from tests.conftest import python_run, read_jsonl, ROOT, run_script


def records(tag, n, negs=3):
    return [Record(f"{tag}{i}", [f"{tag}{i}+"], [f"{tag}{i}-{k}" for k in range(negs)]) for i in range(n)]


def queries_only(queries, groups, query_prefix=""):
    """A collate that keeps the texts: which records (and which prompt) a batch holds."""
    return {"q": [query_prefix + q for q in queries], "groups": groups}


def file_of(query):
    return query.removeprefix("query: ")[0]


def test_quotas_share_a_round_by_weight():
    assert data.mixture_quotas([10, 30], [None, None]) == [10, 30]  # no weights: each file once a round
    assert data.mixture_quotas([10, 30], [1, 1]) == [20, 20]
    assert data.mixture_quotas([10, 30], [3, 1]) == [30, 10]
    assert data.mixture_quotas([16, 12], [1, 2]) == [9, 19]  # 9.33 / 18.67: the larger remainder rounds up
    assert data.mixture_quotas([5, 5], [1000, 1e-6]) == [10, 1]  # every file at least once a round


def test_shares_over_many_steps_follow_the_weights_and_the_counts_match_a_naive_tally():
    files = [TrainFile(records("A", 40), 1.0, "a"), TrainFile(records("B", 24), 3.0, "b")]
    ds = StepBatches(files, 2, 4, 0, 1, 7, queries_only)
    assert ds.steps_per_epoch == 16  # 10 + 6 batches a round, shared 1 : 3 -> 4 + 12
    tally = {"A": 0, "B": 0}
    for i in range(1600):
        if i in (160, 800):  # the counts a run logs against counting the batches one by one
            assert ds.drawn(i) == {"drawn/a": tally["A"], "drawn/b": tally["B"]}
        tally[file_of(ds[i]["q"][0])] += 1
    assert tally == {"A": 400, "B": 1200}  # exact over whole rounds
    order = [file_of(ds[i]["q"][0]) for i in range(16)]
    assert order != sorted(order) and order != sorted(order, reverse=True)  # shuffled within the round


def test_every_micro_batch_holds_one_file_and_every_rank_draws_the_same_file():
    files = [TrainFile(records("A", 48)), TrainFile(records("B", 32)), TrainFile(records("C", 16))]
    ranks = [StepBatches(files, 2, 4, r, 2, 3, queries_only) for r in range(2)]
    seen = {tag: [] for tag in "ABC"}
    for i in range(ranks[0].steps_per_epoch):  # one round without weights: one pass over every file
        batches = [ds[i]["q"] for ds in ranks]
        tags = {file_of(q) for b in batches for q in b}
        assert len(tags) == 1, (i, batches)
        assert not set(batches[0]) & set(batches[1])  # the ranks share the file, not its records
        seen[tags.pop()] += batches[0] + batches[1]
    for tag, n in (("A", 48), ("B", 32), ("C", 16)):
        assert sorted(seen[tag]) == sorted(f"{tag}{i}" for i in range(n))  # every record exactly once


def test_one_file_draws_the_batches_of_the_single_file_layout():
    """The naive reference: epoch permutation -> this rank's slice -> each record's own RNG."""
    recs = records("A", 30)
    mixed, plain = StepBatches([TrainFile(recs)], 3, 4, 1, 2, 11, queries_only), StepBatches(recs, 3, 4, 1, 2, 11,
                                                                                             queries_only)
    per_epoch = 30 // 8
    for i in range(3 * per_epoch + 1):
        epoch, pos = divmod(i, per_epoch)
        order = data.epoch_order(30, 11, epoch)
        idx = order[(pos * 2 + 1) * 4:(pos * 2 + 2) * 4]
        want = [data.sample_group(recs[j], 3, random.Random(f"11-{epoch}-{j}")) for j in idx]
        assert mixed[i] == plain[i] == {"q": [recs[j].query for j in idx], "groups": want}


def test_a_files_prompt_reaches_its_batches_only(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, tag in ((a, "A"), (b, "B")):
        path.write_text("".join(json.dumps({"query": f"{tag}{i}", "pos_doc": [f"{tag}{i} doc"],
                                            "neg_doc": [f"{tag}{i} other"]}) + "\n" for i in range(8)))
    mix = tmp_path / "mix.jsonl"
    mix.write_text('{"file": "a.jsonl", "query_prefix": "query: "}\n{"file": "b.jsonl", "name": "plain"}\n')
    entries = read_mix(str(mix), ("query_prefix",))
    assert [e["file"] for e in entries] == [str(a), str(b)]  # relative to the mix file
    args = cli.parse(cli.biencoder_parser(), ["--train-mix", str(mix), "--val-file", "", "--batch-size", "2"])
    files, _, mixture, _ = read_train_val(cli.data_spec(args, ("query_prefix",)), 1)
    assert [(f.name, f.prompts) for f in files] == [("a", {"query_prefix": "query: "}), ("plain", {})]
    from retrieval_kit.formats import file_digest

    assert args.train_file == [] and mixture[0] == {"name": "a", "file": str(a), "records": 8, "weight": None,
                                     "batches_per_round": 4, "query_prefix": "query: ", "digest": file_digest(a)}
    ds = StepBatches(files, 2, 2, 0, 1, 0, [functools.partial(queries_only, **f.prompts) for f in files])
    for i in range(8):
        q = ds[i]["q"]
        assert all(x.startswith("query: A") for x in q) or all(x.startswith("B") for x in q), q


def test_bad_mix_lines_are_each_named_by_file_and_line(tmp_path):
    (tmp_path / "ok.jsonl").write_text("{}\n")
    mix = tmp_path / "mix.jsonl"
    mix.write_text('{"file": "ok.jsonl", "weight": 2}\n'
                   '{"file": "missing.jsonl", "weight": 1}\n'
                   '{"file": "ok.jsonl", "weight": -1}\n'
                   '{"file": "ok.jsonl", "weight": 1, "query_prompt": "q: "}\n'
                   '{"weight": 1}\n'
                   '{"file": "ok.jsonl"}\n'
                   'not json\n')
    with pytest.raises(DataError) as e:
        read_mix(str(mix), ("query_prefix", "passage_prefix"))
    text = str(e.value)
    for line, says in ((2, "no such file"), (3, "\"weight\" must be a positive number"), (4, "unknown key 'query_prompt'"),
                       (5, '"file" must be the path'), (6, 'no "weight"'), (7, "invalid JSON")):
        assert f"{mix}:{line}: {says}" in text, (line, text)
    assert f"{mix}:1:" not in text


def run_cli(script, args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return python_run([os.path.join(ROOT, script)] + list(args), env=env)


@pytest.mark.slow
def test_the_users_mistakes_are_one_sentence(small_train_file, tmp_path, capsys):
    parse_args = functools.partial(cli.parse, cli.biencoder_parser())
    mix = tmp_path / "mix.jsonl"
    mix.write_text(json.dumps({"file": small_train_file, "weight": 1, "prompt_template": "{query}"}) + "\n")
    with pytest.raises(SystemExit) as e:
        parse_args(["--train-file", small_train_file, "--train-mix", str(mix)])
    assert e.value.code == 2 and "--train-mix: not allowed with argument --train-file" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--train-weights: 3 weight\(s\) for 2 --train-file\(s\)"):
        parse_args(["--train-file", small_train_file, "--train-file", small_train_file, "--train-weights", "1,2,3"])
    with pytest.raises(SystemExit, match=r"--train-weights: not with --train-mix"):
        parse_args(["--train-mix", str(mix), "--train-weights", "1"])
    with pytest.raises(DataError, match=r":1: unknown key 'prompt_template' \(a line may hold: file, weight, name, "
                                        r"query_prefix, passage_prefix\)"):
        read_mix(str(mix), cli.BIENCODER_PROMPT_KEYS)  # the reranker's key is not the bi-encoder's
    # the whole way, as a user meets it: the reranker reads the template after loading the model
    out = run_cli("train_reranker.py", ["--train-mix", mix, "--val-file", "", "--output-dir", tmp_path / "rr"])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    says = f"--train-mix: {small_train_file}: \"prompt_template\" must contain {{query}} and {{passage}}"
    assert says in out.stdout + out.stderr, out.stderr[-3000:]


@pytest.fixture(scope="module")
def two_files(small_train_file, tmp_path_factory):
    """The bundled data's first 64 records and its next 48, as two training files, in a mix 1 : 2."""
    folder = tmp_path_factory.mktemp("mix")
    with open(os.path.join(ROOT, "data", "train.jsonl")) as f:
        lines = [next(f) for _ in range(112)]
    (folder / "more.jsonl").write_text("".join(lines[64:]))
    mix = folder / "mix.jsonl"
    mix.write_text(json.dumps({"file": small_train_file, "weight": 1, "name": "first"}) + "\n" +
                   json.dumps({"file": "more.jsonl", "weight": 2, "query_prefix": "query: "}) + "\n")
    return mix


@pytest.mark.slow
def test_a_resume_mid_mixture_goes_on_exactly_and_a_changed_mix_is_refused(tiny_model_dir, two_files, tmp_path):
    args = ["--model", tiny_model_dir, "--train-mix", two_files, "--val-file", "", "--batch-size", "4",
            "--grad-accum-steps", "2", "--passage-max-length", "32", "--max-steps", "6", "--ckpt-every", "3"]
    run_script("train_biencoder.py", args + ["--output-dir", tmp_path / "a"])
    run_script("train_biencoder.py", args + ["--output-dir", tmp_path / "b", "--resume", tmp_path / "a" / "step_000003"])
    full, resumed = ([r for r in read_jsonl(tmp_path / d / "metrics.jsonl") if r["split"] == "train"] for d in "ab")
    keys = ("loss", "grad_norm", "drawn/first", "drawn/more")
    assert [[r[k] for k in keys] for r in full[3:]] == [[r[k] for k in keys] for r in resumed]
    assert [r["drawn/first"] + r["drawn/more"] for r in full] == [2, 4, 6, 8, 10, 12]  # micro-batches so far
    header = json.loads((tmp_path / "a" / "run_header.json").read_text())
    assert [(f["name"], f["records"], f["batches_per_round"]) for f in header["train_files"]] == [
        ("first", 64, 9), ("more", 48, 19)]  # 16 + 12 batches a round, shared 1 : 2
    assert header["n_train"] == 112
    exported = json.loads((tmp_path / "a" / "final" / "retrieval_kit.json").read_text())  # per-file prompts listed
    assert exported["train_files"] == header["train_files"] and exported["query_prefix"] == ""
    assert any(f.get("query_prefix") == "query: " for f in exported["train_files"])

    changed = two_files.parent / "mix_1_3.jsonl"
    changed.write_text(two_files.read_text().replace('"weight": 2', '"weight": 3'))
    out = run_cli("train_biencoder.py", [changed if a == two_files else a for a in args] +
              ["--output-dir", tmp_path / "a", "--resume", "auto"])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "the training files (name, path, records, weight, batches per round, prompts, content digest)" in out.stdout + out.stderr


@pytest.mark.slow
def test_the_reranker_trains_on_a_mix_with_a_files_own_template(tiny_model_dir, two_files, tmp_path):
    mix = tmp_path / "mix.jsonl"
    mix.write_text(two_files.read_text().replace('"query_prefix": "query: "',
                                                 '"prompt_template": "Query: {query} Passage: {passage}"')
                   .replace('"more.jsonl"', json.dumps(str(two_files.parent / "more.jsonl"))))
    run_script("train_reranker.py", ["--model", tiny_model_dir, "--train-mix", mix, "--val-file", "",
                                     "--batch-size", "2", "--rerank-max-length", "64", "--max-steps", "4",
                                     "--output-dir", tmp_path / "rr"])
    rows = [r for r in read_jsonl(tmp_path / "rr" / "metrics.jsonl") if r["split"] == "train"]
    assert [r["drawn/first"] + r["drawn/more"] for r in rows] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] for r in rows)  # finite
