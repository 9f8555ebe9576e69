"""Flags checked against each other and against the model (issue 30): max lengths beyond the model's
positions or too short for its special tokens, max lengths that are not a multiple of
--pad-to-multiple-of (the padding is rounded, not the truncation), a reranker with one pair per
query, --sharded-checkpoints under DDP, warmup past the last step, a bi-encoder export given as a
reranker, Matryoshka sizes beyond the embedding."""

import pytest
import torch

from retrieval_kit import cli
from retrieval_kit.collate import tokenize
from retrieval_kit.models import check_max_lengths, load_encoder, load_tokenizer
from tests.conftest import python_run, ROOT
from tests.test_lora import causal_config


def test_max_lengths_are_checked_against_the_models_positions_and_special_tokens(tiny_model_dir):
    tok, config = load_tokenizer(tiny_model_dir), load_encoder(tiny_model_dir).config  # 128 positions
    check_max_lengths(config, tok, {"--passage-max-length": 128, "--query-max-length": 3}, 8)
    with pytest.raises(SystemExit, match=r"--passage-max-length 200 is beyond the 128 positions of bert "
                                         r"\(max_position_embeddings\): give at most 128"):
        check_max_lengths(config, tok, {"--passage-max-length": 200}, 8)
    check_max_lengths(config, tok, {"--rerank-max-length": 127}, 8)  # padded to 128: fits
    with pytest.raises(SystemExit, match=r"--rerank-max-length 129 \(padded to 136, a multiple of "
                                         r"--pad-to-multiple-of 8\) is beyond the 128 positions"):
        check_max_lengths(config, tok, {"--rerank-max-length": 129}, 8)
    with pytest.raises(SystemExit, match=r"--query-max-length 2: the tokenizer adds 2 special token\(s\) to every "
                                         r"text; give at least 3"):
        check_max_lengths(config, tok, {"--query-max-length": 2}, 8)


def test_a_decoder_beyond_its_positions_is_a_warning(capsys):
    from transformers import AutoTokenizer

    from tests.conftest import minilm_dir

    config = causal_config("qwen3")  # 128 positions, rotary
    check_max_lengths(config, AutoTokenizer.from_pretrained(minilm_dir()), {"--passage-max-length": 304}, 8)
    assert "warning: --passage-max-length 304 is beyond the 128 positions of qwen3" in capsys.readouterr().out


