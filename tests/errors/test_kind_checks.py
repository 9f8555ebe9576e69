"""Issue 49's cases, one test each: a flag no head of the run takes is one sentence, decided from the
heads' table (their FLAGS); a dir of one kind given with another head is refused naming both; model dirs
damaged in the ways a user met them are one sentence; runs that train nothing end non-zero; inputs that
cannot mean what they say are refused or warned; the noise is gone. The dir fuzz (test_dir_fuzz) and the
output fuzz (test_output_fuzz) cover the families as rules; the start-up tier of the flag fuzz is here."""

import json
import os
import re
import shutil

import pytest
import torch

from retrieval_kit import cli, heads
from tests.conftest import ROOT, python_run, read_jsonl, run_script

# a valid value for each head's own flags (what the start-up fuzz runs to the first step)
OWN = {"single-vector": [["--pooling", "cls"], ["--no-normalize"], ["--matryoshka-dims", "16,8"], ["--dense-dim", "16"]],
       "multi-vector": [["--multi-vector-dim", "8"], ["--query-expansion", "on"], ["--skiplist", "punctuation"]],
       "sparse": [["--flops-weights", "1e-4,1e-4"], ["--flops-warmup-steps", "1"], ["--lexical-head-bias", "-4"],
                  ["--query-encoder", "static"]],
       "csr": [["--pooling", "cls"], ["--csr-dim", "64"], ["--csr-k", "8"], ["--csr-aux-weight", "0.5"]],
       "classifier": [["--pooling", "avg"], ["--head-lr-mult", "2"]],
       "lm": [["--lm-tokens", "data,tool"], ["--lm-tokens", "data,tool", "--export-seq-cls"]]}
FLAG_OF = {"pooling": "--pooling", "normalize": "--no-normalize", "matryoshka_dims": "--matryoshka-dims",
           "dense_dim": "--dense-dim",
           "multi_vector_dim": "--multi-vector-dim", "query_expansion": "--query-expansion", "skiplist": "--skiplist",
           "flops_weights": "--flops-weights", "flops_warmup_steps": "--flops-warmup-steps",
           "lexical_head_bias": "--lexical-head-bias", "query_encoder": "--query-encoder",
           "csr_dim": "--csr-dim", "csr_k": "--csr-k", "csr_aux_weight": "--csr-aux-weight",
           "head_lr_mult": "--head-lr-mult", "lm_tokens": "--lm-tokens", "export_seq_cls": "--export-seq-cls"}


def test_the_table_of_flags_is_the_heads_own():
    """Every head-only flag of the scripts belongs to one head's FLAGS (one table), and each has a valid value above."""
    owned = {dest for name in heads.MODULES for dest in heads.get(name).FLAGS}
    assert {d for d in owned if d != "truncate_dims" and d != "matryoshka_weights"} == set(FLAG_OF)
    for name, argvs in OWN.items():
        assert {a[0] for a in argvs} <= {FLAG_OF[d] for d in heads.get(name).FLAGS if d in FLAG_OF}


@pytest.mark.parametrize("head", heads.MODULES)
def test_another_heads_flag_is_one_sentence_naming_both(head):
    script = "reranker" if head in heads.RERANKER else "biencoder"
    make = cli.reranker_parser if script == "reranker" else cli.biencoder_parser
    refused = 0
    for other in heads.family(head):  # (a flag of the other family is its script's parser's business)
        for argv in OWN[other] if other != head else ():
            if any(argv[0] == a[0] for a in OWN[head]):
                continue  # (--pooling: each family's own)
            try:
                args = cli.parse(make(), [*argv, "--head", head] if script == "reranker" else argv)
            except SystemExit as e:  # the reranker decides at parse time; an embedding flag: not its parser's
                message = str(e.code)
                if script == "reranker" and other in heads.RERANKER:
                    assert "only with --head" in message and other in message and f"head is {head}" in message, message
                    refused += 1
                continue
            said = "--" + next(d for d, f in FLAG_OF.items() if f == argv[0]).replace("_", "-")
            with pytest.raises(SystemExit, match=rf"{said}: only with --head [^;]*{other}[^;]*; this run's head is "
                                                 rf"{head}: drop the flag"):
                cli.head_flags(args, head)
            refused += 1
    assert refused >= 2


