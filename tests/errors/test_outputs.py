"""No tool writes over what it reads, or over a folder it did not make (issue 49, retrieval_kit/outputs.py):
every writer - evaluate --output, score --out, mine --out, scripts/build_smollm2.py --out, the training
scripts' run folder and export - refuses an output that is one of its inputs (or a symlink to one), lies
inside an input folder, or is a folder holding files it did not write; the refusal is one sentence
before any work, and every input is left byte for byte as it was (the output fuzz below points each
writer at each of its inputs)."""

import hashlib
import json
import os
import shutil

import pytest

from retrieval_kit import evaluate, mine, outputs, score
from scripts import build_smollm2
from tests.conftest import ROOT, python_run


def digest_tree(path):
    """A digest of every file under `path` (or of the file), to show nothing was touched."""
    h = hashlib.sha256()
    paths = [path] if os.path.isfile(path) else sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)
    for p in paths:
        h.update(p.encode())
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def refused(call, argv, capsys=None):
    """The message of the SystemExit `call(argv)` raised (a non-zero exit), or fail."""
    with pytest.raises(SystemExit) as e:
        call(argv)
    assert e.value.code not in (0, None)
    if isinstance(e.value.code, str):
        return e.value.code
    return capsys.readouterr().err if capsys is not None else ""