def test_a_max_length_that_is_not_a_multiple_of_the_padding_pads_up_and_truncates_at_it(tokenizer):
    long = " ".join(["word"] * 100)
    for n in (30, 100, 20):
        batch = tokenize(tokenizer, [long, "short text"], n, pad_to_multiple_of=8)
        assert batch["input_ids"].shape[1] == -(-n // 8) * 8  # padded up to the multiple
        assert batch["attention_mask"].sum(1).tolist()[0] == n  # truncated at the max length
        plain = tokenize(tokenizer, [long, "short text"], n)
        assert torch.equal(batch["input_ids"][:, :n], plain["input_ids"])


@pytest.mark.parametrize("argv,says", [
    (["--n-passages", "1"], "--n-passages 1: a reranker learns by ranking"),
    (["--sharded-checkpoints"], "--sharded-checkpoints: only with --parallel fsdp2"),
    (["--lora-alpha", "8"], "--lora-alpha: only with --lora-rank"),
    (["--merge-tolerance", "0.01"], "--merge-tolerance: only with --merge-alphas"),
    (["--dev-neighbours", "5"], "--dev-neighbours: only with --dev-queries"),
    (["--guard-margin", "0.01"], "--guard-margin: only with --guard-beir"),
])
def test_flags_that_cannot_go_together_are_one_sentence(argv, says):
    with pytest.raises(SystemExit, match=says.replace("(", r"\(")):
        cli.parse(cli.reranker_parser(), argv)


@pytest.mark.parametrize("argv,says", [
    (["--loss-directions", "p2q,q2p"], "--loss-directions p2q,q2p: give q2p first"),
    (["--loss-directions", "q2p,p2q,p2q"], "--loss-directions q2p,p2q,p2q: give q2p first (the term holding each "
                                           "query's positive), then any of p2q, q2q, p2p, each once"),
    (["--loss-directions", "q2p,p2q", "--no-in-batch-negatives"], "with --no-in-batch-negatives: the terms beyond"),
    (["--loss-directions", "q2p,q2q", "--loss-partition", "per-direction"], "--loss-partition per-direction with "
                                                                            "--loss-directions q2p,q2q: a q2q or p2p"),
    (["--guide-margin", "0.1"], "--guide-margin: only with --guide-model"),
    (["--guide-margin-strategy", "relative"], "--guide-margin-strategy: only with --guide-model"),
    (["--distill-loss", "margin-mse"], "--distill-loss margin-mse: only with --distill-weight above 0"),
    (["--distill-embeddings", "cosine"], "--distill-embeddings: only with --teacher-model"),
    (["--embedding-distill-weight", "2"], "--embedding-distill-weight: only with --teacher-model"),
    (["--distill-loss", "margin-mse", "--distill-weight", "1", "--teacher-temperature", "0.05"],
     "--teacher-temperature with --distill-loss margin-mse"),
])
def test_the_training_signals_flags_that_cannot_go_together_are_one_sentence(argv, says):
    with pytest.raises(SystemExit, match=says.replace("(", r"\(").replace(")", r"\)")):
        cli.parse(cli.biencoder_parser(), argv)


def test_a_bad_loss_direction_is_one_argparse_line_and_a_reranker_has_none(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(cli.biencoder_parser(), ["--loss-directions", "q2p,d2d"])
    assert e.value.code == 2 and "argument --loss-directions: must be one of q2p, p2q, q2q, p2p, got 'd2d'" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.parse(cli.reranker_parser(), ["--loss-directions", "q2p,p2q"])
    assert e.value.code == 2 and "--loss-directions" in capsys.readouterr().err


def test_a_guide_or_teacher_of_another_vocabulary_kind_or_size_is_one_sentence(tiny_model_dir, tiny_decoder_dir):
    from retrieval_kit.evaluate import load_guide

    with pytest.raises(SystemExit, match=f"--guide-model {tiny_decoder_dir}: its tokenizer's vocabulary .* is not the "
                                         "trained model's .*: give a model of the same tokenizer"):
        load_guide(tiny_decoder_dir, load_tokenizer(tiny_model_dir))
    guide, head = load_guide(tiny_model_dir, load_tokenizer(tiny_model_dir))  # the base itself: frozen
    assert head.NAME == "single-vector" and not any(p.requires_grad for p in guide.parameters())
    from retrieval_kit.heads import multi_vector

    for like, says in (((multi_vector, 32), "a single-vector model of 32 dimensions, the trained one a multi-vector "
                                            "of 32: .* give a teacher of the same kind and size"),
                       ((head, 16), "the trained one a single-vector of 16: .*pass --dense-dim 32 \\(a Dense projection "
                                    "to its size, trained with the model and exported\\), or give a teacher of the same size")):
        with pytest.raises(SystemExit, match=f"--teacher-model {tiny_model_dir}: .*{says}"):
            load_guide(tiny_model_dir, load_tokenizer(tiny_model_dir), flag="--teacher-model", like=like)


def test_warmup_past_the_last_step_is_a_warning(capsys):
    cli.parse(cli.biencoder_parser(), ["--warmup-steps", "10", "--max-steps", "2"])
    assert "warning: --warmup-steps 10 > --max-steps 2: the LR never reaches --lr" in capsys.readouterr().out


def test_evaluate_refuses_a_biencoder_as_reranker_and_dims_beyond_the_embedding(tiny_model_dir, small_beir, tmp_path):
    from retrieval_kit.export import export_model

    out = export_model(str(tmp_path / "bi"), load_encoder(tiny_model_dir), load_tokenizer(tiny_model_dir),
                       {"kind": "biencoder", "pooling": "avg", "normalize": True, "query_prefix": "",
                        "passage_prefix": "", "query_max_length": 32, "passage_max_length": 32})
    for extra, says in ((["--reranker", out], f"{out}: a biencoder export (its retrieval_kit.json), not a reranker"),
                        (["--truncate-dims", "16,64"], "--truncate-dims 16,64: " + out + " embeds in 32 dimensions")):
        res = python_run(["-m", "retrieval_kit.evaluate", "--model", out, "--beir", small_beir, *extra],
                         cwd=ROOT)
        assert res.returncode in (1, 2) and "Traceback" not in res.stderr and says in res.stderr, res.stderr[-2000:]


def test_a_full_disk_reads_the_same_from_python_torch_save_and_tokenizers(tokenizer):
    """/dev/full fails every write with ENOSPC: each writer's own error becomes the one reason."""
    from retrieval_kit.flags import os_reason, writing

    writers = {"tokenizers": lambda: tokenizer.backend_tokenizer.save("/dev/full"),
               "torch.save": lambda: torch.save({"w": torch.zeros(100_000)}, "/dev/full"),
               "python": lambda: open("/dev/full", "w").write("x" * 100_000)}
    for name, write in writers.items():
        with pytest.raises(Exception) as got:
            write()
        assert os_reason(got.value) in ("No space left on device", "the file could not be written whole (a full disk "
                                        "or a file-size limit)"), (name, got.value)
        with pytest.raises(SystemExit, match=r"cannot write the export: .+; the last checkpoint is intact"):
            with writing("the export", then=lambda: "the last checkpoint is intact"):
                write()
    with pytest.raises(ValueError):  # anything else is a bug: its traceback stays
        with writing("the export"):
            raise ValueError("not a write")


def test_a_log_write_that_fails_is_one_sentence_naming_the_newest_checkpoint(tmp_path):
    from retrieval_kit.log import Logger

    logger = Logger(str(tmp_path), {}, total_steps=10)
    logger.log(1, {"loss": 1.0})
    logger.jsonl = open("/dev/full", "w")  # the disk fills up mid-run
    with pytest.raises(SystemExit, match=f"cannot write the run's logs in {tmp_path}: No space left on device; the "
                                         "newest intact checkpoint is none: free space, then continue with --resume "
                                         "auto"):
        logger.log(2, {"loss": 0.5})
    logger.jsonl = open(tmp_path / "metrics.jsonl", "a")
    logger.close()


def test_select_best_keeps_the_best_in_its_direction_and_refuses_a_metric_no_validation_logs():
    from retrieval_kit.loop import LoopState

    state, seen = LoopState(), []
    for step, loss, acc in ((0, 1.0, 0.5), (2, 0.8, 0.4), (4, 0.9, 0.7)):
        logged = {"train": {"step": step, "loss": 3.0}, "val": {"step": step, "loss": loss, "acc@1": acc}}
        seen.append(state.observe("val/loss", logged, step))
    assert seen == [True, True, False] and state.best == {"metric": "val/loss", "value": 0.8, "step": 2}
    state = LoopState()
    assert [state.observe("val/acc@1", {"val": {"step": s, "acc@1": a}}, s) for s, a in ((0, .5), (2, .4), (4, .7))] \
        == [True, False, True]
    assert not state.observe("val/acc@1", {"val": {"step": 4, "acc@1": .9}}, 5)  # no validation at step 5
    with pytest.raises(SystemExit, match=r"--select-best val/ndcg@10: no validation of this run logs it; it logs "
                                         r"val/loss, val/acc@1"):
        LoopState().observe("val/ndcg@10", {"val": {"step": 0, "loss": 1.0, "acc@1": 0.5}}, 0)
    with pytest.raises(SystemExit, match="--select-best dev/ndcg@10: no validation"):
        LoopState().observe("dev/ndcg@10", {"val": {"step": 0, "loss": 1.0}}, 0)


# ----- issue 41: the newest surfaces answer each mistake with one sentence -----------------------------------

@pytest.mark.parametrize("parser,argv,says", [
    ("biencoder", ["--select-best", "val/loss", "--val-file", ""], "--select-best val/loss: no validation of this run "
                                                                   "logs val/* (it logs nothing): give --val-file"),
    ("reranker", ["--select-best", "val/mrr", "--val-file", ""], "--select-best val/mrr: no validation"),
    ("biencoder", ["--select-best", "beir/ndcg@10"], "no validation of this run logs beir/* (it logs val/*): give "
                                                     "--eval-beir"),
    ("reranker", ["--select-best", "dev_fused/ndcg@10"], "give --dev-queries and --dev-biencoder"),
    ("biencoder", ["--select-best", "val/ndcg@10"], "--select-best val/ndcg@10: val/* holds loss, acc@1, mrr"),
    ("reranker", ["--head", "lm", "--lm-tokens", "yes,no,maybe"], "--lm-tokens: 3 word(s) (yes,no,maybe); give "
                                                                  "exactly two"),
    ("reranker", ["--head", "lm", "--lm-tokens", "yes"], "--lm-tokens: 1 word(s) (yes); give exactly two"),
    ("reranker", ["--lm-tokens", "true,false"], "--lm-tokens: only with --head lm"),
])
def test_orphan_and_impossible_flags_of_the_newest_surfaces_are_one_sentence(parser, argv, says):
    make = cli.biencoder_parser if parser == "biencoder" else cli.reranker_parser
    with pytest.raises(SystemExit, match=says.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        cli.parse(make(), argv)


def test_select_best_on_a_split_the_run_validates_passes_the_start_up_check(tiny_model_dir):
    cli.parse(cli.biencoder_parser(), ["--select-best", "val/acc@1"])
    cli.parse(cli.biencoder_parser(), ["--select-best", "beir_dim64/ndcg@10", "--eval-beir", "data/eval"])
    cli.parse(cli.reranker_parser(), ["--select-best", "dev_best/ndcg@10", "--dev-queries", "8", "--dev-biencoder",
                                      tiny_model_dir])


def test_head_lm_on_an_encoder_and_a_lora_rank_wider_than_a_layer_are_refused(tiny_model_dir):
    from retrieval_kit import lora
    from retrieval_kit.heads import lm

    with pytest.raises(SystemExit, match=r"--head lm: .* is a bert encoder, not a causal LM"):
        lm.load(tiny_model_dir)
    model = load_encoder(tiny_model_dir)  # 32 wide
    lora.apply_lora(load_encoder(tiny_model_dir), 32, 64.0)
    with pytest.raises(SystemExit, match=r"--lora-rank 33: above the width of the targeted layer "
                                         r"encoder\.layer\.0\.attention\.self\.query \(32: 32 in, 32 out\)"):
        lora.apply_lora(model, 33, 66.0)


def test_a_run_lock_that_is_not_a_file_is_named(tmp_path):
    from retrieval_kit.rundir import acquire_lock

    (tmp_path / "run.lock").mkdir()
    assert acquire_lock(str(tmp_path)) == (f"--output-dir {tmp_path}: {tmp_path}/run.lock is not a file (the "
                                           "run-folder lock is one): remove it, or use another --output-dir")


@pytest.mark.slow
def test_the_tools_answer_the_newest_mistakes_without_a_traceback(tiny_model_dir, tmp_path):
    """plan with a world of 0 or below, an encoder planned as an LM reranker, a partial config (a note, exit 0);
    a reranker export given where a bi-encoder is asked for (evaluate's --model, train_reranker's --dev-biencoder)."""
    import json

    from retrieval_kit.export import export_reranker
    from retrieval_kit.heads.classifier import load as load_reranker

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps({"model_type": "bert"}))
    rr = str(tmp_path / "rr")
    export_reranker(rr, load_reranker(tiny_model_dir), load_tokenizer(tiny_model_dir),
                    {"kind": "reranker", "pooling": "native", "prompt_template": "pair", "rerank_max_length": 32,
                     "append_eos": False, "padding_side": "right", "pad_to_multiple_of": 8})
    cases = [(["-m", "retrieval_kit.plan", "--model", tiny_model_dir, "--world-size", "0", "--parallel", "fsdp2"],
              2, "argument --world-size: must be a positive integer, got 0"),
             (["-m", "retrieval_kit.plan", "--model", tiny_model_dir, "--world-size", "-2"], 2, "got -2"),
             (["-m", "retrieval_kit.plan", "--model", tiny_model_dir, "--head", "lm"], 1,
              "is a bert encoder, not a causal LM"),
             (["-m", "retrieval_kit.plan", "--model", str(partial)], 0,
              f"note: {partial}/config.json does not set vocab_size, hidden_size, num_hidden_layers, "
              "intermediate_size, num_attention_heads: planned with transformers' defaults for bert (vocab_size 30522, "
              "hidden_size 768"),
             (["-m", "retrieval_kit.evaluate", "--model", rr, "--beir", "data/eval"], 1,
              f"{rr}: a reranker export (its retrieval_kit.json), not a bi-encoder"),
             ([f"{ROOT}/train_reranker.py", "--model", tiny_model_dir, "--dev-queries", "4", "--dev-biencoder", rr,
               "--output-dir", str(tmp_path / "run")], 1, f"{rr}: a reranker export (its retrieval_kit.json), not a "
                                                          "bi-encoder")]
    for argv, rc, says in cases:
        res = python_run(argv, cwd=ROOT)
        out = res.stdout + res.stderr
        assert res.returncode == rc and "Traceback" not in out and says in out, (argv, out[-2000:])


@pytest.mark.parametrize("value", ["nan", "inf", "x"])
def test_a_lexical_head_bias_that_is_not_a_finite_number_is_argparses_one_line(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(cli.biencoder_parser(), ["--head", "sparse", "--lexical-head-bias", value])
    assert e.value.code == 2 and "argument --lexical-head-bias: must be a" in capsys.readouterr().err