def test_a_heads_own_flags_get_its_defaults_and_the_temperature_its():
    args = cli.parse(cli.biencoder_parser(), [])
    assert cli.head_flags(args, "multi-vector") is heads.get("multi-vector")
    assert args.multi_vector_dim == 128 and args.temperature == 1.0 and args.head == "multi-vector"
    args = cli.parse(cli.biencoder_parser(), ["--temperature", "0.2"])
    cli.head_flags(args, "sparse")
    assert args.flops_weights == [5e-5, 3e-5] and args.temperature == 0.2 and args.multi_vector_dim is None
    args = cli.parse(cli.reranker_parser(), ["--head", "lm"])
    assert args.lm_tokens == ["yes", "no"] and args.pooling is None and args.head_lr_mult is None


def test_runs_that_would_train_nothing_or_warm_up_past_the_end_are_said(capsys):
    with pytest.raises(SystemExit, match="--no-in-batch-negatives with --n-passages 1: every query would be scored"):
        cli.parse(cli.biencoder_parser(), ["--no-in-batch-negatives", "--n-passages", "1"])
    cli.parse(cli.biencoder_parser(), ["--head", "sparse", "--flops-warmup-steps", "90", "--max-steps", "60"])
    assert "--flops-warmup-steps 90 > --max-steps 60: the FLOPS weights never reach" in capsys.readouterr().out


# ----- dirs of one kind given with another head; damaged dirs -------------------------------------------------

@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_model_dir):
    """A kit multi-vector export, a SparseEncoder dir, a one-vector export and a plain copy of the tiny BERT."""
    from retrieval_kit.export import export_model
    from retrieval_kit.heads import multi_vector, single_vector, sparse
    from retrieval_kit.models import load_tokenizer

    root = tmp_path_factory.mktemp("exports")
    tok = load_tokenizer(tiny_model_dir)
    base = {"kind": "biencoder", "pooling": "avg", "normalize": True, "query_prefix": "", "passage_prefix": "",
            "query_max_length": 16, "passage_max_length": 32, "include_prompt": True}
    mv = multi_vector.load(tiny_model_dir, multi_vector_dim=8)
    out = {"multi-vector": export_model(str(root / "mv"), mv, tok,
                                        {**base, "head": "multi-vector", "query_expansion": False, "skiplist_words": []}),
           "single-vector": export_model(str(root / "sv"), single_vector.load(tiny_model_dir), tok,
                                         {**base, "head": "single-vector"})}
    torch.manual_seed(0)
    out["sparse"] = export_model(str(root / "sp"), sparse.load(tiny_model_dir), tok, {**base, "head": "sparse"})
    os.remove(os.path.join(out["sparse"], "retrieval_kit.json"))  # a SparseEncoder dir (its files say so)
    return out


@pytest.mark.parametrize("held,asked", [("multi-vector", "single-vector"), ("sparse", "multi-vector"),
                                        ("multi-vector", "sparse"), ("sparse", "classifier")])
def test_a_dir_of_one_kind_with_another_head_is_refused_naming_both(exports, held, asked):
    from retrieval_kit.heads import read_spec

    with pytest.raises(SystemExit, match=rf"the head it holds is {held}, and --head {asked} would"):
        heads.check_dir(read_spec(exports[held]), asked)


def test_a_one_vector_dir_starts_any_head(exports):
    from retrieval_kit.heads import read_spec

    for name in heads.MODULES:
        heads.check_dir(read_spec(exports["single-vector"]), name)


def test_a_multi_vector_dir_trained_as_one_vector_is_one_sentence_at_start_up(exports, small_train_file, tmp_path):
    """(it died in DDP's "unused parameters" after a step, with no final/)"""
    out = python_run([os.path.join(ROOT, "train_biencoder.py"), "--model", exports["multi-vector"], "--head",
                      "single-vector", "--train-file", small_train_file, "--max-steps", 1, "--output-dir", tmp_path])
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "the head it holds is multi-vector, and --head single-vector would drop it" in out.stderr