@pytest.fixture
def beir(tmp_path):
    out = tmp_path / "beir"
    (out / "qrels").mkdir(parents=True)
    (out / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "title": "", "text": "a passage"}) + "\n")
    (out / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "a query"}) + "\n")
    (out / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    return str(out)


@pytest.fixture
def model(tmp_path):
    """A folder that looks like an export (what the writers must not touch; no weights needed: they refuse first)."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (out / "retrieval_kit.json").write_text(json.dumps({"kind": "biencoder"}))
    return str(out)


@pytest.fixture
def train(tmp_path):
    out = tmp_path / "train.jsonl"
    out.write_text(json.dumps({"query": "q", "pos_doc": ["p"], "neg_doc": ["n"]}) + "\n")
    return str(out)


def test_the_rule_refuses_an_input_a_link_to_it_a_path_inside_it_and_a_folder_holding_it(tmp_path, beir, model):
    corpus = os.path.join(beir, "corpus.jsonl")
    link = str(tmp_path / "link.jsonl")
    os.symlink(corpus, link)
    inputs = [("--beir", beir), ("--model", model)]
    for path, says in ((os.path.join(beir, "corpus.jsonl"), "lies inside the input folder --beir"),
                       (link, "lies inside the input folder --beir"),
                       (os.path.join(model, "retrieval_kit.json"), "lies inside the input folder --model"),
                       (beir, "is the command's input (--beir")):
        with pytest.raises(SystemExit, match=says.replace("(", r"\(")):
            outputs.check_file("--out", path, inputs, overwrite=True)
    with pytest.raises(SystemExit, match="holds the command's input"):
        outputs.check_dir("--out", str(tmp_path), "marker.json", inputs)
    outputs.check_file("--out", str(tmp_path / "new" / "metrics.json"), inputs)  # anywhere else: fine
    assert not os.path.exists(tmp_path / "new" / "metrics.json")  # (the probe leaves nothing)


def test_a_folder_is_replaced_only_when_it_is_the_tools_own(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="holds files this tool did not write"):
        outputs.check_dir("--out", str(theirs), "build.json")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="is a file"):
        outputs.check_dir("--out", str(tmp_path / "file"), "build.json")
    (tmp_path / "new.partial").write_text("x")
    with pytest.raises(SystemExit, match="new.partial is a file"):
        outputs.check_dir("--out", str(tmp_path / "new"), "build.json")
    with pytest.raises(SystemExit, match="cannot write there"):
        outputs.check_dir("--out", str(tmp_path / "file" / "below"), "build.json")
    # the kit's own: staged, published over an earlier build of its own, never over the user's
    own = str(tmp_path / "own")
    for round_ in range(2):
        stage = outputs.stage(own)
        (open(os.path.join(stage, "build.json"), "w")).write(str(round_))
        outputs.publish(own, "build.json")
        assert open(os.path.join(own, "build.json")).read() == str(round_)
        assert not os.path.exists(outputs.staging(own)) and not os.path.exists(os.path.join(own, outputs.STAGE_MARK))
    outputs.stage(str(theirs))
    with pytest.raises(SystemExit, match="not replaced"):
        outputs.publish(str(theirs), "build.json")
    assert (theirs / "notes.txt").read_text() == "mine"
    foreign_stage = tmp_path / "x.partial"
    foreign_stage.mkdir()
    (foreign_stage / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="did not write"):
        outputs.stage(str(tmp_path / "x"))
    assert (foreign_stage / "keep.txt").read_text() == "mine"


def test_evaluate_output_never_lands_on_a_corpus_qrels_or_model_file(beir, model, tmp_path, capsys):
    before = digest_tree(beir), digest_tree(model)
    for target in (os.path.join(beir, "corpus.jsonl"), os.path.join(beir, "qrels", "test.tsv"),
                   os.path.join(model, "retrieval_kit.json")):
        msg = refused(evaluate.main, ["--model", model, "--beir", beir, "--output", target], capsys)
        assert "lies inside the input folder" in msg, msg
    other = tmp_path / "notes.json"
    other.write_text("{}")
    msg = refused(evaluate.main, ["--model", model, "--beir", beir, "--output", str(other)], capsys)
    assert "exists and is not this tool's output" in msg
    assert (digest_tree(beir), digest_tree(model)) == before and other.read_text() == "{}"
    own = tmp_path / "metrics.json"  # a metrics file evaluate wrote is its to replace
    own.write_text(json.dumps({"model": "m", "reranker": None, "biencoder": {}}))
    assert evaluate.is_metrics_file(str(own)) and not evaluate.is_metrics_file(str(other))


@pytest.mark.parametrize("tool", ["score", "mine"])
def test_score_and_mine_out_never_land_on_their_inputs_even_with_overwrite(tool, beir, model, train, tmp_path,
                                                                          capsys):
    main = score.main if tool == "score" else mine.main
    corpus = os.path.join(beir, "corpus.jsonl")
    before = digest_tree(beir), digest_tree(model), digest_tree(train)
    link = str(tmp_path / "link.jsonl")
    os.symlink(train, link)
    for out in (train, link, corpus, os.path.join(model, "scores.jsonl")):
        msg = refused(main, ["--model", model, "--input", train, "--corpus", corpus, "--out", out, "--overwrite"], capsys)
        assert "input" in msg, msg
    parts = tmp_path / "out.jsonl.parts"  # its resumable blocks' folder: never a folder of the user's
    parts.mkdir()
    (parts / "mine.txt").write_text("keep")
    msg = refused(main, ["--model", model, "--input", train, "--out", str(tmp_path / "out.jsonl")], capsys)
    assert "did not write" in msg and (parts / "mine.txt").read_text() == "keep"
    assert (digest_tree(beir), digest_tree(model), digest_tree(train)) == before


def test_build_smollm2_never_replaces_a_folder_of_the_users_and_leaves_no_lock(tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("years of work")
    for out, says in ((theirs, "holds files this tool did not write"), (tmp_path / "f.txt", "is a file"),
                      (tmp_path / "p", "p.partial is a file")):
        (tmp_path / "f.txt").write_text("x")
        (tmp_path / "p.partial").write_text("x")
        msg = refused(build_smollm2.main, ["--out", str(out)], capsys)
        assert says in msg, msg
        assert not os.path.exists(str(out) + ".lock")
    assert (theirs / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("script", ["train_biencoder.py", "train_reranker.py"])
def test_a_run_folder_is_no_input_and_overwrite_output_dir_deletes_no_input(script, tiny_model_dir, small_train_file,
                                                                           tmp_path):
    inside = os.path.join(tiny_model_dir, "run")
    out = python_run([os.path.join(ROOT, script), "--model", tiny_model_dir, "--train-file", small_train_file,
                      "--output-dir", inside, "--max-steps", 1])
    assert out.returncode != 0 and "lies inside the input folder --model" in out.stderr + out.stdout
    assert "Traceback" not in out.stderr and not os.path.exists(inside)
    run = tmp_path / "run"  # a model trained earlier in this run folder, given as --model of a run that clears it
    shutil.copytree(tiny_model_dir, run / "final")
    (run / "final" / "retrieval_kit.json").write_text("{}")
    before = digest_tree(str(run / "final"))
    out = python_run([os.path.join(ROOT, script), "--model", str(run / "final"), "--train-file", small_train_file,
                      "--output-dir", str(run), "--overwrite-output-dir", "--max-steps", 1, "--val-file", "",
                      *(["--rerank-max-length", 64] if "reranker" in script else [])])
    assert out.returncode != 0 and "would be deleted" in out.stderr + out.stdout, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and digest_tree(str(run / "final")) == before