def test_damaged_dirs_as_users_met_them_are_one_sentence(exports, tmp_path):
    """A length that is not a number, a skiplist of numbers / null / a string, a projection config missing a
    field or of another width than the model or its weights, missing weights, expansion without a length,
    modules.json not a list, a broken retrieval_kit.json."""
    from retrieval_kit.heads import read_spec

    def damaged(rel, edit):
        d = tmp_path / f"d{len(os.listdir(tmp_path))}"
        shutil.copytree(exports["multi-vector"], d)
        p = d / rel
        if edit == "another model's":  # a projection of a 64-wide model: its config and weights agree
            from safetensors.torch import save_file

            save_file({"linear.weight": torch.zeros(8, 64)}, str(p / "model.safetensors"))
            cfg = json.loads((p / "config.json").read_text())
            (p / "config.json").write_text(json.dumps({**cfg, "in_features": 64}))
        elif edit is None:
            p.unlink()
        elif isinstance(edit, str):
            p.write_text(edit)
        else:
            obj = json.loads(p.read_text())
            edit(obj)
            p.write_text(json.dumps(obj))
        return str(d)

    cases = [
        ("sentence_bert_config.json", lambda c: c.update(query_length="long"), "query_length 'long' must be a positive"),
        ("2_MultiVectorMask/config.json", lambda c: c.update(skiplist_words=[1, 2]), "a list of non-empty strings"),
        ("2_MultiVectorMask/config.json", lambda c: c.update(skiplist_words=[None]), "a list of non-empty strings"),
        ("2_MultiVectorMask/config.json", lambda c: c.update(skiplist_words=".,;"), "read letter by letter"),
        ("1_Dense/config.json", lambda c: c.pop("out_features"), "out_features None must be"),
        ("1_Dense/config.json", lambda c: c.update(in_features=64), "linear.weight is 8x32, its config"),
        ("1_Dense", "another model's", "in_features 64 is not the model's width (hidden_size 32"),
        ("1_Dense/config.json", lambda c: c.update(out_features=9), "its config"),
        ("1_Dense/model.safetensors", None, "has no weights"),
        ("sentence_bert_config.json", lambda c: c.update(query_expansion={"strategy": "fixed"}),
         "query_expansion.length None must be"),
        ("modules.json", "{}", "holds a dict, not a JSON list"),
        ("retrieval_kit.json", "{", "not valid JSON"),
        ("retrieval_kit.json", lambda c: c.update(head=["multi-vector"]), "head ['multi-vector'] must be one of"),
    ]
    for rel, edit, says in cases:
        d = damaged(rel, edit)
        with pytest.raises(SystemExit) as e:
            read_spec(d)
        assert says in str(e.value.code) and d in str(e.value.code), (rel, e.value.code)


def test_an_absurd_multi_vector_dim_is_one_sentence(tiny_model_dir):
    from retrieval_kit.heads import multi_vector

    with pytest.raises(SystemExit, match="--multi-vector-dim 100000: at most 4096"):
        multi_vector.load(tiny_model_dir, multi_vector_dim=100000)


def test_a_multi_vector_dim_against_the_dirs_own_is_one_sentence(exports, tmp_path):
    """Issue 61: --multi-vector-dim 64 with a multi-vector dir (its projection 8 wide) is refused, in the script
    and in plan, not dropped; unset, the flag takes the dir's width (what the run header records)."""
    from retrieval_kit import plan
    from retrieval_kit.heads import read_spec

    spec = read_spec(exports["multi-vector"])
    args = cli.parse(cli.biencoder_parser(), ["--multi-vector-dim", "64"])
    with pytest.raises(SystemExit, match=r"--multi-vector-dim 64: .* is an export of the kit with head multi-vector .*, which fixes it at 8;"):
        cli.head_flags(args, "multi-vector", spec=spec)
    args = cli.parse(cli.biencoder_parser(), [])
    cli.head_flags(args, "multi-vector", spec=spec)
    assert args.multi_vector_dim == 8
    args = cli.parse(cli.biencoder_parser(), ["--multi-vector-dim", "8"])
    cli.head_flags(args, "multi-vector", spec=spec)  # (the same width: said, not refused)
    with pytest.raises(SystemExit, match="--multi-vector-dim 64: .* which fixes it at 8"):
        plan.main(["--model", exports["multi-vector"], "--head", "multi-vector", "--multi-vector-dim", "64"])


def test_evaluate_reranker_on_a_plain_dir_is_one_sentence(tiny_model_dir, exports, small_beir):
    """(a KeyError after the bi-encoder stage)"""
    out = python_run(["-m", "retrieval_kit.evaluate", "--model", exports["single-vector"], "--beir", small_beir,
                      "--reranker", tiny_model_dir])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"{tiny_model_dir}: not an export of train_reranker.py" in out.stderr


@pytest.mark.parametrize("argv,says", [(["--pooling", "cls"], "--pooling: only with --head single-vector or csr"),
                                       (["--no-normalize"], "--normalize: only with --head single-vector"),
                                       (["--truncate-dims", "4"], "--truncate-dims: only with --head single-vector")])
def test_evaluate_options_a_multi_vector_export_ignores_are_one_sentence(exports, small_beir, argv, says):
    from retrieval_kit import evaluate

    with pytest.raises(SystemExit, match=rf"{says}; {exports['multi-vector']} \(the model's\) head is multi-vector"):
        evaluate.main(["--model", exports["multi-vector"], "--beir", small_beir, *argv])


def test_a_sparse_export_loads_without_the_fresh_head_report(exports, capfd):
    from retrieval_kit.evaluate import load_biencoder

    load_biencoder(exports["sparse"])
    out = capfd.readouterr()
    assert "newly initialized" not in out.out + out.err and "LOAD REPORT" not in out.out + out.err


# ----- inputs that cannot mean what they say ------------------------------------------------------------------

def test_qrels_naming_documents_no_corpus_holds_are_refused_or_counted(small_beir, tmp_path, capsys):
    from retrieval_kit.evaluate import load_beir

    beir = tmp_path / "beir"
    shutil.copytree(small_beir, beir)
    qrels = beir / "qrels" / "test.tsv"
    lines = qrels.read_text().splitlines()
    first = lines[1].split("\t")
    qrels.write_text("\n".join(lines + [f"{first[0]}\tnot-a-doc\t1"]) + "\n")
    load_beir(str(beir))
    assert f"1 of its {len(lines)} judgments name documents that are not in the corpus" in capsys.readouterr().out
    qrels.write_text(f"query-id\tcorpus-id\tscore\n{first[0]}\tnot-a-doc\t1\n")
    with pytest.raises(SystemExit, match="none of its 1 judged documents is in"):
        load_beir(str(beir))


def test_all_zero_sparse_vectors_are_counted_and_warned(capsys):
    from retrieval_kit.encode import warn_empty
    from retrieval_kit.heads import multi_vector, sparse

    rows = sparse.stack([torch.tensor([0.0, 1.5, 0.0]).to_sparse(), torch.zeros(3).to_sparse(),
                         torch.tensor([2.0, 0.0, 0.0]).to_sparse()])
    assert sparse.empty_rows(rows) == 1 and sparse.empty_rows(rows.to_dense()) == 1
    assert warn_empty(sparse, rows, "passages (a test)") == 1
    assert "1 of 3 passages (a test) have an all-zero vector" in capsys.readouterr().err
    assert multi_vector.empty_rows(torch.zeros(2, 3, 4)) == 0


def test_a_template_with_the_passage_first_exports_as_not_portable(tiny_decoder_dir, tmp_path):
    """sentence-transformers' chat-template truncation keeps the head and the shared tail: with the passage
    first the kit cuts elsewhere (up to 0.0225 apart when tried): the export says it is kit-only, and why."""
    from retrieval_kit.export import export_reranker
    from retrieval_kit.heads import classifier
    from retrieval_kit.models import load_tokenizer, setup_pad_token

    tok = load_tokenizer(tiny_decoder_dir)
    net = classifier.load(tiny_decoder_dir)
    setup_pad_token(tok, net)
    settings = {"kind": "reranker", "head": "classifier", "pooling": "native", "rerank_max_length": 32,
                "append_eos": False, "padding_side": "left", "pad_to_multiple_of": 8}
    first = export_reranker(str(tmp_path / "p"), net, tok, {**settings, "prompt_template": "passage: {passage} "
                                                                                          "question: {query}"})
    last = export_reranker(str(tmp_path / "q"), net, tok, {**settings, "prompt_template": "question: {query} "
                                                                                         "passage: {passage}"})
    assert not first["portable"] and any("passage before the query" in r for r in first["kit_only"])
    assert last["portable"]


def test_seq_cls_of_an_lm_head_with_the_pair_encoding_is_written(tiny_decoder_dir, tmp_path):
    """(the export crashed after training, leaving final.partial/)"""
    from retrieval_kit.export import export_reranker
    from retrieval_kit.heads import lm
    from retrieval_kit.models import load_tokenizer, setup_pad_token

    tok = load_tokenizer(tiny_decoder_dir)
    tok.padding_side = "left"
    net = lm.load(tiny_decoder_dir)
    setup_pad_token(tok, net)
    out = export_reranker(str(tmp_path / "final"), net, tok, {
        "kind": "reranker", "head": "lm", "pooling": "native", "prompt_template": "pair", "rerank_max_length": 32,
        "append_eos": False, "padding_side": "left", "pad_to_multiple_of": 8,
        "lm_token_ids": lm.token_ids(tok, ["data", "tool"])}, seq_cls=True)
    assert out["seq_cls"]["written"] and os.path.isdir(tmp_path / "final" / "seq_cls")
    assert not os.path.exists(tmp_path / "final.partial")


# ----- runs: resume across kinds, every step skipped; the start-up tier of the flag fuzz ------------------------

@pytest.mark.slow
def test_a_resume_across_kinds_or_projection_sizes_is_one_sentence(tiny_model_dir, small_train_file, tmp_path):
    common = ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "", "--batch-size", 2,
              "--query-max-length", 16, "--passage-max-length", 32, "--ckpt-every", 1, "--output-dir", tmp_path]
    run_script("train_biencoder.py", [*common, "--head", "multi-vector", "--multi-vector-dim", 8, "--max-steps", 1])
    for argv, says in ((["--head", "single-vector"], "was trained from --head multi-vector, this run names "
                                                     "single-vector"),
                       (["--head", "multi-vector", "--multi-vector-dim", 16], "was trained from --multi-vector-dim 8")):
        out = python_run([os.path.join(ROOT, "train_biencoder.py"), *common, *argv, "--max-steps", 2, "--resume",
                          "auto", "--allow-changed-args"])
        assert out.returncode == 1 and says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_a_run_whose_every_step_is_skipped_exports_nothing_and_exits_non_zero(tiny_model_dir, small_train_file,
                                                                            tmp_path):
    out = python_run([os.path.join(ROOT, "train_biencoder.py"), "--model", tiny_model_dir, "--train-file",
                      small_train_file, "--val-file", "", "--batch-size", 2, "--max-steps", 2, "--temperature", "1e-45",
                      "--output-dir", tmp_path])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "every one of the run's 2 steps was skipped" in out.stderr and not (tmp_path / "final").exists()
    assert [r["skipped_steps"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train"] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("head", heads.MODULES)
def test_each_heads_own_flags_run_to_the_first_step_and_anothers_are_refused(head, tiny_model_dir, tiny_decoder_dir,
                                                                           small_train_file, tmp_path):
    """The start-up tier of the flag fuzz: a tiny model of each kind, each of its head's flags run to a step
    (exit 0), each other head's flag refused in one sentence before anything loads."""
    reranker = head in heads.RERANKER
    script = os.path.join(ROOT, "train_reranker.py" if reranker else "train_biencoder.py")
    model = tiny_decoder_dir if head == "lm" else tiny_model_dir
    common = ["--model", model, "--head", head, "--train-file", small_train_file, "--val-file", "", "--batch-size", 2,
              "--max-steps", 1, "--warmup-steps", 0, *(["--rerank-max-length", 64] if reranker else
                                                      ["--query-max-length", 16, "--passage-max-length", 32])]
    for i, argv in enumerate(OWN[head]):
        out = python_run([script, *common, *argv, "--output-dir", tmp_path / f"own{i}"])
        assert out.returncode == 0, (argv, out.stderr[-2000:])
    family = heads.RERANKER if reranker else heads.EMBEDDING
    for other in family:
        for argv in OWN[other] if other != head else ():
            if any(argv[0] == a[0] for a in OWN[head]):
                continue
            out = python_run([script, *common, *argv, "--output-dir", tmp_path / "other"])
            takes = re.search(r"only with --head ([^;]*);", out.stderr)  # (--pooling: single-vector or csr)
            assert out.returncode != 0 and takes and other in takes.group(1).split(" or "), (argv, out.stderr[-2000:])
            assert "Traceback" not in out.stderr and not (tmp_path / "other" / "final").exists()
